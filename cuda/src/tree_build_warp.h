// tree_build_warp.h: the DDTree best-first build (DDTREE.md section 2) on ONE warp, with no
// block barrier, as __host__ __device__ code: the CUDA kernel (tree_build.cu, several requests
// per CTA, a warp each) and the CPU emulation (tree_build_cpu.cpp, KDT_TREE_BUILD=warp) run this
// very code, the CPU through CpuWarp below (32 lane states, collectives as loops).
//
// It is the reference's heap order exactly (same float64 operations, same strict total order:
// score descending, then rank path ascending), with the frontier held in registers:
//   - the frontier (at most budget + 1 entries) lives in 32 x S slots, S per lane (a compile-time
//     count, so the slot arrays stay in registers); each lane caches its best entry;
//   - a pop is a warp argmax of the lanes' bests: two 32-bit max reductions over the
//     order-preserving image of the score (redux.sync), a ballot, and only on equal scores two
//     min reductions over the rank-path prefix key (tree_build_core.h), then, on equal keys, the
//     full rank-path comparison lane pair by lane pair (rare);
//   - every lane computes the winner's sibling and child scores itself (the log-probs are in
//     shared memory; same reads everywhere), so no lane waits for another's write;
//   - the sibling (or child) takes the winner's slot, the other push the next never-used slot
//     (a high-water mark, < budget + 1); only the lanes whose slots changed rescan their S slots.
//   - keys travel with the entries (a child's key is its parent's, a sibling's its left
//     sibling's plus one in its rank field), and each entry carries the node index of its left
//     sibling, which is its next_sibling under the prepend rule (siblings pop in rank order), so a
//     pop reads no node array. Every lane writes node_cand[i] itself (the same value): the rare
//     full rank-path comparison reads node_cand, and each lane reads only its own writes; lane 0
//     writes the other node arrays, read after the final warp barrier.
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
// KDT_TREE_BUILD=auto: warp up to here, parallel above. H200, kernel alone (2026-12-01,
// bench.tree_ab): budget 15, warp 8.7-9.2 us against parallel 12.4-14.6 (256 threads; 12.7-21.2
// with 32-128); budget 63, warp 36.5-38.5 us against parallel 15.8-21.1 (a pop of the warp
// build costs about 1000 cycles: 62k cycles for 63 pops at bs 1). A frontier kept sorted
// across the warp instead (no argmax: a pop merges two entries) measured 1.03x at budget 15 and
// 1.33x at 63: 390 instructions a pop, moving and selecting whole entries per slot.
constexpr int kAutoMaxBudget = 15;

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
};

// Builds one request on the warp w (Warp: each / max / min / ballot / shfl / sync, see CpuWarp
// and the CUDA kernel's GpuWarp); lp is [L, K] (shared memory on CUDA). Returns the slots used
// (root included), as tree::build_one does. budget <= 32 S - 1.
template <int S, class Warp>
KDT_HD int build(Warp& w, const float* lp, int L, int K, int budget, int key_bits, int key_depth,
                 const WarpNodes& N) {
  const uint32_t* nc = N.cand;
  w.each([&](Lane<S>& x, int lane) {
KDT_WARP_UNROLL
    for (int k = 0; k < S; ++k) x.cand[k] = 0;
    if (lane == 0) put(x, 0, (double)lp[0], 0ull, pack(0, 0, 1), -1);
    N.cand[0] = 0;
    if (lane == 0) {
      N.score[0] = 0.0;
      N.first_child[0] = -1;
      N.next_sibling[0] = -1;
    }
    rescan(x, key_depth, nc);
  });
  int F = 1, hw = 1, count = 0;  // frontier size, high-water slot, pops: uniform
  while (F > 0 && count < budget) {
    // Warp argmax of the lanes' bests: the high halves of the scores' images first; the low
    // halves only when two lanes share the highest high half (a ballot, not a second reduction,
    // settles the common case).
    const uint32_t hi = w.max([](const Lane<S>& x, int) { return (uint32_t)(x.bsu >> 32); });
    uint32_t m = w.ballot([hi](const Lane<S>& x, int) { return (uint32_t)(x.bsu >> 32) == hi; });
    uint64_t top = (uint64_t)hi << 32;  // complete only when read (m has several lanes)
    if (popc32(m) > 1) {
      const uint32_t lo = w.max([hi](const Lane<S>& x, int) {
        return (uint32_t)(x.bsu >> 32) == hi ? (uint32_t)x.bsu : 0u;
      });
      top |= lo;
      m = w.ballot([top](const Lane<S>& x, int) { return x.bsu == top; });
    }
    if (popc32(m) > 1) {  // equal scores: the smallest rank-path key
      const uint32_t khi = w.min([m](const Lane<S>& x, int l) {
        return (m >> l) & 1u ? (uint32_t)(x.bkey >> 32) : 0xFFFFFFFFu;
      });
      const uint32_t klo = w.min([m, khi](const Lane<S>& x, int l) {
        return ((m >> l) & 1u) && (uint32_t)(x.bkey >> 32) == khi ? (uint32_t)x.bkey
                                                                   : 0xFFFFFFFFu;
      });
      const uint64_t kk = ((uint64_t)khi << 32) | klo;
      m = w.ballot([m, kk](const Lane<S>& x, int l) { return ((m >> l) & 1u) && x.bkey == kk; });
      if (popc32(m) > 1) {  // equal keys: depths, or the full rank paths, pair by pair
        int wl = ffs32(m);
        uint32_t wc = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, wl);
        for (uint32_t rest = m & (m - 1); rest; rest &= rest - 1) {
          const int l = ffs32(rest);
          const uint32_t c = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, l);
          if (precedes(top, kk, c, top, kk, wc, key_depth, nc)) { wl = l; wc = c; }
        }
        m = 1u << wl;
      }
    }
    const int wl = ffs32(m);
    const uint32_t cand = w.shfl([](const Lane<S>& x, int) { return x.bcand; }, wl);
    const uint32_t khi = w.shfl([](const Lane<S>& x, int) { return (uint32_t)(x.bkey >> 32); }, wl);
    const uint32_t klo = w.shfl([](const Lane<S>& x, int) { return (uint32_t)x.bkey; }, wl);
    const uint32_t shi =
        w.shfl([](const Lane<S>& x, int) { return (uint32_t)(bits(x.bsc) >> 32); }, wl);
    const uint32_t slo = w.shfl([](const Lane<S>& x, int) { return (uint32_t)bits(x.bsc); }, wl);
    const int prev = (int)w.shfl([](const Lane<S>& x, int) { return (uint32_t)x.bprev; }, wl);
    const uint64_t key = ((uint64_t)khi << 32) | klo;
    const double score = from_bits(((uint64_t)shi << 32) | slo);
    const int parent = cand_parent(cand), rank = cand_rank(cand), depth = cand_depth(cand);
    const int i = ++count;
    const bool sib = rank + 1 < K, child = depth < L;
    const float* row = lp + (size_t)(depth - 1) * K;
    // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2)
    const double ss = sib ? (score - (double)row[rank]) + (double)row[rank + 1] : 0.0;
    const double cs = child ? score + (double)lp[(size_t)depth * K] : 0.0;
    const uint64_t skey = depth <= key_depth ? key + (1ull << (64 - key_bits * depth)) : key;
    const int hl = hw & 31, hs = hw >> 5;
    w.each([&](Lane<S>& x, int lane) {
      N.cand[i] = cand;  // every lane: each reads only its own writes (compare_paths)
      if (lane == 0) {
        N.score[i] = score;
        N.first_child[i] = -1;
        N.next_sibling[i] = (int16_t)prev;  // the prepend rule: the rank - 1 sibling
        N.first_child[parent] = (int16_t)i;
      }
      bool changed = false;
      if (lane == wl) {
        if (sib) put(x, x.best, ss, skey, pack(parent, rank + 1, depth), i);
        else if (child) put(x, x.best, cs, key, pack(i, 0, depth + 1), -1);
        else clear(x, x.best);
        changed = true;
      }
      if (sib && child && lane == hl) {
        put(x, hs, cs, key, pack(i, 0, depth + 1), -1);
        changed = true;
      }
      if (changed) rescan(x, key_depth, nc);
    });
    F += (sib ? 1 : 0) + (child ? 1 : 0) - 1;
    if (sib && child) ++hw;
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
