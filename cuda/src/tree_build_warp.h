// tree_build_warp.h: the DDTree best-first build (DDTREE.md section 2) on ONE warp, with no
// block barrier, as __host__ __device__ code: the CUDA kernel (tree_build.cu, several requests
// per CTA, a warp each) and the CPU emulation (tree_build_cpu.cpp, KDT_TREE_BUILD=warp) run this
// very code, the CPU through CpuWarp below (32 lane states, collectives as loops).
//
// It is the reference's heap order exactly (same float64 operations, same strict total order:
// score descending, then rank path ascending), with the frontier kept SORTED in registers:
//   - every lane holds the frontier's best entry (the next pop); the rest of the frontier, R,
//     is sorted over 32 x S slots, lane l holding positions l S .. l S + S - 1 (S a compile-time
//     count, so the slots stay in registers). An entry at frontier position k pops no earlier
//     than k pops later, so only R's first budget - 1 entries can ever pop: 32 S >= budget - 1
//     slots hold all of them, and entries pushed past the last slot are dropped;
//   - a pop emits the best entry; every lane computes its sibling and first child itself (the
//     log-probs are in shared memory: same reads everywhere) and counts its slots that precede
//     each (S independent comparisons). R is sorted, so the slots preceding a new entry form a
//     prefix, and its position in R is the sum of the lanes' counts, a ballot per bit of a count;
//   - the next best is the first of R[0] (broadcast from lane 0 before the comparisons), the
//     sibling and the child; R moves by -1, 0 or +1 positions per slot to take the new entries
//     (a select within a lane, one shuffle up and one down across lanes). No argmax and no
//     rescan: a pop is a short chain of a shared load, two float64 additions, a comparison,
//     ballots and selects;
//   - keys travel with the entries (a child's key is its parent's, a sibling's its left
//     sibling's plus one in its rank field), and each entry carries the node index of its left
//     sibling, which is its next_sibling under the prepend rule (siblings pop in rank order), so a
//     pop reads no node array. Every lane writes node_cand[i] itself (the same value): the rare
//     full rank-path comparison (equal scores, equal keys below key_depth) reads node_cand, and
//     each lane reads only its own writes; lane 0 writes the other node arrays, read after the
//     final warp barrier.
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
// KDT_TREE_BUILD=auto: warp up to here, parallel above. H200, kernel alone (2026-12-01): budget
// 15, warp 9.5-9.9 us against parallel 11.8-14.1 (256 threads; 12.2-18.0 with 128, 512 or
// 1024); budget 63, a pop of the warp build costs about 1000 cycles (clock64: 62k cycles for
// 63 pops at bs 1, about 190 dependent instructions each), parallel 15-21 us.
constexpr int kAutoMaxBudget = 15;

// Slots per lane for a budget: the smallest power of two S with 32 S >= budget - 1.
KDT_HD int slots_for(int budget) {
  int s = 1;
  while (32 * s < budget - 1) s *= 2;
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

// A frontier entry. cand == 0 (and u == 0): an empty slot (a real candidate has depth >= 1).
struct Entry {
  double sc;      // the score
  uint64_t u;     // ord(sc)
  uint64_t key;   // rank-path prefix key
  uint32_t cand;  // tree::pack(parent node, rank, depth)
  int prev;       // node index of the left sibling (-1 for rank 0)
};

KDT_HD Entry make_entry(double sc, uint64_t key, uint32_t cand, int prev) {
  Entry e;
  e.sc = sc;
  e.u = cand ? ord(sc) : 0ull;
  e.key = key;
  e.cand = cand;
  e.prev = prev;
  return e;
}

// One lane's share of R: positions lane S .. lane S + S - 1, and this pop's counts.
template <int S>
struct Lane {
  Entry e[S];
  int ns, nc;  // slots preceding the sibling / the child
};

// Entry a precedes entry b in pop order (distinct candidates; a may be empty: never first).
KDT_HD bool precedes(const Entry& a, const Entry& b, int key_depth, const uint32_t* node_cand) {
  if (a.u != b.u) return a.u > b.u;
  if (a.key != b.key) return a.key < b.key;
  const int da = cand_depth(a.cand), db = cand_depth(b.cand);
  if (da <= key_depth && db <= key_depth) return da < db;
  return compare_paths(a.cand, b.cand, node_cand) < 0;
}

// Node arrays of one request (node order, slot 0 the root), as tree::build_one fills them.
struct WarpNodes {
  double* score;
  uint32_t* cand;
  int16_t* first_child;
  int16_t* next_sibling;
};

// Builds one request on the warp w (Warp: each / ballot / first / shift / sync, see CpuWarp and
// the CUDA kernel's GpuWarp); lp is [L, K] (shared memory on CUDA). Returns the slots used
// (root included), as tree::build_one does. budget - 1 <= 32 S.
template <int S, class Warp>
KDT_HD int build(Warp& w, const float* lp, int L, int K, int budget, int key_bits, int key_depth,
                 const WarpNodes& N) {
  const uint32_t* nc = N.cand;
  constexpr int kNowhere = 1 << 30;  // the position of an entry that does not exist
  w.each([&](Lane<S>& x, int lane) {
KDT_WARP_UNROLL
    for (int k = 0; k < S; ++k) x.e[k] = make_entry(0.0, 0ull, 0u, -1);
    N.cand[0] = 0;
    if (lane == 0) {
      N.score[0] = 0.0;
      N.first_child[0] = -1;
      N.next_sibling[0] = -1;
    }
  });
  Entry top = make_entry((double)lp[0], 0ull, pack(0, 0, 1), -1);  // uniform
  int count = 0;
  while (top.cand != 0 && count < budget) {
    const Entry r0 = w.first();  // R[0]: needed only after the comparisons
    const int parent = cand_parent(top.cand), rank = cand_rank(top.cand);
    const int depth = cand_depth(top.cand);
    const int i = ++count;
    const bool sib = rank + 1 < K, child = depth < L;
    // Loads at clamped indices, issued whether or not the entry exists.
    const float* row = lp + (size_t)(depth - 1) * K;
    const double a = (double)row[rank], b = (double)row[sib ? rank + 1 : rank];
    const double c = (double)lp[child ? (size_t)depth * K : 0];
    // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2)
    const uint64_t skey =
        depth <= key_depth ? top.key + (1ull << (64 - key_bits * depth)) : top.key;
    const Entry es = make_entry((top.sc - a) + b, skey, sib ? pack(parent, rank + 1, depth) : 0u, i);
    const Entry ec = make_entry(top.sc + c, top.key, child ? pack(i, 0, depth + 1) : 0u, -1);
    w.each([&](Lane<S>& x, int lane) {
      N.cand[i] = top.cand;  // every lane: each reads only its own writes (compare_paths)
      if (lane == 0) {
        N.score[i] = top.sc;
        N.first_child[i] = -1;
        N.next_sibling[i] = (int16_t)top.prev;  // the prepend rule: the rank - 1 sibling
        N.first_child[parent] = (int16_t)i;
      }
      int ns = 0, ncnt = 0;
KDT_WARP_UNROLL
      for (int k = 0; k < S; ++k) {
        ns += sib && precedes(x.e[k], es, key_depth, nc) ? 1 : 0;
        ncnt += child && precedes(x.e[k], ec, key_depth, nc) ? 1 : 0;
      }
      x.ns = ns;
      x.nc = ncnt;
    });
    // Positions in R: the counts summed over the lanes, bit by bit (a count is <= S).
    int ps = 0, pc = 0;
KDT_WARP_UNROLL
    for (int bit = 1; bit <= S; bit <<= 1) {
      ps += bit * popc32(w.ballot([bit](const Lane<S>& x, int) { return (x.ns & bit) != 0; }));
      pc += bit * popc32(w.ballot([bit](const Lane<S>& x, int) { return (x.nc & bit) != 0; }));
    }
    // Positions in the merge M of R, the sibling and the child; the next best is M[0], and the
    // new R is M[1..].
    const bool s_first = sib && child && precedes(es, ec, key_depth, nc);
    const int ms = sib ? ps + (child && !s_first ? 1 : 0) : kNowhere;
    const int mc = child ? pc + (s_first ? 1 : 0) : kNowhere;
    w.shift([&](Lane<S>& x, int lane, const Entry& next, const Entry& last) {
      // next: lane + 1's first slot (empty for lane 31); last: lane - 1's last slot.
      Entry old[S];
KDT_WARP_UNROLL
      for (int k = 0; k < S; ++k) old[k] = x.e[k];
KDT_WARP_UNROLL
      for (int k = 0; k < S; ++k) {
        const int m = lane * S + k + 1;  // this slot's position in M
        const int shift = (ms < m ? 1 : 0) + (mc < m ? 1 : 0);
        const Entry& up = k + 1 < S ? old[k + 1 < S ? k + 1 : 0] : next;
        const Entry& down = k > 0 ? old[k > 0 ? k - 1 : 0] : last;
        x.e[k] = m == ms ? es : m == mc ? ec : shift == 0 ? up : shift == 1 ? old[k] : down;
      }
    });
    top = ms == 0 ? es : mc == 0 ? ec : r0;
  }
  w.sync();
  return count + 1;
}

// The CPU stand-in for a warp: 32 lane states; each() runs the lanes one after another, the
// collectives loop over the lanes.
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
  KDT_HD uint32_t ballot(F f) {
    uint32_t m = 0;
#if !defined(__CUDA_ARCH__)
    for (int l = 0; l < 32; ++l) m |= f(lanes[l], l) ? 1u << l : 0u;
#endif
    return m;
  }
  // Lane 0's first slot.
  KDT_HD Entry first() const { return lanes[0].e[0]; }
  // f(lane state, lane, lane + 1's first slot, lane - 1's last slot), every lane seeing the
  // states from before the call (lane 31 sees an empty next slot).
  template <class F>
  KDT_HD void shift(F f) {
#if !defined(__CUDA_ARCH__)
    Entry firsts[33], lasts[32];
    for (int l = 0; l < 32; ++l) { firsts[l] = lanes[l].e[0]; lasts[l] = lanes[l].e[S - 1]; }
    firsts[32] = make_entry(0.0, 0ull, 0u, -1);
    for (int l = 0; l < 32; ++l) f(lanes[l], l, firsts[l + 1], lasts[l ? l - 1 : 0]);
#endif
  }
  KDT_HD void sync() {}
};

}  // namespace wrp
}  // namespace tree
}  // namespace kdt
