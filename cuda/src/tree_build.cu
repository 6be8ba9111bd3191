// tree_build.cu: CUDA backend of kdt_tree_build. One block per request; no host
// synchronisation and no allocation: safe under CUDA graph capture.
//
// KDT_TREE_BUILD (read per call on the host) picks the algorithm:
//   auto (the default, unset): warp for budgets <= tree::wrp::kAutoMaxBudget (31), parallel
//     above.
//   warp: tree_build_warp.h, one warp per request (one CTA of one warp per request up to bs 512,
//     up to four warps per CTA beyond); no block barrier; the frontier in registers (S = 16 and
//     32 slots per lane for budgets 256..1023: 151 and 253 registers on sm_90). Budget 1024 runs
//     the parallel build.
//   parallel: tree_build_parallel.h with 256 or 512 threads per block (an exact-sum check, then
//     level-by-level expansion under a rising score bound, or up to budget 63 a queue under a
//     fixed one, then a bucket sort of the kept nodes); a request it declines (log-probs whose
//     float64 sums may round, a positive log-prob or an unsorted row, or a pool overflow from
//     masses of exact ties) is built by the block's warp 0 with the serial warp selection
//     below, in the same launch.
//   serial: the earlier kernel below, 128 threads per block, the selection serial.
//
// Two serial selection variants, both reproducing the CPU order exactly (same float64 scores, same
// strict total order: score descending, then rank path ascending):
//   warp (default): warp 0 keeps the frontier as an unordered array; each pop is a warp-wide
//     argmax (each lane scans every 32nd entry, then a 5-step butterfly shuffle), so a pop costs
//     about F/32 + 5 comparisons of latency instead of a serial heap sift.
//   heap: thread 0 runs the binary heap of tree_build_core.h, the CPU backend's exact code.
// KDT_TREE_BUILD_VARIANT=heap|warp (read once, on the host) picks one for benchmarks and
// cross-checks; both are validated by the native tests.
//
// Shared memory per block, n = budget + 1 (<= 1025): 2 x n doubles (frontier and node scores),
// n uint64 (rank-path keys), 2 x n uint32 (packed candidates), 2 x n int16 (child lists)
// = 36 n bytes <= 36.9 KB (under the 48 KB that needs no opt-in, on sm_90 and sm_120).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#if defined(KDT_PAR_PROFILE) && !defined(KDT_PAR_REPEAT)
#define KDT_PAR_REPEAT 1
#endif
#include <cstring>

#include "common.h"
#include "pdl.cuh"
#include "tree_build_core.h"
#include "tree_build_parallel.h"
#include "tree_build_warp.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr int kThreads = 128;
constexpr uint32_t kNone = 0xFFFFFFFFu;  // "no candidate" in the warp argmax
constexpr unsigned kFull = 0xFFFFFFFFu;

size_t smem_bytes(int n) {
  return (size_t)n * (2 * sizeof(double) + sizeof(uint64_t) + 2 * sizeof(uint32_t) +
                     2 * sizeof(int16_t));
}

__device__ bool better(double sa, uint32_t ca, double sb, uint32_t cb, const tree::Scratch& s) {
  if (cb == kNone) return ca != kNone;
  if (ca == kNone) return false;
  if (sa != sb) return sa > sb;
  return tree::compare_cands(ca, cb, s) < 0;
}

// Warp-cooperative best-first selection for one request (called by all 32 lanes of a warp);
// returns the number of slots used (root included), as tree::build_one does.
__device__ int warp_build_one(const float* lp, int L, int K, int budget, const tree::Scratch& s) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    s.node_cand[0] = 0;
    s.node_key[0] = 0;
    s.node_score[0] = 0.0;
    s.first_child[0] = -1;
    s.next_sibling[0] = -1;
    s.heap_score[0] = (double)lp[0];
    s.heap_cand[0] = tree::pack(0, 0, 1);
  }
  int F = 1, count = 0;  // frontier size and nodes emitted: the same in every lane
  __syncwarp();
  while (F > 0 && count < budget) {
    double best_s = 0.0;
    uint32_t best_c = kNone;
    int best_i = -1;
    for (int i = lane; i < F; i += 32) {
      const double sc = s.heap_score[i];
      const uint32_t c = s.heap_cand[i];
      if (better(sc, c, best_s, best_c, s)) { best_s = sc; best_c = c; best_i = i; }
    }
    // Butterfly: both partners keep the better of the two, so every lane ends with the argmax
    // (the order is strict: distinct candidates have distinct rank paths).
    for (int off = 16; off > 0; off >>= 1) {
      const double os = __shfl_xor_sync(kFull, best_s, off);
      const uint32_t oc = __shfl_xor_sync(kFull, best_c, off);
      const int oi = __shfl_xor_sync(kFull, best_i, off);
      if (better(os, oc, best_s, best_c, s)) { best_s = os; best_c = oc; best_i = oi; }
    }
    const int parent = tree::cand_parent(best_c), rank = tree::cand_rank(best_c);
    const int depth = tree::cand_depth(best_c);
    const int i = ++count;
    const bool sib = rank + 1 < K, child = depth < L;
    __syncwarp();  // every lane is done reading the frontier before lane 0 rewrites it
    if (lane == 0) {
      s.node_cand[i] = best_c;
      s.node_key[i] = tree::cand_key(best_c, s);
      s.node_score[i] = best_s;
      s.first_child[i] = -1;
      s.next_sibling[i] = s.first_child[parent];  // prepend: lists run in descending index
      s.first_child[parent] = (int16_t)i;
      int f = F - 1;  // remove the winner: the last entry takes its slot
      s.heap_score[best_i] = s.heap_score[f];
      s.heap_cand[best_i] = s.heap_cand[f];
      const float* row = lp + (size_t)(depth - 1) * K;
      if (sib) {
        // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2)
        s.heap_score[f] = (best_s - (double)row[rank]) + (double)row[rank + 1];
        s.heap_cand[f++] = tree::pack(parent, rank + 1, depth);
      }
      if (child) {
        s.heap_score[f] = best_s + (double)lp[(size_t)depth * K];
        s.heap_cand[f++] = tree::pack(i, 0, depth + 1);
      }
    }
    F = F - 1 + (sib ? 1 : 0) + (child ? 1 : 0);
    __syncwarp();  // lane 0's writes are visible before the next scan
  }
  return count + 1;
}

// Visibility rows first, first + stride, ...: one ancestor walk per row (descending indices)
// emits the row's words from the last down (the warp writer: a lane per row).
__device__ void write_visibility_rows(uint32_t* vis, int n, int W, int used,
                                      const uint32_t* node_cand, int first, int stride) {
  for (int i = first; i < n; i += stride) {
    uint32_t* row = vis + (size_t)i * W;
    int cw = W - 1;
    uint32_t word = 0;
    if (i < used) {
      int x = i;
      for (;;) {
        const int xw = x >> 5;
        while (cw > xw) { row[cw--] = word; word = 0; }
        word |= 1u << (x & 31);
        if (x == 0) break;
        x = tree::cand_parent(node_cand[x]);
      }
    }
    while (cw >= 0) { row[cw--] = word; word = 0; }
  }
}

// Zeroes p[0, count) with the whole block: 16-byte stores between a scalar head and tail.
__device__ void block_zero(uint32_t* p, int count) {
  const int head = min(count, (int)((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / 4);
  const int body = (count - head) / 4;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  for (int k = threadIdx.x; k < body; k += blockDim.x) v[k] = make_uint4(0u, 0u, 0u, 0u);
  const int t = threadIdx.x;
  if (t < head) p[t] = 0u;
  const int tail = head + 4 * body;
  if (t < count - tail) p[tail + t] = 0u;
}

// The block writer: every word zeroed (block_zero), a block barrier (it orders the block's
// global writes), then each row's walk ORs nothing but stores only its nonzero words (at most
// depth + 1 of them). mark(id): a profiling probe.
template <class Mark>
__device__ void block_write_visibility(uint32_t* vis, int n, int W, int used,
                                       const uint32_t* node_cand, int first, Mark mark) {
  block_zero(vis, n * W);
  __syncthreads();
  mark(97);
  for (int i = first; i < used; i += blockDim.x) {
    uint32_t* row = vis + (size_t)i * W;
    int cw = i >> 5;
    uint32_t word = 0;
    int x = i;
    for (;;) {
      const int xw = x >> 5;
      if (xw != cw) { row[cw] = word; word = 0; cw = xw; }
      word |= 1u << (x & 31);
      if (x == 0) break;
      x = tree::cand_parent(node_cand[x]);
    }
    row[cw] = word;
  }
}

// The whole block writes one request's outputs from the node arrays (node order, slot 0 the
// root): slots, links, visibility words. root and seq_len: the request's (loaded early by the
// caller). mark(id): a profiling probe. (The parallel build writing every slot but
// first_child, and rows of up to two words walked through the pool, in its nodes phase
// instead, first_child alone after it: at bs 64, budget 63 the nodes phase took 1641 cycles
// against 568 and what followed it 682 against 1623, so budget 63 took 1.00-1.02x and budgets
// 127-1023 0.98-1.035x (H200, bench.tree_ab); the kernel's registers rose from 80 to 84-96,
// two blocks of 256 threads a multiprocessor instead of three, and bs 1024, budget 63 took
// 1.23-1.25x (capped at 80 with __maxnreg__, 1.01-1.13x everywhere). Not kept.)
template <class Mark>
__device__ void write_outputs(const TreeBuildArgs& a, int b, int n, int W, int used,
                              const uint32_t* node_cand, const double* node_score,
                              const int16_t* fc, const int16_t* ns, const int64_t* ids,
                              int64_t root, int64_t seq_len, Mark mark) {
  const size_t o = (size_t)b * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    write_tree_slot(a, o, i, used, root, seq_len, node_cand, node_score, fc, ns, ids);
  mark(96);
  // The rows start half the block's warps away from the slots, so that up to n = T / 2 the
  // slots and the rows are written by different warps at the same time, not one after the other
  // by the first n threads (H200, bench.tree_ab against rows from thread 0, kernel alone, seeds
  // 15 and 5: budget 63 0.978-0.989x at bs 1-1024, budget 33 0.984-0.985x at bs 64; budgets
  // 127-1023, whose rows take more than two words and follow a barrier, 1.000-1.004x). Rows of
  // at most two words: each thread writes its rows whole (zeros included), with no zeroing pass
  // and no barrier; wider rows zero the block first (block_write_visibility).
  const int first = (threadIdx.x + (blockDim.x >> 6) * 32) % blockDim.x;
  if (W <= 2)
    write_visibility_rows(a.visibility + o * W, n, W, used, node_cand, first, blockDim.x);
  else
    block_write_visibility(a.visibility + o * W, n, W, used, node_cand, first, mark);
  if (threadIdx.x == 0) a.num_nodes[b] = used;
}

template <bool kWarp>
__global__ void __launch_bounds__(kThreads) tree_build_kernel(TreeBuildArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  extern __shared__ double smem[];
  const int n = a.budget + 1, W = (n + 31) / 32;
  const int b = blockIdx.x;
  tree::Scratch s;
  s.heap_score = smem;
  s.node_score = smem + n;
  s.node_key = reinterpret_cast<uint64_t*>(smem + 2 * n);
  s.heap_cand = reinterpret_cast<uint32_t*>(smem + 3 * n);
  s.node_cand = s.heap_cand + n;
  s.first_child = reinterpret_cast<int16_t*>(s.node_cand + n);
  s.next_sibling = s.first_child + n;
  tree::set_key_layout(s, a.L, a.K);
  __shared__ int used;

  const size_t lk = (size_t)a.L * a.K;
  const float* lp = a.top_logp + b * lk;
  const int64_t* ids = a.top_ids + b * lk;
  if (kWarp) {
    if (threadIdx.x < 32) {
      const int u = warp_build_one(lp, a.L, a.K, a.budget, s);
      if (threadIdx.x == 0) used = u;
    }
  } else if (threadIdx.x == 0) {
    used = tree::build_one(lp, a.L, a.K, a.budget, s);
  }
  __syncthreads();

  write_outputs(a, b, n, W, used, s.node_cand, s.node_score, s.first_child, s.next_sibling, ids,
                a.root_ids[b], a.seq_lens[b], [](int) {});
}

// Asks L1 for the 128-byte lines of [p, p + bytes) (no registers, no wait): the output pass's
// token-id gather then finds them there instead of in L2.
__device__ void warp_prefetch_l1(const void* p, size_t bytes, int lane) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)127;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t q = first + 128 * (uintptr_t)lane; q < end; q += 128 * 32)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(q));
}

// Starts copying src[0, count) (global int64) into dst (shared) with cp.async, a lane's share
// at a time: no registers held, nothing waited for here (ids_wait, then a barrier, before
// another thread reads them). The token-id gather of the outputs then reads shared memory
// rather than waiting on a global load after the build (the warp build, kWarpIdsBytes).
__device__ void ids_copy_async(int64_t* dst, const int64_t* src, int count, int first,
                               int stride) {
  for (int i = first; i < count; i += stride) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst + i);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void ids_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Warp w of sw stages log-probs [32 P w, 32 P (w + 1)) of every round of 32 P sw into staged
// (shared memory) and checks each against the next one in its row (ck): P loads in flight per
// lane before the stores; the next value is lane l + 1's, lane 31's is lane 0's next one, and
// the warp's last is the next warp's first, which lane 31 loads besides. step32: 32 % K, a
// lane's column advance from one load to the next.
template <int P>
__device__ void stage_check(float* staged, const float* lp, int n_lp, int K, int step32, int w,
                            int sw, int lane, tree::par::Checked& ck) {
  for (int i0 = 32 * P * w; i0 < n_lp; i0 += 32 * P * sw) {  // uniform in the warp
    float v[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = i0 + 32 * k + lane;
      v[k] = i < n_lp ? __ldg(lp + i) : 0.0f;
    }
    const float last = lane == 31 && i0 + 32 * P < n_lp ? __ldg(lp + i0 + 32 * P) : 0.0f;
    int col = (i0 + lane) % K;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = i0 + 32 * k + lane;
      const float up = __shfl_down_sync(kFull, v[k], 1);
      const float wrap = __shfl_sync(kFull, v[k < P - 1 ? k + 1 : P - 1], 0);
      if (i < n_lp) {
        staged[i] = v[k];
        ck.add(v[k], col + 1 < K, lane < 31 ? up : k < P - 1 ? wrap : last);
      }
      col += step32;
      if (col >= K) col -= K;
    }
  }
}

// Lanes an entry in a queue batch of at most 32 / kSmallLanes entries (GpuBlock::expand).
constexpr int kSmallLanes = 8;

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
  // written, a child a lane (put(i, e, r) writes rank r of entry i into entry e, score and key,
  // and returns its cand, stored here). No entry passes between warps, so no entry waits on a
  // ready flag or a fence: a __syncwarp orders a batch's writes before the next batch reads
  // them. A batch of at most 32 / kSmallLanes entries tests its ranks by ballots (below); one
  // of at most 32 keeps its lengths and offsets in registers (a lane each; the children's runs
  // found by a binary search over the lanes' offsets); a larger one writes its offsets to
  // off[i] and searches them there. kc: the ranks a run may take (<= 64).
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
  // eight ballots (no look-ahead): 1.00-1.025x at budgets 33-63. Neither kept.)
  template <class Probe, class Put>
  __device__ int expand(unsigned* work, uint32_t* cand, int* off, int n0, int cap, int kc,
                        Probe probe, Put put) {
    auto len = [&](int i) { return tree::par::probe_len(probe, i, kc); };
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int share = (n0 - 1 + nw - 1) / nw;  // of the first runs, a warp's first batch
    int lo = 1 + (threadIdx.x >> 5) * share, hi = min(n0, lo + share);  // the batch: [lo, hi)
    while (lo < hi) {
      const int m = hi - lo;
      int total, base;
      if (m <= 32 / kSmallLanes) {
        // A narrow batch (the deepest subtree's are): kSmallLanes lanes an entry, lane `sub` of
        // entry j testing ranks sub, sub + G, ... (kc <= 64). A rank's test is one ballot bit,
        // the runs' lengths and offsets are population counts of the ballots, and the lane that
        // passed a rank writes that child: no thread searches its run (count_at_least64: ~100
        // instructions), no scan, no search for a child's run. H200, bench.tree_ab against the
        // same kernel without this path, kernel alone, 3 rounds, seed 15 / seed 5: budget 63
        // bs 64 0.959x / 0.954x, bs 4 0.985x / 0.998x, bs 16 0.984x, bs 1 0.999x / 0.978x, bs
        // 256 0.996x / 0.975x, bs 1024 1.000x; budget 33 bs 64 0.916x / 0.987x, bs 1 0.964x;
        // budget 47 bs 64 0.929x / 1.008x. Four lanes an entry (batches up to 8, sixteen ranks
        // a lane), against the kernel before it: 1.01-1.07x at budget 63; sixteen (batches up
        // to 2): 1.00-1.03x at bs 1-64, where eight took 0.98-0.985x.
        constexpr int G = kSmallLanes, R = 64 / G;
        static_assert(G >= 2 && R <= 32, "a lane's passes fit one word");
        const int j = lane / G, sub = lane % G, i = lo + j;
        float u = 0.0f;
        const float* row = j < m ? probe(i, &u) : nullptr;
        const unsigned below = (1u << (G * j)) - 1u;
        unsigned mine = 0;  // bit k: this lane's rank sub + G k passed
        int excl = 0, kend = 0;
        total = 0;
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const int r = sub + G * k;
          const bool p = row != nullptr && r < kc && row[r] >= u;
          const unsigned b = __ballot_sync(kFull, p);
          mine |= (unsigned)p << k;
          excl += __popc(b & below);
          total += __popc(b);
          kend += b != 0u;  // runs are prefixes: the ballots that hold a pass come first
        }
        mark(70);
        base = place(work, total, lane);
        if (total == 0 || base + total > cap) break;
        for (int k = 0; k < kend; ++k) {
          const int r = sub + G * k, e = base + excl + r;
          if ((mine >> k) & 1u) cand[e] = put(i, e, r);
        }
      } else if (m <= 32) {
        const int i = lo + lane;
        const int c = lane < m ? len(i) : 0;
        mark(70);
        const int incl = warp_inclusive(c, lane), excl = incl - c;
        total = __shfl_sync(kFull, incl, 31);
        base = place(work, total, lane);
        if (total == 0 || base + total > cap) break;
        for (int k0 = 0; k0 < total; k0 += 32) {
          const int k = k0 + lane;
          int q = 0;  // the last lane whose run starts at or before k
#pragma unroll
          for (int st = 16; st > 0; st >>= 1) {
            const int x = __shfl_sync(kFull, excl, q + st);
            if (x <= k) q += st;
          }
          const int qi = __shfl_sync(kFull, i, q), qx = __shfl_sync(kFull, excl, q);
          if (k < total) cand[base + k] = put(qi, base + k, k - qx);
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
          cand[base + k] = put(i, base + k, k - off[i]);
        }
      }
      __syncwarp();  // the children are visible to every lane: the next batch
      mark(72);
      lo = base;
      hi = base + total;
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
    const int per = (m + T - 1) / T;
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

// kStaged: the request's log-probs are copied to shared memory (tree::par::Plan::staged). A
// template argument rather than a run-time choice, so that every log-prob read compiles to a
// shared (or a global) load: a pointer that may point to either compiles to slower generic loads.
// cap, twin: the pool's capacity and copies (tree::par::plan).
// C: the launch's scalars (tree::par::consts).
// At most 80 registers a thread (__maxnreg__), as the kernel took before the ballots of the
// queue's narrow batches and first runs (85 without the cap, 4 bytes spilled with it): three
// blocks of 256 threads a multiprocessor. Uncapped, bs 1024 at budget 63 took 1.20x (H200,
// bench.tree_ab; two blocks a multiprocessor). With the cap, against the kernel before these
// changes (seeds 15, 5 and 7): budgets 127-1023 at bs 1 and 255 at bs 4 and 64 0.977-0.999x,
// but bs 64 at budget 1023 1.014-1.019x, which nothing in the levels' code changed: the spill
// or the code's layout (not measured apart).
template <bool kStaged>
__global__ void __maxnreg__(80)
    tree_build_parallel_kernel(TreeBuildArgs a, int cap, int twin, int nord,
                               const tree::par::Consts C) {
  extern __shared__ double smem[];
  const int n = a.budget + 1, W = (n + 31) / 32;
  const int b = blockIdx.x;
  __shared__ tree::par::Shared S;
  __shared__ int used;
  __shared__ int64_t meta[2];  // the request's root id and seq_len (read at the end)
#if defined(KDT_PAR_PROFILE)
  const long long t_start = clock64();
#endif
  // Layout (tree::par::smem_bytes), copies = 2 (twin) or 1, nbuf = 0 (twin) or kCompactBuf:
  // node scores [n], chain [L + 1], pool scores copies x [cap], pool keys copies x [cap], buffer
  // scores and keys [nbuf] (8 bytes); node cands [n], pool cands copies x [cap], buffer cands and
  // new indices [nbuf], cnt [cap], hist [nord], wsum [34] (4 bytes); srt, order, inv
  // [cap], first_child [n], next_sibling [n] (2 bytes); staged log-probs.
  const int copies = twin ? 2 : 1, nbuf = twin ? 0 : tree::par::kCompactBuf;
  double* node_score = smem;
  double* chain = node_score + n;
  double* pool = chain + a.L + 1;
  uint64_t* keys = reinterpret_cast<uint64_t*>(pool + copies * cap);
  double* bscore = reinterpret_cast<double*>(keys + copies * cap);
  uint64_t* bkey = reinterpret_cast<uint64_t*>(bscore + nbuf);
  uint32_t* node_cand = reinterpret_cast<uint32_t*>(bkey + nbuf);
  uint32_t* cands = node_cand + n;
  uint32_t* bcand = cands + copies * cap;
  int* bto = reinterpret_cast<int*>(bcand + nbuf);
  int* cnt = bto + nbuf;
  int* hist = cnt + cap;
  int* wsum = hist + nord;
  uint16_t* srt = reinterpret_cast<uint16_t*>(wsum + 34);
  uint16_t* order = srt + cap;
  int16_t* inv = reinterpret_cast<int16_t*>(order + cap);
  int16_t* first_child = inv + cap;
  int16_t* next_sibling = first_child + n;
  const size_t lk = (size_t)a.L * a.K;
  const float* lp = a.top_logp + b * lk;
  const int64_t* ids = a.top_ids + b * lk;
  const tree::par::Pool second = twin ? tree::par::Pool{pool + cap, cands + cap, keys + cap}
                                      : tree::par::Pool{nullptr, nullptr, nullptr};
  const tree::par::Arrays A{{pool, cands, keys}, second, twin != 0, {bscore, bcand, bkey}, bto,
                            nbuf, cnt, srt, order, inv, hist, chain, C.key_bits,
                            C.key_depth, nord};
  if (threadIdx.x == 0) tree::par::init(S);
  GpuBlock blk{wsum};
#if defined(KDT_PAR_PROFILE)
  __shared__ long long prof_marks[192];
  __shared__ int prof_ids[192];
  blk.marks = prof_marks;
  blk.ids = prof_ids;
  blk.t0 = t_start;
#endif
  // What the outputs need at the end, asked for now by the last warp: the request's root id and
  // seq_len, and the token ids' lines into L1 (the slots' gather then finds them there).
  // (The token ids staged into shared memory with cp.async by every thread instead, as the
  // warp build does, and the root id and seq_len stored after the staging: H200, budget 63,
  // bs 64, the staging's first phase 852 -> 1282 cycles and the slots' 838 -> 762, and
  // bench.tree_ab 1.01-1.02x at budget 63, 1.00x at 255 and 1023. Not kept.)
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  // The parameters and the addresses made from them are read before the wait (pdl_ready), so
  // that their constant-bank misses overlap the kernel before this one. H200, bench.tree_ab,
  // kernel alone against the wait at the top: 0.978-0.982x at budgets 255 and 1023 (bs 1-64),
  // 0.99-1.01x at 63. (The same in the one-warp build: 1.02-1.035x at budgets 15 and 31, and
  // 1.06x after a torch kernel. Not kept there.)
  const int64_t* mp = lane == 0 ? a.root_ids + b : a.seq_lens + b;
  pdl_ready(lp);
  pdl_ready(ids);
  pdl_ready(mp);
  // The first entries are shared memory alone: written while the kernel before this one runs
  // (H200, bench.tree_ab against them after the wait: 0.985-1.001x at budgets 33-255, bs
  // 1-1024).
  if (kStaged) tree::par::first_entries(A, threadIdx.x, blockDim.x);
  pdl_enter();  // before any global access (pdl.cuh); the parameters are read above it
  if ((int)(threadIdx.x >> 5) == nw - 1) {
    warp_prefetch_l1(ids, lk * sizeof(int64_t), lane);
    if (lane < 2) meta[lane] = __ldg(mp);
  }
  // Staged: the first phase's work is done here, on the values as they arrive (build's pre):
  // each thread checks the log-probs it stages, a warp's verdicts are reduced into chk, and
  // one warp adds the chain sums (from global memory: the staged copy is read after the
  // barrier): the last warp when the staging leaves it idle, so that they run beside the
  // staging, else warp 0 after its share.
  __shared__ int chk[3][32];  // per warp: flags, emin, emax
  if (kStaged) {
    float* staged = reinterpret_cast<float*>(next_sibling + n);
    const int K = a.K, n_lp = (int)lk;
    const int w = threadIdx.x >> 5;
    // The staging's shape: five log-probs a lane over all warps but the last, which then takes
    // the chain sums beside them, when that covers them in one round; else eight a lane over
    // every warp, and warp 0 adds the chain sums after its share.
    const int cw = 32 * 5 * (nw - 1) >= n_lp ? nw - 1 : 0;
    if (cw) blk.chain_sums(lp, a.L, K, C.kf, chain, &S.fmin, cw);
    blk.mark(10);
    tree::par::Checked ck;
    if (cw) {
      if (w < nw - 1) stage_check<5>(staged, lp, n_lp, K, C.step32, w, nw - 1, lane, ck);
    } else {
      stage_check<8>(staged, lp, n_lp, K, C.step32, w, nw, lane, ck);
    }
    blk.mark(11);
    ck.flags = (int)__reduce_or_sync(kFull, (unsigned)ck.flags);
    ck.emin = __reduce_min_sync(kFull, ck.emin);
    ck.emax = __reduce_max_sync(kFull, ck.emax);
    if (lane == 0) {
      chk[0][threadIdx.x >> 5] = ck.flags;
      chk[1][threadIdx.x >> 5] = ck.emin;
      chk[2][threadIdx.x >> 5] = ck.emax;
    }
    blk.mark(12);
    if (!cw) blk.chain_sums(lp, a.L, K, C.kf, chain, &S.fmin);
    blk.mark(13);
    lp = staged;
  }
  __syncthreads();
  blk.mark(14);
  tree::par::Checked pre;
  if (kStaged) {  // the warps' verdicts, a lane each (no loop)
    const int l = threadIdx.x & 31;
    const bool in = l < (int)(blockDim.x >> 5);
    pre.flags = (int)__reduce_or_sync(kFull, in ? (unsigned)chk[0][l] : 0u);
    pre.emin = __reduce_min_sync(kFull, in ? chk[1][l] : 1 << 30);
    pre.emax = __reduce_max_sync(kFull, in ? chk[2][l] : -(1 << 30));
  }
  const tree::par::Nodes nodes{node_score, node_cand, first_child, next_sibling};
#if defined(KDT_PAR_PROFILE)
  blk.mark(0);  // staged
  // KDT_PAR_REPEAT: build again and keep the last build's marks (is the first one paying for
  // cold caches?).
  for (int rep = 1; rep < KDT_PAR_REPEAT; ++rep) {
    tree::par::build(blk, S, A, nodes, lp, a.L, a.K, a.budget, cap, C, kStaged ? &pre : nullptr);
    __syncthreads();
    if (threadIdx.x == 0) tree::par::init(S);
    if (kStaged) tree::par::first_entries(A, threadIdx.x, blockDim.x);
    __syncthreads();
    if (kStaged)
      blk.chain_sums(lp, a.L, a.K, C.kf, chain, &S.fmin);
    __syncthreads();
    blk.nmark = 0;
    blk.t0 = clock64();
  }
#endif
  int u = tree::par::build(blk, S, A, nodes, lp, a.L, a.K, a.budget, cap, C,
                           kStaged ? &pre : nullptr);
  if (u < 0) {
    // The serial selection (warp variant) over the pool's memory: its frontier and keys (20 n
    // bytes) fit in one copy (20 cap bytes; cap > n).
    if (threadIdx.x < 32) {
      tree::Scratch s;
      s.heap_score = pool;
      s.node_key = keys;
      s.heap_cand = cands;
      s.node_score = node_score;
      s.node_cand = node_cand;
      s.first_child = first_child;
      s.next_sibling = next_sibling;
      tree::set_key_layout(s, a.L, a.K);
      const int w = warp_build_one(lp, a.L, a.K, a.budget, s);
      if (threadIdx.x == 0) used = w;
    }
    __syncthreads();
    u = used;
  }
  write_outputs(a, b, n, W, u, node_cand, node_score, first_child, next_sibling, ids, meta[0],
                meta[1], [&](int id) { blk.mark(id); });
  blk.mark(99);
  blk.print_marks();
}

// ---- the one-warp build (tree_build_warp.h): a warp per request, several per CTA -----------

template <int S>
struct GpuWarp {
  tree::wrp::Lane<S> x;
  int lane;
  template <class F>
  __device__ __forceinline__ void each(F f) { f(x, lane); }
  template <class F>
  __device__ __forceinline__ uint32_t max(F f) { return __reduce_max_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t min(F f) { return __reduce_min_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t ballot(F f) { return __ballot_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t shfl(F f, int src) {
    return __shfl_sync(kFull, f(x, lane), src);
  }
  __device__ __forceinline__ void sync() { __syncwarp(); }
};

// Per-warp shared memory: node scores [n] (8 bytes), its root id and seq_len, then, up to budget
// 63, the nodes' visibility rows [n] (8 bytes: tree::wrp::WarpNodes::mask); node cands [n] (4),
// first_child and next_sibling [n] (2 each), then its log-probs as doubles when they take
// <= kWarpStageBytes, then its token ids when they take <= kWarpIdsBytes; rounded up to 8 bytes.
// At most 16 x 1024 + 16 KB = 32 KB a warp (the ids come only with small L K).
constexpr int kWarpStageBytes = 16 * 1024;
constexpr int kWarpIdsBytes = 8 * 1024;
__host__ __device__ size_t warp_stage_bytes(int L, int K) {
  const size_t b = (size_t)L * K * sizeof(double);
  return b <= (size_t)kWarpStageBytes ? b : 0;
}
__host__ __device__ size_t warp_ids_bytes(int L, int K) {
  const size_t b = (size_t)L * K * sizeof(int64_t);
  return b <= (size_t)kWarpIdsBytes ? b : 0;
}
__host__ __device__ size_t warp_smem_per(int budget, int L, int K) {
  const size_t n = (size_t)budget + 1;
  const size_t masks = budget <= tree::wrp::kMaskMaxBudget ? 8 * n : 0;
  return (16 * n + 16 + masks + warp_stage_bytes(L, K) + warp_ids_bytes(L, K) + 7) / 8 * 8;
}

// Copies src[0, count) (global) to dst (shared; float, or double: converted) with one warp:
// 16-byte loads from src's first 16-byte boundary on (a scalar head and tail around them), all
// of a lane's loads in flight before its first store, so that up to 1024 floats arrive in one
// round trip (the head and tail loaded with the first 1024; a store that waits on its load
// before the next load issues costs a round trip of its own).
template <class T>
__device__ void warp_stage(T* dst, const float* src, int count, int lane) {
  const int head = min(count, (int)(((16 - (reinterpret_cast<uintptr_t>(src) & 15)) & 15) >> 2));
  const int nv = (count - head) >> 2;
  const int tail = head + 4 * nv;
  const bool in_head = lane < head, in_tail = lane < count - tail;
  const float4* v = reinterpret_cast<const float4*>(src + head);
  for (int i0 = 0; i0 < nv || i0 == 0; i0 += 8 * 32) {
    float4 r[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + 32 * k + lane;
      if (i < nv) r[k] = __ldg(v + i);
    }
    // The scalars after the vectors: their conversion waits for them, and the vectors' loads
    // are out by then.
    float h = 0.0f, t = 0.0f;
    if (i0 == 0) {
      if (in_head) h = __ldg(src + lane);
      if (in_tail) t = __ldg(src + tail + lane);
    }
    // Keeps every load above the first conversion (ptxas otherwise interleaves the last loads
    // with the first stores, which wait for the first loads: a second round trip).
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + 32 * k + lane;
      if (i < nv) {
        T* d = dst + head + 4 * i;
        d[0] = r[k].x;
        d[1] = r[k].y;
        d[2] = r[k].z;
        d[3] = r[k].w;
      }
    }
    if (i0 == 0) {
      if (in_head) dst[lane] = h;
      if (in_tail) dst[tail + lane] = t;
    }
  }
}

// The warp writes one request's outputs: slots (lanes on consecutive slots), then visibility
// one row per lane: from the row built with the tree (mask, budget <= 63; rows beyond the used
// slots are zero), else a single ancestor walk (descending indices) that emits the row's words
// from the last down.
// Inlined: the caller passes ids in shared or global memory, and each copy then gathers with
// that space's loads.
__device__ __forceinline__ void warp_write_outputs(const TreeBuildArgs& a, int b, int n, int W,
                                                   int used, const uint32_t* node_cand,
                                                   const double* node_score, const int16_t* fc,
                                                   const int16_t* ns, const uint64_t* mask,
                                                   const int64_t* ids, int64_t root,
                                                   int64_t seq_len, int lane) {
  const size_t o = (size_t)b * n;
  for (int i = lane; i < n; i += 32)
    write_tree_slot(a, o, i, used, root, seq_len, node_cand, node_score, fc, ns, ids);
  uint32_t* vis = a.visibility + o * W;
  if (mask) {  // W <= 2
    for (int i = lane; i < n; i += 32) {
      const uint64_t r = i < used ? mask[i] : 0ull;
      vis[(size_t)i * W] = (uint32_t)r;
      if (W > 1) vis[(size_t)i * W + 1] = (uint32_t)(r >> 32);
    }
  } else {
    write_visibility_rows(vis, n, W, used, node_cand, lane, 32);
  }
  if (lane == 0) a.num_nodes[b] = used;
}

// kStaged: the log-probs are copied to shared memory as doubles (warp_stage_bytes > 0); a
// template argument so that the pops read them with shared loads (see
// tree_build_parallel_kernel).
template <int S, bool kStaged>
__global__ void __launch_bounds__(128) tree_build_warp_kernel(TreeBuildArgs a) {
#if defined(KDT_PAR_PROFILE)
  // Development probes (bench/tree_profile.py --algo warp): lane 0 of each warp prints its
  // request's cycles waiting to start (60), in the prologue (61), the pops (62) and the
  // outputs (69, the end of a build), as "PROF request id cycles" lines.
  long long wt[5];
  wt[0] = clock64();
#endif
  pdl_enter();  // before any global access (pdl.cuh)
#if defined(KDT_PAR_PROFILE)
  wt[1] = clock64();
#endif
  extern __shared__ double smem[];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int b = blockIdx.x * warps + (threadIdx.x >> 5);
  if (b >= a.bs) return;  // whole warps leave; no block barrier follows
  const int n = a.budget + 1, W = (n + 31) / 32;
  char* base = reinterpret_cast<char*>(smem) +
               (size_t)(threadIdx.x >> 5) * warp_smem_per(a.budget, a.L, a.K);
  double* node_score = reinterpret_cast<double*>(base);
  int64_t* meta = reinterpret_cast<int64_t*>(node_score + n);  // root id, seq_len
  uint64_t* rows = reinterpret_cast<uint64_t*>(meta + 2);
  uint64_t* mask = a.budget <= tree::wrp::kMaskMaxBudget ? rows : nullptr;  // [n] when used
  uint32_t* node_cand = reinterpret_cast<uint32_t*>(mask ? rows + n : rows);
  int16_t* fc = reinterpret_cast<int16_t*>(node_cand + n);
  int16_t* ns = fc + n;
  const size_t lk = (size_t)a.L * a.K;
  const float* lp = a.top_logp + b * lk;
  const int64_t* ids = a.top_ids + b * lk;
  // Every global load of the prologue goes out before any of them is waited for: the root id
  // and seq_len (kept in shared memory over the build, not in registers), the token ids (into
  // shared memory when they fit, else into L1), the log-probs. Before, the root id's store, the
  // staging's head and its vectors each waited for a load in turn, and the outputs gathered the
  // token ids from L1 or L2 after the build. H200, bench.tree_ab, kernel alone, both launched
  // with PDL: 0.93-0.96x at budgets 15 and 31, bs 1-64; the outputs' phase at bs 1, budget 15
  // from 1187 to 960 cycles (KDT_PAR_PROFILE probes below). The staging phase stayed at ~2.7k
  // cycles there; a second pass over the same request in the same kernel (its data in L1, its
  // code cached) still took ~1.6k: the phase is mostly its ~390 instructions a lane, not the
  // round trip. (Two bulk copies instead, cp.async.bulk on an mbarrier, lane 0 issuing, the
  // lanes loading the sub-16-byte tails and converting the log-probs in shared memory
  // afterwards: about half the instructions, and the phase went from
  // 2.84k to 2.36k cycles at bs 1 and 2.88k to 2.04k at bs 64, budget 15; yet bench.tree_ab,
  // kernel alone, measured it 1.03-1.055x slower at bs 1, budgets 1-31, 1.00x at bs 64 and
  // 0.98-1.00x at bs 1024. Not kept. Three more, measured 2026-12-04 with bench.tree_ab
  // against this prologue, kernel alone, seeds 15 and 5, budgets 1-31, bs 1-1024, and the
  // KDT_PAR_PROFILE probes at bs 1, budget 15: the log-probs left in global memory, their lines
  // asked into L1 (prefetch) and read as floats by the pops: prologue 2.6k -> 1.4k cycles, but
  // the pops 5.3k -> 7.7k, 1.13-1.54x (budget 1 0.94x); the log-probs staged as floats by
  // cp.async (their own group, waited for before the pops; the token ids' after them), read and
  // converted by the pops: prologue 1.55k, pops 6.0k, 1.05-1.28x (budget 1 0.85-0.87x); only the
  // columns a build can read staged, ranks 0 .. min(K - 1, budget) (a quarter of them at budget
  // 15, K = 64), token ids likewise: the prologue did not shrink (2.9k cycles), 1.02-1.08x.)
  const int64_t m = lane < 2 ? __ldg(lane == 0 ? a.root_ids + b : a.seq_lens + b) : 0;
  double* staged = kStaged ? reinterpret_cast<double*>(ns + n) : nullptr;
  int64_t* sids = warp_ids_bytes(a.L, a.K)
                      ? reinterpret_cast<int64_t*>(reinterpret_cast<char*>(ns + n) +
                                                   warp_stage_bytes(a.L, a.K))
                      : nullptr;
  if (sids) ids_copy_async(sids, ids, (int)lk, lane, 32);
  else warp_prefetch_l1(ids, lk * sizeof(int64_t), lane);
  if (kStaged) warp_stage(staged, lp, (int)lk, lane);
  if (lane < 2) meta[lane] = m;
  if (sids) ids_wait();
  __syncwarp();
#if defined(KDT_PAR_PROFILE)
  wt[2] = clock64();
#endif
  tree::Scratch ks{};
  tree::set_key_layout(ks, a.L, a.K);
  GpuWarp<S> w;
  w.lane = lane;
  // Opaque to the compiler, so that the pops keep the lane in a register rather than read the
  // thread index again at every pop (an S2R on the reduction's operand).
  asm volatile("" : "+r"(w.lane));
  const tree::wrp::WarpNodes N{node_score, node_cand, fc, ns, mask};
  const int used =
      kStaged ? tree::wrp::build<S>(w, (const double*)staged, a.L, a.K, a.budget, ks.key_bits,
                                    ks.key_depth, N)
              : tree::wrp::build<S>(w, lp, a.L, a.K, a.budget, ks.key_bits, ks.key_depth, N);
#if defined(KDT_PAR_PROFILE)
  wt[3] = clock64();
#endif
  if (sids)  // two inlined copies, so that each gathers with its own address space's loads
    warp_write_outputs(a, b, n, W, used, node_cand, node_score, fc, ns, mask, sids, meta[0],
                       meta[1], lane);
  else
    warp_write_outputs(a, b, n, W, used, node_cand, node_score, fc, ns, mask, ids, meta[0],
                       meta[1], lane);
#if defined(KDT_PAR_PROFILE)
  __syncwarp();
  wt[4] = clock64();
  if (lane == 0)
    printf("PROF %d 60 %lld\nPROF %d 61 %lld\nPROF %d 62 %lld\nPROF %d 69 %lld\n", b,
           wt[1] - wt[0], b, wt[2] - wt[1], b, wt[3] - wt[2], b, wt[4] - wt[3]);
#endif
}

template <int S>
void launch_warp(const TreeBuildArgs& a, int grid, int threads, size_t smem, cudaStream_t st) {
  if (warp_stage_bytes(a.L, a.K))
    launch_pdl(tree_build_warp_kernel<S, true>, grid, threads, smem, st, a);
  else
    launch_pdl(tree_build_warp_kernel<S, false>, grid, threads, smem, st, a);
}

kdt_status launch_warp_build(const TreeBuildArgs& a, cudaStream_t st) {
  static const char* fn = "kdt_tree_build";
  // One warp per CTA while the batch fits the device many times over (each request then has an
  // SM's issue slots to itself at small batches); up to 4 per CTA beyond, within the 48 KB of
  // shared memory that needs no opt-in.
  const size_t per = warp_smem_per(a.budget, a.L, a.K);
  int R = a.bs <= 512 ? 1 : 4;
  while (R > 1 && (size_t)R * per > 48 * 1024) --R;
  const int grid = (a.bs + R - 1) / R;
  const size_t smem = (size_t)R * per;
  switch (tree::wrp::slots_for(a.budget)) {
    case 1: launch_warp<1>(a, grid, 32 * R, smem, st); break;
    case 2: launch_warp<2>(a, grid, 32 * R, smem, st); break;
    case 4: launch_warp<4>(a, grid, 32 * R, smem, st); break;
    case 8: launch_warp<8>(a, grid, 32 * R, smem, st); break;
    case 16: launch_warp<16>(a, grid, 32 * R, smem, st); break;
    default: launch_warp<32>(a, grid, 32 * R, smem, st); break;
  }
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

// KDT_TREE_BUILD_VARIANT, read once: true for the warp variant (the default).
bool use_warp_variant() {
  static const bool warp = [] {
    const char* v = std::getenv("KDT_TREE_BUILD_VARIANT");
    return !(v && std::strcmp(v, "heap") == 0);
  }();
  return warp;
}

enum class Mode { kAuto, kWarp, kParallel, kSerial };

// KDT_TREE_BUILD, read per call: "serial", "parallel", "warp"; anything else (unset) is auto.
Mode mode_from_env() {
  const char* v = std::getenv("KDT_TREE_BUILD");
  if (!v) return Mode::kAuto;
  if (std::strcmp(v, "serial") == 0) return Mode::kSerial;
  if (std::strcmp(v, "parallel") == 0) return Mode::kParallel;
  if (std::strcmp(v, "warp") == 0) return Mode::kWarp;
  return Mode::kAuto;
}

}  // namespace

kdt_status tree_build_cuda(const TreeBuildArgs& a, void* stream) {
  static const char* fn = "kdt_tree_build";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const Mode mode = mode_from_env();
  if ((mode == Mode::kAuto && a.budget <= tree::wrp::kAutoMaxBudget) ||
      (mode == Mode::kWarp && a.budget <= tree::wrp::kMaxBudget))
    return launch_warp_build(a, st);
  if (mode != Mode::kSerial) {
    const int T = tree::par::threads_from_env(a.budget);
    // The shared-memory opt-in, once per device at the largest size the device allows, so that
    // a later call under graph capture makes no attribute call. tree::par::plan picks the
    // layout that fits (sm_120: 99 KB per block); a budget that fits none runs the serial
    // kernel.
    static int optin[64] = {};
    static int most_threads[64] = {};  // the fewer of the two kernels' maxThreadsPerBlock
    int dev = 0;
    KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
    int limit = 48 * 1024, threads_limit = 1024;
    if (dev >= 0 && dev < 64 && optin[dev]) {
      limit = optin[dev];
      threads_limit = most_threads[dev];
    } else {
      KDT_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                     fn);
      limit -= 1024;  // the kernel's static shared memory (S, used)
      const int cap = tree::par::pool_capacity(tree::kMaxBudget);
      const int most = (int)(tree::par::smem_bytes(tree::kMaxBudget, tree::kMaxDepth, cap, true,
                                                   tree::par::order_bins(cap)) +
                             tree::par::kStageLogpBytes);
      limit = limit < most ? limit : most;
      KDT_CUDA_CHECK(cudaFuncSetAttribute(tree_build_parallel_kernel<true>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
                     fn);
      KDT_CUDA_CHECK(cudaFuncSetAttribute(tree_build_parallel_kernel<false>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, limit),
                     fn);
      // The registers a kernel takes bound its threads per block (a launch of more fails).
      for (auto k : {tree_build_parallel_kernel<true>, tree_build_parallel_kernel<false>}) {
        cudaFuncAttributes fa;
        KDT_CUDA_CHECK(cudaFuncGetAttributes(&fa, k), fn);
        threads_limit = fa.maxThreadsPerBlock < threads_limit ? fa.maxThreadsPerBlock
                                                              : threads_limit;
      }
      if (dev >= 0 && dev < 64) {
        optin[dev] = limit;
        most_threads[dev] = threads_limit;
      }
    }
    if (T > threads_limit)
      return set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                       "KDT_TREE_BUILD_THREADS=%d: the parallel build's kernel takes at most %d "
                       "threads per block on this device (its registers); use %d or fewer",
                       T, threads_limit, threads_limit);
    tree::par::Plan p;
    const size_t knob = tree::par::smem_from_env();  // a smaller device, emulated
    if (tree::par::plan(a.budget, a.L, a.K, knob && knob < (size_t)limit ? knob : limit, &p)) {
      const int twin = p.twin ? 1 : 0;
      const tree::par::Consts C = tree::par::consts(a.budget, a.L, a.K, T, p.nord);
      if (p.staged)
        launch_pdl(tree_build_parallel_kernel<true>, a.bs, T, p.bytes, st, a, p.cap, twin, p.nord,
                   C);
      else
        launch_pdl(tree_build_parallel_kernel<false>, a.bs, T, p.bytes, st, a, p.cap, twin,
                   p.nord, C);
      KDT_CUDA_CHECK(cudaGetLastError(), fn);
      return KDT_OK;
    }
  }
  const size_t smem = smem_bytes(a.budget + 1);
  if (use_warp_variant())
    launch_pdl(tree_build_kernel<true>, a.bs, kThreads, smem, st, a);
  else
    launch_pdl(tree_build_kernel<false>, a.bs, kThreads, smem, st, a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
