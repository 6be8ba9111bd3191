// tree_build_warp.h: the DDTree best-first build (DDTREE.md section 2) on ONE warp, with no
// block barrier, as __host__ __device__ code: the CUDA kernel (tree_build_warp.cu, several
// requests per CTA, a warp each) and the CPU emulation (tree_build_cpu.cpp, KDT_TREE_BUILD=warp)
// run this very code, the CPU through CpuWarp below (32 lane states, collectives as loops).
//
// It is the reference's heap order exactly (same float64 operations, same strict total order:
// score descending, then rank path ascending), with the frontier held in registers:
//   - the frontier (at most budget + 1 entries) lives in 32 x S slots, S per lane (a compile-time
//     count, so the slot arrays stay in registers); each lane caches its best entry;
//   - a pop is a warp argmax of the lanes' bests: one 32-bit max reduction (redux.sync) over the
//     high half of the order-preserving image of the score with its low 5 bits replaced by the
//     lane, so the result names the winning lane; a ballot checks that no other lane shares the
//     27 bits, and only when one does, the full scores, then two min reductions over the
//     rank-path prefix key (tree_build_core.h), then, on equal keys, the full rank-path
//     comparison lane pair by lane pair (rare) settle it (resolve_tie);
//   - every lane computes the winner's sibling and child scores itself (the log-probs are in
//     shared memory; same reads everywhere), so no lane waits for another's write, and no
//     branch depends on the winner's lane: a pop is one dependent chain, and its cost is its
//     length (about 470 cycles on the H200 with one slot a lane, against about 940 when the
//     lanes branched on their roles). The pop is bound by its ~140 instructions' issue and
//     fixed latencies (ncu, bs 64, budget 15: warps 29% issuing, 28% waiting on ALU results),
//     not by the reduction-to-reduction chain: a lean pop that kept each lane's successor
//     scores ready, carried no rank-path keys and let the winner store alone (032fdc3) still
//     took ~135 instructions and measured 1.08-1.23x slower at budgets 15 and 31 (reverted).
//     Nor is it the instruction count alone (2026-12-04, H200, bench.tree_ab against this kernel,
//     kernel alone, 3 rounds, seeds 15 and 5): nine instructions fewer a pop (first child lists set
//     to -1 before the pops, -0.0 folded by integer negation in ord, a 32-bit row bit with one slot
//     a lane: ~124 -> ~115 in SASS) took 0.996-1.000x at budget 15 (bs 1 and 64; bs 1024 0.98x),
//     0.98-0.99x at 31, 1.01-1.02x at budgets 3 and 7; each lane's successor scores kept ready
//     (keys kept, every lane computing its own beside the reduction, so the pop shuffles the
//     winner's two scores instead of loading and adding after it: four shuffles more, no log-prob
//     load or addition after the reduction) took 1.03-1.055x at budgets 3-31 (seed 15), and
//     1.10-1.35x when only the two changed lanes computed theirs (a branch whose reconvergence put
//     the loads back on the chain). Not kept. For scale, dependent chains on one warp of the
//     H200 (4096 links, 1980 MHz): redux.sync 47 cycles a link, shfl 33, a shared load 29, a
//     double add 8, and reduction -> shuffle -> shared load -> add -> reduction 122, against the
//     pop's ~375;
//   - the sibling (or child) takes the winner's slot, the other push the next never-used slot
//     (a high-water mark, < budget + 1); only the lanes whose slots changed rescan their S slots.
//   - keys travel with the entries (a child's key is its parent's, a sibling's its left
//     sibling's plus one in its rank field), and each entry carries the node index of its left
//     sibling, which is its next_sibling under the prepend rule (siblings pop in rank order), so a
//     pop reads no node array. Every lane writes the node arrays itself (the same value to the
//     same address): the rare full rank-path comparison reads node_cand, and each lane reads
//     only its own writes; the rest is read after the final warp barrier. Up to budget 63 the
//     nodes' visibility rows are built alongside (a row is its parent's plus its own bit).
// Where a build's time goes (H200, bench.tree_ab's harness, kernel alone, bs 1, 2026-12-03):
// budget 1 takes 2.03 us (a one-element torch kernel 1.07 us timed the same way), and each
// further pop ~0.19 us (budgets 3 / 7 / 15 / 31: 2.38 / 3.16 / 4.68 / 6.93 us). The pops cost
// the same on a second pass over the request in the same kernel (5.3k cycles at budget 15,
// code and data cached), so they are the pop's own chain, not instruction fetch; under Nsight
// Compute (bs 64, budget 15) a pop is ~136 instructions, and of the pops' stall samples 47%
// are the warp issuing and 31% waiting on fixed-latency results.
#pragma once

#include <stdint.h>

#include "kdtree/hd.h"
#include "tree_build_core.h"

// Slot loops must unroll on CUDA (a run-time slot index would put the slots in local memory).
#if defined(__CUDACC__)
#define KDT_WARP_UNROLL _Pragma("unroll")
#else
#define KDT_WARP_UNROLL
#endif

namespace kdt {
namespace tree {
namespace wrp {

constexpr int kMaxSlots = 32;                  // slots per lane
constexpr int kMaxBudget = 32 * kMaxSlots - 1;  // 1023: the largest budget this build takes
// KDT_TREE_BUILD=auto: warp up to here (one slot a lane), parallel above. H200, kernel alone
// (2026-12-01): budget 15, warp 5.2-6.5 us against parallel 11.4-15.3 (tree_build suite, run
// 59b00d6); budget 31, warp 7.9 (bs 1) and 10.2 us (bs 64) against parallel 14.1 and 16.9
// (bench.tree_ab); budget 63 (two slots a lane, a rescan a pop), warp 27.7-29.3 us against
// parallel 15.0-19.3 (bench.tree_ab, before the log-probs were staged as doubles). A frontier
// kept sorted across the warp instead (no argmax: a pop merges two entries) measured 1.03x at
// budget 15 and 1.33x at 63 against the earlier, branching pop: 390 instructions a pop, moving
// and selecting whole entries per slot. Again on 2026-12-04 (kernel alone, seeds 15 and 5, one
// process): budget 15, warp 4.3-4.5 us (bs 1) and 5.2-5.3 (bs 64) against parallel 7.5-7.6 and
// 8.3-8.4 at its best thread count (128 or 256; 32 threads 10.1-11.1); budget 31, warp 6.6-7.0
// and 7.6-8.8 against 8.1-8.3 and 9.8; budget 63, warp 24.7-28.2 against 8.2-11.7. The
// threshold method on this one warp instead of the pops (up to budget 31, L and K <= 32: the
// exactness check, the chain's sums by a shuffle scan, the bound by a merge of the chain
// deviations' rows a lane each, one reduction a step, the nodes at or above it level by level
// (a binary search of the row, a shuffle scan, a search for each child's run), ranks counted
// over the pool, an ancestor walk a row): bit-exact (the 206 CUDA tree tests passed), but
// 2.0-2.7x the pops at budgets 3-31, bs 1-64 (seeds 15 and 5): 4.8-5.5 us at budget 3, 9.9-10.0
// at 15, 15.1-17.5 at 31 (bs 1). On bench inputs its pool holds 20 nodes at the median at
// budget 15 (54 at 31) in 3 (4) levels, but by the chain latencies above a level is ~0.7k
// cycles of searches, shuffles and loads in series, and the fixed part (check, sums, bound)
// ~2k (estimates, not profiled).
constexpr int kAutoMaxBudget = 31;
// Up to this many slots a lane, i.e. up to kMaskMaxBudget, the build also makes the nodes'
// visibility rows (WarpNodes::mask: 64 bits a row).
constexpr int kMaskMaxSlots = 2;
constexpr int kMaskMaxBudget = 32 * kMaskMaxSlots - 1;  // 63

// Slots per lane for a budget: the smallest power of two S with 32 S >= budget + 1.
KDT_HD int slots_for(int budget) {
  int s = 1;
  while (32 * s < budget + 1) s *= 2;
  return s;
}

// Order-preserving 64-bit image of a score (a > b iff ord(a) > ord(b)); -0.0 and +0.0 map to
// one value (they compare equal as doubles). Never 0 for a real score.
KDT_HD uint64_t ord(double x) {
  if (x == 0.0) x = 0.0;
  union { double d; uint64_t u; } v;
  v.d = x;
  return (v.u >> 63) ? ~v.u : (v.u | (1ull << 63));
}

KDT_HD uint64_t bits(double x) {
  union { double d; uint64_t u; } v;
  v.d = x;
  return v.u;
}
KDT_HD double from_bits(uint64_t u) {
  union { double d; uint64_t u; } v;
  v.u = u;
  return v.d;
}

KDT_HD int ffs32(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __ffs((int)m) - 1;
#else
  return __builtin_ffs((int)m) - 1;
#endif
}
KDT_HD int popc32(uint32_t m) {
#if defined(__CUDA_ARCH__)
  return __popc(m);
#else
  return __builtin_popcount(m);
#endif
}

// One lane's share of the frontier: S slots and a copy of the best of them.
template <int S>
struct Lane {
  double sc[S];      // the score
  uint64_t key[S];   // rank-path prefix key
  uint32_t cand[S];  // tree::pack(parent node, rank, depth); 0: an empty slot (depth >= 1)
  int prev[S];       // node index of the left sibling (-1 for rank 0)
  uint64_t bsu, bkey;  // bsu: ord(best score), 0 when every slot is empty
  double bsc;
  uint32_t bcand;
  int bprev, best;   // best: the slot, -1 when every slot is empty
};

// Entry (sa, ka, ca) precedes (sb, kb, cb) in pop order (distinct candidates).
KDT_HD bool precedes(uint64_t sa, uint64_t ka, uint32_t ca, uint64_t sb, uint64_t kb, uint32_t cb,
                     int key_depth, const uint32_t* node_cand) {
  if (sa != sb) return sa > sb;
  if (ka != kb) return ka < kb;
  const int da = cand_depth(ca), db = cand_depth(cb);
  if (da <= key_depth && db <= key_depth) return da < db;
  return compare_paths(ca, cb, node_cand) < 0;
}

template <int S>
KDT_HD void rescan(Lane<S>& x, int key_depth, const uint32_t* node_cand) {
  x.best = -1;
  x.bsu = 0;
KDT_WARP_UNROLL
  for (int k = 0; k < S; ++k) {
    if (x.cand[k] == 0) continue;
    const uint64_t u = ord(x.sc[k]);
    if (x.best < 0 ||
        precedes(u, x.key[k], x.cand[k], x.bsu, x.bkey, x.bcand, key_depth, node_cand)) {
      x.best = k;
      x.bsu = u;
      x.bsc = x.sc[k];
      x.bkey = x.key[k];
      x.bcand = x.cand[k];
      x.bprev = x.prev[k];
    }
  }
}

// Writes slot s (a run-time index, selected among the compile-time ones: registers stay).
template <int S>
KDT_HD void put(Lane<S>& x, int s, double sc, uint64_t key, uint32_t cand, int prev) {
KDT_WARP_UNROLL
  for (int k = 0; k < S; ++k) {
    if (k != s) continue;
    x.sc[k] = sc;
    x.key[k] = key;
    x.cand[k] = cand;
    x.prev[k] = prev;
  }
}
template <int S>
KDT_HD void clear(Lane<S>& x, int s) {
KDT_WARP_UNROLL
  for (int k = 0; k < S; ++k)
    if (k == s) x.cand[k] = 0;
}

// Node arrays of one request (node order, slot 0 the root), as tree::build_one fills them.
struct WarpNodes {
  double* score;
  uint32_t* cand;
  int16_t* first_child;
  int16_t* next_sibling;
  uint64_t* mask;  // budget <= kMaskMaxBudget, else null: node i's visibility row
};

// The winner among the lanes of m (more than one): the highest score (high halves of the
// images, then low halves), then the smallest rank-path key, then depths or the full rank paths
// lane pair by lane pair (rare). Returns a mask of the one winning lane.
template <int S, class Warp>
KDT_HD uint32_t resolve_tie(Warp& w, uint32_t m, int key_depth, const uint32_t* nc) {
  const uint32_t hi = w.max([m](const Lane<S>& x, int l) {
    return (m >> l) & 1u ? (uint32_t)(x.bsu >> 32) : 0u;
  });
  m = w.ballot([m, hi](const Lane<S>& x, int l) {
    return ((m >> l) & 1u) && (uint32_t)(x.bsu >> 32) == hi;
  });
  if (popc32(m) < 2) return m;
  const uint32_t lo = w.max([m](const Lane<S>& x, int l) {
    return (m >> l) & 1u ? (uint32_t)x.bsu : 0u;
  });
  const uint64_t t = ((uint64_t)hi << 32) | lo;
  m = w.ballot([m, t](const Lane<S>& x, int l) { return ((m >> l) & 1u) && x.bsu == t; });
  if (popc32(m) < 2) return m;
  // Equal scores: the smallest rank-path key.
  const uint32_t khi = w.min([m](const Lane<S>& x, int l) {
    return (m >> l) & 1u ? (uint32_t)(x.bkey >> 32) : 0xFFFFFFFFu;
  });
  const uint32_t klo = w.min([m, khi](const Lane<S>& x, int l) {
    return ((m >> l) & 1u) && (uint32_t)(x.bkey >> 32) == khi ? (uint32_t)x.bkey : 0xFFFFFFFFu;
  });
  const uint64_t kk = ((uint64_t)khi << 32) | klo;
  m = w.ballot([m, kk](const Lane<S>& x, int l) { return ((m >> l) & 1u) && x.bkey == kk; });
  if (popc32(m) < 2) return m;
  // Equal keys: depths, or the full rank paths, pair by pair.
  int wl = ffs32(m);
  uint32_t wc = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, wl);
  for (uint32_t rest = m & (m - 1); rest; rest &= rest - 1) {
    const int l = ffs32(rest);
    const uint32_t c = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, l);
    if (precedes(t, kk, c, t, kk, wc, key_depth, nc)) { wl = l; wc = c; }
  }
  return 1u << wl;
}

// Builds one request on the warp w (Warp: each / max / min / ballot / shfl / sync, see CpuWarp
// and the CUDA kernel's GpuWarp); lp is [L, K], float, or double (CUDA's shared-memory copy:
// the same values, with no conversion on a pop's chain). Returns the slots used
// (root included), as tree::build_one does. budget <= 32 S - 1.
//
// A pop is one dependent chain on one warp, so its cost is its length: every value a pop
// derives from the winner is computed by every lane alike (uniform; no branch on the winner's
// lane), the node arrays are written by every lane (the same value to the same address), and
// the winner's and the high-water lane's updates are selects. With one slot a lane (S = 1) the
// lane's best is its entry: no rescan.
template <int S, class Warp, class T>
KDT_HD int build(Warp& w, const T* lp, int L, int K, int budget, int key_bits, int key_depth,
                 const WarpNodes& N) {
  // The visibility rows come with up to kMaskMaxSlots slots a lane, which S = slots_for(budget)
  // gives exactly at budgets <= kMaskMaxBudget, where the callers set N.mask: a compile-time
  // test, not a branch in every pop.
  constexpr bool kRows = S <= kMaskMaxSlots;
  const uint32_t* nc = N.cand;
  w.each([&](Lane<S>& x, int lane) {
KDT_WARP_UNROLL
    for (int k = 0; k < S; ++k) x.cand[k] = 0;
    if (lane == 0) put(x, 0, (double)lp[0], 0ull, pack(0, 0, 1), -1);
    N.cand[0] = 0;
    N.score[0] = 0.0;
    N.first_child[0] = -1;
    N.next_sibling[0] = -1;
    if (kRows) N.mask[0] = 1ull;
    rescan(x, key_depth, nc);
  });
  int F = 1, hw = 1, count = 0;  // frontier size, high-water slot, pops: uniform
  // Two pops an iteration on CUDA with one slot a lane: the loop-carried lane state then needs
  // no register copies at the end of each pop. H200, bench.tree_ab, kernel alone, against one
  // a pop: 0.95-0.99x at budgets 7-31 (bs 1, 4, 64, 1024); four a pop 1.02-1.08x. (Two pops
  // per argmax instead, the second the best of the other lanes' (a second argmax beside the
  // first pop's shuffles), the first pop's sibling and its child, compared exactly, then up
  // to four successors placed at once: bit-exact (the CPU tree tests and the CUDA ones
  // passed), but the second pop's successors still wait on the first's, since choosing it
  // needs their scores, so the chain did not shorten while the instructions grew: under
  // Nsight Compute, bs 1, budget 15, 3.8k warp instructions a build against 2.5k, ~3.6 cycles
  // each either way; bench.tree_ab, seeds 15 and 5: 1.12-1.22x at budgets 1-3, 1.32-1.44x at
  // 7, 1.55-1.71x at 15, 1.59-1.97x at 31. Not kept.)
#if defined(__CUDA_ARCH__)
#pragma unroll(S == 1 ? 2 : 1)
#endif
  while (F > 0 && count < budget) {
    // Warp argmax of the lanes' bests in one reduction: the high half of a best's image with
    // its low 5 bits replaced by 31 - lane names the winning lane. The shuffles from that lane
    // go out at once; a ballot (off the chain) checks that no other lane shares the 27 bits,
    // and resolve_tie settles the rare case where one does.
    const uint32_t mx = w.max([](const Lane<S>& x, int lane) {
      return ((uint32_t)(x.bsu >> 32) & ~31u) | (31u - (uint32_t)lane);
    });
    int wl = 31 - (int)(mx & 31u);
    auto pick = [&](int l, uint32_t* v) {
      v[0] = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, l);
      v[1] = w.shfl([](const Lane<S>& x, int) { return (uint32_t)(x.bkey >> 32); }, l);
      v[2] = w.shfl([](const Lane<S>& x, int) { return (uint32_t)x.bkey; }, l);
      v[3] = w.shfl([](const Lane<S>& x, int) { return (uint32_t)(bits(x.bsc) >> 32); }, l);
      v[4] = w.shfl([](const Lane<S>& x, int) { return (uint32_t)bits(x.bsc); }, l);
      v[5] = w.shfl([](const Lane<S>& x, int) { return (uint32_t)x.bprev; }, l);
    };
    uint32_t v[6];
    pick(wl, v);
    const uint32_t m = w.ballot([mx](const Lane<S>& x, int) {
      return ((uint32_t)(x.bsu >> 32) & ~31u) == (mx & ~31u);
    });
    if (popc32(m) > 1) {
      wl = ffs32(resolve_tie<S>(w, m, key_depth, nc));
      pick(wl, v);
    }
    const uint32_t cand = v[0], khi = v[1], klo = v[2], shi = v[3], slo = v[4];
    const int prev = (int)v[5];
    const uint64_t key = ((uint64_t)khi << 32) | klo;
    const double score = from_bits(((uint64_t)shi << 32) | slo);
    const int parent = cand_parent(cand), rank = cand_rank(cand), depth = cand_depth(cand);
    const int i = ++count;
    const bool sib = rank + 1 < K, child = depth < L, both = sib && child;
    // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2); the
    // loads are unconditional (indices clamped into the request's rows), the scores selected.
    const int at = (depth - 1) * K + rank;
    const double a = (double)lp[at], b = (double)lp[sib ? at + 1 : at];
    const double c = (double)lp[child ? depth * K : 0];
    const double ss = (score - a) + b;
    const double cs = score + c;
    const uint64_t skey = depth <= key_depth ? key + (1ull << (64 - key_bits * depth)) : key;
    const uint32_t scand = pack(parent, rank + 1, depth), ccand = pack(i, 0, depth + 1);
    // The winner's entry becomes its sibling, else its child, else empty; with both, the child
    // takes the next never-used slot (hw).
    const uint64_t ssu = ord(ss), csu = ord(cs);
    const double wsc = sib ? ss : cs;
    const uint64_t wsu = sib ? ssu : (child ? csu : 0ull);
    const uint64_t wkey = sib ? skey : key;
    const uint32_t wcand = sib ? scand : (child ? ccand : 0u);
    const int wprev = sib ? i : -1;
    const int hl = hw & 31, hs = hw >> 5;
    w.each([&](Lane<S>& x, int lane) {
      N.cand[i] = cand;  // every lane (each reads only its own writes: compare_paths)
      N.score[i] = score;
      N.first_child[i] = -1;
      N.next_sibling[i] = (int16_t)prev;  // the prepend rule: the rank - 1 sibling
      N.first_child[parent] = (int16_t)i;
      if (kRows) N.mask[i] = N.mask[parent] | (1ull << i);
      const bool mw = lane == wl, mh = both && lane == hl;
      if (S == 1) {
        x.bsu = mw ? wsu : (mh ? csu : x.bsu);
        x.bsc = mw ? wsc : (mh ? cs : x.bsc);
        x.bkey = mw ? wkey : (mh ? key : x.bkey);
        x.bcand = mw ? wcand : (mh ? ccand : x.bcand);
        x.bprev = mw ? wprev : (mh ? -1 : x.bprev);
      } else {
        if (mw) put(x, x.best, wsc, wkey, wcand, wprev);
        if (mh) put(x, hs, cs, key, ccand, -1);
        if (mw || mh) rescan(x, key_depth, nc);
      }
    });
    F += (sib ? 1 : 0) + (child ? 1 : 0) - 1;
    if (both) ++hw;
  }
  w.sync();
  return count + 1;
}

// The CPU stand-in for a warp: 32 lane states; each() runs the lanes one after another, the
// collectives loop over the lanes (a shuffle evaluates its source lane only).
template <int S>
struct CpuWarp {
  Lane<S> lanes[32];
  // KDT_HD with host-only bodies (as CpuBlock in tree_build_cpu.cpp): nvcc compiles the CPU
  // backend too, and build<S, CpuWarp> is __host__ __device__.
  template <class F>
  KDT_HD void each(F f) {
#if !defined(__CUDA_ARCH__)
    for (int l = 0; l < 32; ++l) f(lanes[l], l);
#endif
  }
  template <class F>
  KDT_HD uint32_t max(F f) {
    uint32_t m = 0;
#if !defined(__CUDA_ARCH__)
    for (int l = 0; l < 32; ++l) { const uint32_t v = f(lanes[l], l); m = v > m ? v : m; }
#endif
    return m;
  }
  template <class F>
  KDT_HD uint32_t min(F f) {
    uint32_t m = 0xFFFFFFFFu;
#if !defined(__CUDA_ARCH__)
    for (int l = 0; l < 32; ++l) { const uint32_t v = f(lanes[l], l); m = v < m ? v : m; }
#endif
    return m;
  }
  template <class F>
  KDT_HD uint32_t ballot(F f) {
    uint32_t m = 0;
#if !defined(__CUDA_ARCH__)
    for (int l = 0; l < 32; ++l) m |= f(lanes[l], l) ? 1u << l : 0u;
#endif
    return m;
  }
  template <class F>
  KDT_HD uint32_t shfl(F f, int src) {
#if !defined(__CUDA_ARCH__)
    return f(lanes[src], src);
#else
    return 0;
#endif
  }
  KDT_HD void sync() {}
};

}  // namespace wrp
}  // namespace tree
}  // namespace kdt
