// tree_build_gpu_block.cuh: the CTA as tree_build_parallel.h's build wants it (GpuBlock: its
// phases' collectives on warp shuffles and barriers, the queue's batches, the profiling probes).
// Included by tree_build_parallel.cu alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include <stdint.h>

#include "tree_build_device.cuh"
#include "tree_build_parallel.h"

namespace kdt {
namespace {

// Queue batches of at most kBallotBatch entries test their ranks by ballots (GpuBlock::expand).
constexpr int kBallotBatch = 32;

// The block as tree_build_parallel.h wants it: a phase runs on every thread, then a barrier;
// an exclusive scan and a histogram suffix pick as collectives (warp shuffles, two barriers).
struct GpuBlock {
  int* wsum;  // [34] scratch of the collectives (shared memory)
#if defined(KDT_PAR_PROFILE)
  long long t0 = 0;
  int nmark = 0;
  long long* marks;  // [192] shared memory (a local array here would be zeroed per thread)
  int* ids;          // [192]
#endif
  __device__ int threads() const { return blockDim.x; }
  // chain[d + 1] = lp[0][0] + ... + lp[d][0] (chain[0] = 0; L <= 32: one lane per depth, a
  // shuffle scan; they are used only once the float64 sums are known exact, so any order gives
  // the same bits), and *fmin = min over d of ordered(chain[d] + lp[d][kc - 1]). Warp `warp`
  // only (0 unless the caller picks one), no barrier: the caller's next phase ends with one
  // before anything reads them.
  __device__ void chain_sums(const float* lp, int L, int K, int kc, double* chain,
                             unsigned long long* fmin, int warp = 0) {
    const int t = threadIdx.x & 31;
    if ((int)(threadIdx.x >> 5) == warp) {
      const double v = t < L ? (double)lp[(size_t)t * K] : 0.0;
      double x = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(kFull, x, o);
        if (t >= o) x += y;
      }
      if (t < L) chain[t + 1] = x;
      if (t == 0) chain[0] = 0.0;
      const unsigned long long u =
          t < L ? tree::par::ordered((x - v) + (double)lp[(size_t)t * K + kc - 1]) : ~0ull;
      const unsigned hi = __reduce_min_sync(kFull, (unsigned)(u >> 32));
      const unsigned lo = __reduce_min_sync(kFull, (unsigned)(u >> 32) == hi ? (unsigned)u : ~0u);
      if (t == 0) *fmin = ((unsigned long long)hi << 32) | lo;
    }
  }
  // For q < m: lens[q] = len(q) and off[q] = lens[0] + ... + lens[q - 1]; returns the total.
  // A chunk of T entries at a time: warp scans, the warps' totals through wsum, two barriers
  // (the second makes off and lens visible and frees wsum).
  template <class F>
  __device__ int offsets(int m, int* off, uint16_t* lens, F len) {
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, nw = blockDim.x >> 5;
    int base = 0;
    for (int q0 = 0; q0 < m; q0 += blockDim.x) {
      const int q = q0 + t;
      const int n = q < m ? len(q) : 0;
      const int incl = warp_inclusive(n, lane);
      if (lane == 31) wsum[w] = incl;
      __syncthreads();
      int before = 0, all = 0;
      for (int i = 0; i < nw; ++i) {
        const int v = wsum[i];
        before += i < w ? v : 0;
        all += v;
      }
      if (q < m) {
        off[q] = base + before + incl - n;
        lens[q] = (uint16_t)n;
      }
      base += all;
      __syncthreads();
    }
    return base;
  }
  // The queue (tree_build_parallel.h, section 1'): entries [1, n0) are written (the first runs;
  // probe gives the chain nodes among them nothing to expand). Warp w of W takes the w-th of W
  // equal shares of them as its first batch, then, batch by batch, the children it wrote itself:
  // a batch's run lengths (probe(i, &u): the row of i's children and the least log-prob that
  // keeps one, or nullptr; len(i): tree::par::probe_len), one atomic on *work (the entries
  // allocated) for all its runs, placed contiguously there in batch order, and the children
  // written, a child a lane (put(parent(i), i, e, r) writes rank r of entry i into entry e,
  // score and key, and returns its cand, stored here, and its score; live(child): whether it has
  // a child of its own). No entry passes between warps, so no entry waits on a
  // ready flag or a fence: a __syncwarp orders a batch's writes before the next batch reads
  // them. A batch of at most kBallotBatch entries tests its ranks by ballots (below); a larger
  // one writes its runs' offsets to off[i] and each child finds its run there by a search. kc:
  // the ranks a run may take (<= 64).
  // Returns the entries allocated, or -1 when they would pass cap (the pool is then incomplete).
  // *work must hold n0 (written before a barrier). Every thread calls it; it ends with a barrier.
  // Profiling probes (thread 0: warp 0's batches, the share that holds the root's rank-0 child): 70
  // after a batch's run lengths, 71 once its runs are placed, 72 once its children are written.
  // (Dealing the root's run out a rank at a time instead, warp w taking ranks w, w + W, ..., so
  // that the best ranks' subtrees go to different warps: H200, bench.tree_ab, kernel alone,
  // 1.03-1.06x at budgets 33 to 63, bs 1 to 256 (bs 64, budget 63: 14.29 -> 15.11 us). The
  // rank-0 subtree sets the queue's depth either way: on bench inputs the pool runs as deep as
  // the tree it holds, 4.4 levels on average and at most 9 against the tree's 7, at bs 64. A
  // narrow batch's offsets from seven bit-plane ballots and each child's run from a lane mask
  // of the run starts, instead of the two five-shuffle chains below (3507b8f): 0.98-1.01x.
  // Sharing a batch's entries past its first 32 with idle warps instead, 32 at a time through
  // slots in shared memory that idle warps poll, with a count of the busy warps and the
  // chunks not taken to end: 1.06-1.07x at bs 1 and 64, budgets 47 and 63, 0.98-0.99x at bs
  // 16 and 1024. A wide batch no longer took 2.0k cycles, but the polling slowed every batch
  // (a placement's atomic 335 -> 485 cycles, its run lengths 620 -> 730) and the end took
  // ~0.85k cycles more; sleeping 32 ns between polls measured the same. Not kept. Taking the
  // pool in chunks of at least 32 entries a warp, so that a batch whose runs fit in what is
  // left of its warp's chunk takes no atomic (a chunk's unused entries made holes of score
  // -inf, which no phase keeps): 1.01-1.07x at budgets 33-63, bs 1-1024. The placement did
  // not get cheaper (its probe 344 -> 561-595 cycles at bs 64, budget 63) and the queue's end,
  // marking the last holes, took ~400 cycles more. Not kept. Each child's run length counted
  // by the lane that writes it, as it writes it, and carried in that lane into the next batch
  // (the lane that takes that entry when the batch has at most 32): a later batch's run lengths
  // took ~220 cycles against ~620, but its children ~1.1k against ~0.6k, the count now on the
  // write's chain (profile, bs 64, budget 63, seed 5); H200, bench.tree_ab, seeds 15 and 5:
  // 1.00-1.016x at budgets 33-63, bs 1-1024. Not kept. A look-ahead: each batch of at most 32
  // entries also counting and writing the runs of its entries' rank-0 children (their scores
  // known from the entries', so the counts do not wait on the writes), those children then not
  // expanded again, so that a rank-0 chain advances two levels a batch. A replay of the queue
  // in Python put the deepest warp's batches at 5 / 4 / 4 against 7 / 6 / 6 (bench inputs, bs
  // 64, budget 63, seeds 15 / 5 / 7). It was bit-exact (the CUDA tree tests passed), but a
  // batch's run lengths took 1.5-2.5k cycles against 0.75-1.2k and its children ~0.9k against
  // ~0.65k (profile, bs 64, budget 63, seed 5: warp 0 ran 4 batches instead of 5); H200,
  // bench.tree_ab, seeds 15 and 5: budget 63 1.02-1.13x at bs 1-1024, 47 1.06-1.19x, 33
  // 0.98-1.14x. A narrow batch's counts from one redux.sync of per-entry bytes instead of the
  // eight ballots (no look-ahead): 1.00-1.025x at budgets 33-63. Neither kept. The first runs
  // dealt out an entry at a time instead of in shares (warp w taking entries 1 + w, 1 + w + W,
  // ...), so that the runs' heads, whose subtrees are the largest, go to different warps: H100,
  // bench.tree_ab against the shares, kernel alone, budget 63, seeds 15 / 5 / 2: bs 64 0.992 /
  // 0.993 / 1.036x, bs 16 0.953-0.987x, bs 1 0.98-1.00x, bs 256 0.98-1.01x; the suites' draws of
  // run 20261205T164124Z at bs 64 0.982x (kernels) and 0.998x (tree_build); budget 33 bs 64
  // 1.005-1.056x, budget 255 (no queue: the library's own offset) 1.012-1.014x. Not kept.)
  template <class Probe, class ParentOf, class Put, class Live>
  __device__ int expand(unsigned* work, uint32_t* cand, int* off, int n0, int cap, int kc,
                        Probe probe, ParentOf parent, Put put, Live live) {
    auto len = [&](int i) { return tree::par::probe_len(probe, i, kc); };
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int share = div_uniform(n0 - 1 + nw - 1, nw);  // of the first runs, a warp's first batch
    int lo = 1 + (threadIdx.x >> 5) * share, hi = min(n0, lo + share);  // the batch: [lo, hi)
    while (lo < hi) {
      const int m = hi - lo;
      int total, base;
      bool more = false;  // a child this lane wrote has a child of its own (live)
      if (m <= kBallotBatch) {
        // A batch of up to 32 entries (the deepest subtrees' mostly are): G = 8, 4, 2 or 1 lanes
        // an entry (up to 4, 8, 16 or 32 entries; lg: log2 G), lane `sub` of entry j testing
        // ranks sub, sub + G, ... (kc <= 64), four ranks a round, and a round more only while
        // some entry passed every rank tested (its last lane in the round's last ballot). A
        // rank's test is one ballot bit, the runs' lengths and offsets are population counts of
        // the ballots, a lane's passes are its first `mine` ranks (runs are prefixes), and the
        // lane that passed a rank writes that child: no thread searches its run (count_ge64), no
        // scan, no search for a child's run. H200, bench.tree_ab against the kernel before
        // (batches of 5 to 32 entries a lane an entry: its count by count_ge64, a warp scan, each
        // child's run found by a search over the lanes' offsets), kernel alone, 3 rounds, one
        // run, bit-exact: seed 15, budget 63 bs 1 0.942x, bs 4 0.877x, bs 16 0.885x, bs 64 0.893x
        // (10.58 -> 9.46 us), bs 132 0.905x, bs 256 0.903x, bs 1024 0.925x; budget 47 bs 64
        // 0.933x; 33 bs 64 0.958x, bs 1 0.943x; 1023 (no queue) 0.999x; seed 5, budget 63 bs 1
        // 0.946x, bs 4 0.922x, bs 16 0.916x, bs 64 0.988x, bs 256 0.896x, 47 bs 64 0.890x; the
        // kernels suite's draws of run 20261206T020939Z, budget 63: bs 1 0.865x (9.27 -> 8.01
        // us), bs 4 0.888x, bs 16 1.002x, bs 64 0.916x (10.38 -> 9.51), bs 256 0.901x; thirteen
        // fresh bs 64 draws (seeds 101-113, 2 rounds): 0.850-0.964x, 9.30-11.62 us (median
        // 10.06) -> 8.17-10.51 (median 9.01). Up to 16 entries alone (17 to 32 as before), in
        // the same runs: seed 15 budget 63 0.887-1.003x (bs 64 0.951x), seed 5 0.930-1.003x (bs
        // 64 0.997x), the suite's draws 0.906-1.021x: the batches of 17 to 32 are a good part of
        // it (bench inputs at bs 64, budget 63: the slowest warps' widths run up to 37). Up to
        // 16 as a path of its own beside the one for up to 4 entries it replaced (eight lanes
        // an entry, all 64 ranks in eight ballots): the same times, 80 registers against 70 and
        // 9 KB more SASS; up to 32 the queue's kernel takes 70 registers and 106 KB of SASS
        // against 78 and 117 before. (That path for up to 4, against the same kernel without
        // it, H200, seed 15 / seed 5: budget 63 bs 64 0.959x / 0.954x, bs 4 0.985x / 0.998x, bs
        // 16 0.984x, bs 1 0.999x / 0.978x, bs 256 0.996x / 0.975x, bs 1024 1.000x; budget 33 bs
        // 64 0.916x / 0.987x, bs 1 0.964x; budget 47 bs 64 0.929x / 1.008x. Four lanes an entry
        // for every batch up to 8, sixteen ranks a lane, against it: 1.01-1.07x at budget 63;
        // sixteen (batches up to 2): 1.00-1.03x at bs 1-64, where eight took 0.98-0.985x.)
        const int lg = m <= 4 ? 3 : m <= 8 ? 2 : m <= 16 ? 1 : 0, G = 1 << lg;
        const int j = lane >> lg, sub = lane & (G - 1), i = lo + j;
        float u = 0.0f;
        const float* row = j < m ? probe(i, &u) : nullptr;
        const auto par = parent(j < m ? i : lo);  // its loads are probe's (no store between)
        const unsigned below = (1u << (G * j)) - 1u;  // G j <= 31
        // The lanes sub == G - 1.
        const unsigned last = lg == 3   ? 0x80808080u
                              : lg == 2 ? 0x88888888u
                              : lg == 1 ? 0xaaaaaaaau
                                        : 0xffffffffu;
        int mine = 0, excl = 0;  // mine: the ranks this lane passed (its first `mine`)
        total = 0;
        for (int k0 = 0; k0 < 64 >> lg; k0 += 4) {
          unsigned b = 0;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int k = k0 + q, r = sub + (k << lg);
            const bool p = row != nullptr && r < kc && row[r] >= u;
            b = __ballot_sync(kFull, p);
            mine += p;
            excl += __popc(b & below);
            total += __popc(b);
          }
          if ((b & last) == 0u) break;
        }
        mark(70);
        base = place(work, total, lane);
        if (total == 0 || base + total > cap) break;
        for (int k = 0; k < mine; ++k) {
          const int r = sub + (k << lg), e = base + excl + r;
          const auto ch = put(par, i, e, r);
          cand[e] = ch.cand;
          more |= live(ch);
        }
      } else {
        int run = 0;
        for (int j0 = 0; j0 < m; j0 += 32) {
          const int j = j0 + lane;
          const int c = j < m ? len(lo + j) : 0;
          const int incl = warp_inclusive(c, lane);
          if (j < m) off[lo + j] = run + incl - c;
          run += __shfl_sync(kFull, incl, 31);
        }
        mark(70);
        total = run;
        base = place(work, total, lane);
        if (total == 0 || base + total > cap) break;
        __syncwarp();  // the offsets are visible to every lane
        for (int k = lane; k < total; k += 32) {
          const int i = tree::par::last_pass(lo, hi, [&](int x) { return off[x] <= k; });
          const auto ch = put(parent(i), i, base + k, k - off[i]);
          cand[base + k] = ch.cand;
          more |= live(ch);
        }
      }
      __syncwarp();  // the children are visible to every lane: the next batch
      mark(72);
      lo = base;
      // No child with a child of its own: the next batch would count only empty runs.
      hi = __any_sync(kFull, more) ? base + total : base;
    }
    __syncthreads();
    const int a = (int)*work;
    return a > cap ? -1 : a;
  }
  // count_at_least64 for a run of the rank-0 chain, 0 when not live (every lane alike): a
  // lane's ranks are lane and lane + 32 (kc <= 64), the count two ballots' population. (Each
  // thread's own count_at_least64, as before, is ~100 instructions on the first runs' chain:
  // H200, bench.tree_ab against the kernel before, in one run, the narrow batches alone took
  // 1.01-1.02x at budget 63 and 0.95-0.99x at 33, with these counts too 0.96-0.99x and
  // 0.92-0.95x.)
  __device__ int count_run(bool live, const float* row, int kc, double s, double t) {
    const int lane = threadIdx.x & 31;
    const float u = tree::par::float_at_least(t - s);
    const bool p0 = live && lane < kc && row[lane] >= u;
    const bool p1 = live && lane + 32 < kc && row[lane + 32] >= u;
    return __popc(__ballot_sync(kFull, p0)) + __popc(__ballot_sync(kFull, p1));
  }
  // The queue's allocation: a batch's `total` entries at the end of the pool, one atomic on
  // *work by lane 0; returns the first (every lane). Probe 71 ends it.
  __device__ int place(unsigned* work, int total, int lane) {
    unsigned old = 0;
    if (lane == 0 && total) old = atomicAdd(work, (unsigned)total);
    const int base = (int)__shfl_sync(kFull, old, 0);
    mark(71);
    return base;
  }
  // Profiling probe (development builds with -DKDT_PAR_PROFILE): thread 0 of every block
  // records the cycle counter; print_marks prints each block's intervals.
  __device__ void mark(int id) {
#if defined(KDT_PAR_PROFILE)
    if (threadIdx.x == 0 && nmark < 192) {
      marks[nmark] = clock64();
      ids[nmark++] = id;
    }
#else
    (void)id;
#endif
  }
  __device__ void print_marks() {
#if defined(KDT_PAR_PROFILE)
    if (threadIdx.x == 0) {
      long long prev = t0;
      for (int i = 0; i < nmark; ++i) {
        printf("PROF %d %d %lld\n", (int)blockIdx.x, ids[i], marks[i] - prev);
        prev = marks[i];
      }
    }
#endif
  }
  // x / d for x >= 0 and a d the same in every thread (a block size, warps a block): a shift
  // when d is a power of two, as the launch's block sizes are (a run-time division is ~20
  // instructions on the thread's chain).
  __device__ static int div_uniform(int x, int d) {
    return (d & (d - 1)) == 0 ? x >> (__ffs(d) - 1) : x / d;
  }
  template <class F>
  __device__ void run(F f) {
    f((int)threadIdx.x);
    __syncthreads();
  }
  __device__ static int warp_inclusive(int x, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, x, o);
      if (lane >= o) x += y;
    }
    return x;
  }
  // Exclusive scan of a[0..m) in place (each thread a contiguous chunk); returns the total. The
  // warps' totals go through wsum; each warp then sums those before it and all of them itself
  // (two redux.sync), so the scan takes two barriers. (Warp 0 scanning the totals behind a
  // barrier of its own, as before: H200, bench.tree_ab, kernel alone, seeds 15 and 5, every
  // case of budgets 33-1023 and bs 1-1024 took 0.977-0.997x this way.)
  __device__ int scan(int* a, int m) {
    const int T = blockDim.x, t = threadIdx.x, lane = t & 31, w = t >> 5, nw = T >> 5;
    const int per = m <= T ? 1 : (m + T - 1) / T;  // no division in the common case
    const int a0 = min(m, t * per), a1 = min(m, a0 + per);
    int s = 0;
    for (int i = a0; i < a1; ++i) s += a[i];
    const int x = warp_inclusive(s, lane);
    if (lane == 31) wsum[w] = x;
    __syncthreads();
    const int v = lane < nw ? wsum[lane] : 0;
    const int before = (int)__reduce_add_sync(kFull, (unsigned)(lane < w ? v : 0));
    const int total = (int)__reduce_add_sync(kFull, (unsigned)v);
    int run = before + x - s;
    for (int i = a0; i < a1; ++i) { const int u = a[i]; a[i] = run; run += u; }
    __syncthreads();  // a is visible to every thread, and wsum is free
    return total;
  }
  // The largest j with hist[j] + ... + hist[nb - 1] >= need (that sum in *got), or -1. Warp 0,
  // nb <= 32 * 8 bins of 8 per lane.
  __device__ int suffix_pick(const int* hist, int nb, int need, int* got) {
    const int t = threadIdx.x;
    if (t < 32) {
      constexpr int kPer = 8;
      const int b0 = t * kPer;
      int loc[kPer];
      int s = 0;
#pragma unroll
      for (int k = 0; k < kPer; ++k) { loc[k] = b0 + k < nb ? hist[b0 + k] : 0; s += loc[k]; }
      // Sum over the lanes above this one.
      int above = s;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_down_sync(kFull, above, o);
        if (t + o < 32) above += y;
      }
      above -= s;
      int j = -1, cnt = 0, run = above;
#pragma unroll
      for (int k = kPer - 1; k >= 0; --k) {
        run += loc[k];
        if (j < 0 && run >= need) { j = b0 + k; cnt = run; }
      }
      const unsigned m = __ballot_sync(kFull, j >= 0);
      if (t == 0) { wsum[33] = -1; wsum[32] = 0; }
      __syncwarp();
      if (m) {
        const int top = 31 - __clz((int)m);
        if (t == top) { wsum[33] = j; wsum[32] = cnt; }
      }
    }
    __syncthreads();
    const int j = wsum[33];
    *got = wsum[32];
    __syncthreads();
    return j;
  }
};

}  // namespace
}  // namespace kdt
