// tree_build_parallel_order.h: the parallel tree build's last phases (tree_build_parallel.h,
// section 3), as block-synchronous __host__ __device__ code: the pool's kept entries ordered, then
// the node arrays.
//
// The kept nodes are ordered by (score desc, rank path asc): a bucket sort on the score
// (order_bins: 256, 1024 or 4096 buckets by the pool's capacity), ranks counted inside a bucket
// with no branch; the first B are nodes 1..B. Parents and child lists (prepend rule) follow from
// the order: a run is contiguous, so a node's left sibling is the entry before it.
//
// Measured and not kept (H200, bench.tree_ab against the buckets):
//   - Counting each kept entry's rank over the whole pool instead, one phase with no buckets,
//     for pools up to 256 entries: 1.07x at bs 1 and 1.20x at bs 64, budget 63, 1.25-1.30x at
//     127, with a branch-free loop unrolled 4 times; its phase took 5.6k cycles at budget 63, bs
//     64, against 4.5k for the bucket sort's three. A warp an entry and a lane a column instead,
//     the columns' scores in registers: 1.32x at bs 64 and 1.13x at bs 1, budget 63, ~350 cycles
//     an entry in series in its warp, ~800 with a tie; four entries an iteration was slower
//     still: 8f7e796 and 7e71da8, reverted.
//   - G lanes an entry, G picked from the pool's size, each a stride of the columns, a shuffle
//     sum: 7.5k cycles at bs 1, budget 63 (profile, seed 5) against the buckets' 5.0k; bs 64's
//     slowest block 42.7k against 21.7k. Not kept.
//   - A merge for the queue's pool up to 256 entries: each warp sorts a chunk of 32 entries with
//     a bitonic network of shuffles, then an entry's rank is its slot plus a six-probe binary
//     search of every other chunk on score and key (ties of both, rare, compared by rank path
//     after). Two phases, but at bs 64, budget 63 (profile, seed 5) the sort took 2.8k cycles
//     and the ranks 6.6k, against 4.2k for the buckets' three phases: 1.11-1.21x at budgets
//     33-63, bs 1-1024. Not kept.
//   - The queue's entries binned into these buckets as the queue takes them (t and the top score
//     are known before it: a bucket, a slot by a shared atomic, a list of up to 8 entries a
//     bucket, 1 request in 768 overflowing one), so that the order is one phase: an entry's rank
//     is the count of the buckets before its own, from 32 group sums scanned by shuffles plus
//     its group's buckets before it, and the entries of its bucket that precede it. The one
//     phase took 2.8-3.6k cycles against the three's 3.9k, but each batch's run lengths ~250
//     cycles more (binning after the queue instead, each warp its own entries once it has no
//     batch left: no cheaper); seeds 15 and 5, five variants: budget 63 1.00-1.13x at bs 1-1024,
//     budgets 33 and 47 1.02-1.07x at bs 64 and 0.97-1.05x at bs 1. Not kept.
//   - The same lists made after the queue, at budgets <= 63 only (a bucket's first 8 entries
//     listed as it is binned; an entry ranks itself over its bucket's list, or over the pool
//     when the bucket has more), so that no phase places the entries: 4 KB more shared memory.
//     H100, bench.tree_ab against the buckets (both with KDT_NO_UNROLL), kernel alone, seed 15:
//     0.99-1.00x at budget 63, bs 1-1024, but 1.17x at bs 16; budgets 33 and 47 1.01-1.02x.
//     Branch i15-lists (e48e2e0), not kept. On it, the family's bound binned into its own
//     histogram, so that each warp picks the bound's bin alone (no barrier, no hand-over):
//     1.02-1.10x of the lists at budgets 33-1023, bs 1-1024 (branch i15-pick, 168807a).
//   - The buckets' scan folded into the placing phase at 256 buckets: every warp scans the 256
//     counts itself (8 a lane, a shuffle scan) and an entry's bucket start comes by shuffle from
//     the lane holding it, so the scan's phase and its two barriers go, and an entry's cnt
//     carries its bucket's bounds to the ranks. H100, bench.tree_ab against this code, kernel
//     alone, seed 15, bit-exact: 1.009-1.040x at budget 63 (bs 1 8.45 -> 8.60 us), 1.011-1.021x
//     at 33-127, and 1.013-1.017x at 1023, whose path only moved the bounds into cnt. Branch
//     i15-scan, not kept.
#pragma once

#include <stdint.h>

#include "kdtree/hd.h"
#include "tree_build_core.h"
#include "tree_build_parallel_plan.h"
#include "tree_build_parallel_state.h"

namespace kdt {
namespace tree {
namespace par {

// Orders entries [0, n) of pool copy c (entry 0 the root): those at or above the bound bd (all of
// them when it has none) by (score desc, rank path asc), then writes nodes 1..used - 1 from the
// first budget of them into N, with their parents and child lists. top: the best score of all
// (the buckets' upper edge); lsb: every score is a multiple of 2^lsb; hist_clean: hist's first
// kBins bins are zero; mord: log2 of the order buckets (A.nord). Returns used, the slots filled
// (root included).
template <class Block>
KDT_HD int order_nodes(Block& blk, const Shared& S, const Arrays& A, const Nodes& N, int c, int n,
                       const Bound& bd, double top, int lsb, int budget, bool hist_clean,
                       int mord) {
  const int T = blk.threads();
  // ---- 3. the order: buckets by score (a bucket sort), ranks counted inside a bucket --------
  const Pool P = A.pool(c);
  const bool all = !bd.has;
  const double tt = bd.t;
  const double lo = all ? unordered(S.pmin) : tt;
#if defined(__CUDA_ARCH__)
  Bins bins;
#else
  Bins bins{};  // read only when spread; g++ (-Wmaybe-uninitialized) cannot see that
#endif
  const bool spread = n > 1 && make_bins(lo, top, mord, lsb, bins);
  // hist's bins above kBins are still zero from the first phase; its first kBins are too
  // unless a refinement ran after the last level's write.
  if (!hist_clean) {
    blk.run([&](int t) {
      KDT_NO_UNROLL
      for (int i = t; i < kBins; i += T) A.hist[i] = 0;
    });
  }
  blk.run([&](int t) {
    if (t == 0) A.inv[0] = 0;
    KDT_NO_UNROLL
    for (int e = 1 + t; e < n; e += T) {
      A.inv[e] = 0;
      const double s = P.score[e];
      if (!(all || s >= tt)) { A.cnt[e] = -1; continue; }
      const int bk = spread ? bins.nb - 1 - bins.of(s) : 0;  // bucket 0: the best scores
      A.cnt[e] = (bk << 16) | hist_add(A.hist, bk);
    }
  });
  blk.mark(86);
  const int kept_n = blk.scan(A.hist, A.nord);  // hist: each bucket's first position
  blk.mark(80);
  // Bucket by bucket: the entries (srt), and with two copies their scores and keys beside them in
  // the other one (free now), so that counting an entry's rank in its bucket reads independent
  // values; with one copy the count reads them through srt.
  const bool twin = A.twin;
  const Pool Q = twin ? A.pool(c ^ 1) : P;
  blk.run([&](int t) {
    KDT_NO_UNROLL
    for (int e = 1 + t; e < n; e += T) {
      const int v = A.cnt[e];
      if (v < 0) continue;
      const int q = A.hist[v >> 16] + (v & 0xFFFF);
      A.srt[q] = (uint16_t)e;
      if (twin) {
        Q.score[q] = P.score[e];
        Q.key[q] = P.key[e];
      }
    }
  });
  blk.mark(85);
  const int used = (kept_n < budget ? kept_n : budget) + 1;
  blk.run([&](int t) {
    // Every node's child list starts empty (the nodes phase then links the parents: written
    // here, a phase ahead, so that the two writes to a parent's first_child are ordered).
    KDT_NO_UNROLL
    for (int i = t; i < used; i += T) N.first_child[i] = -1;
    KDT_NO_UNROLL
    for (int q = t; q < kept_n; q += T) {
      const int e = A.srt[q], bk = A.cnt[e] >> 16;
      const int b0 = A.hist[bk], b1 = bk + 1 < A.nord ? A.hist[bk + 1] : kept_n;
      // A bucket that starts at or past position `budget` holds no selected entry: each entry's
      // rank is at least the bucket's start. (The scores crowd toward the threshold, so these
      // are often the largest buckets. H200, bench.tree_ab against counting them, kernel alone,
      // seeds 15 and 5: budget 255 0.978-0.985x, 1023 0.977-0.996x (bs 1 and 64), 33 and 63
      // 0.991-1.007x; seeds 2 and 3 budget 63 1.00x, 255 0.984-0.996x. Such buckets skipped
      // in the placing phase too, the ranks' loop ending at the end of the last bucket that
      // starts before `budget` (a shared word the entry placed at budget - 1 writes): H200,
      // bench.tree_ab against this, seeds 15 and 5, 3 rounds: budgets 47 and 63 1.008-1.015x at
      // bs 1 and 64, 255 1.006-1.007x, 1023 0.999-1.003x. Not kept.)
      if (b0 >= budget) continue;
      const int y = twin ? q : e;
      const double se = Q.score[y];
      const uint64_t ke = Q.key[y];
      // before() on the scores and keys, with no branch (four entries an iteration); an entry
      // of equal score and key (a tie deeper than the keys: rare) is counted by before() after.
      // (The loop before this one branched on each entry's score, then its key, then called
      // before(). H200, bench.tree_ab against it, kernel alone, seeds 15 and 5: budget 63
      // 0.983-0.996x at bs 1-1024, 33 0.976-0.993x, 127 0.98-0.99x, 255 0.945-0.987x, 1023
      // 0.89-0.96x (bs 1 and 64); at bs 64 the slowest block's ranks took 1.0k cycles against
      // 2.2k at budget 63, and 4.5k against 10.7k at 1023 (KDT_PAR_PROFILE, seed 5).)
      int r = b0, tie = 0, k = b0;
      auto count = [&](int kx) {
        const int x = twin ? kx : A.srt[kx];
        const double sk = Q.score[x];
        const uint64_t kk = Q.key[x];
        r += (sk > se) | ((sk == se) & (kk < ke));
        tie |= (sk == se) & (kk == ke) & (kx != q);
      };
      for (; k + 4 <= b1; k += 4) {
        count(k);
        count(k + 1);
        count(k + 2);
        count(k + 3);
      }
      for (; k < b1; ++k) count(k);
      if (tie) {
        for (k = b0; k < b1; ++k) {
          const int x = twin ? k : A.srt[k];
          if (k != q && Q.score[x] == se && Q.key[x] == ke)
            r += before(P, A.key_depth, A.srt[k], e);
        }
      }
      if (r < budget) { A.inv[e] = (int16_t)(r + 1); A.order[r] = (uint16_t)e; }
    }
  });
  blk.mark(81);
  // ---- nodes: order[r] is the entry of node r + 1 (one phase) -------------------------------
  blk.run([&](int t) {
    if (t == 0) { N.score[0] = 0.0; N.cand[0] = 0; N.next_sibling[0] = -1; }
    KDT_NO_UNROLL
    for (int i = 1 + t; i < used; i += T) {
      const int e = A.order[i - 1];
      const uint32_t cd = P.cand[e];
      const int r = cand_rank(cd);
      N.score[i] = P.score[e];
      N.cand[i] = pack((uint32_t)A.inv[cand_parent(cd)], (uint32_t)r, (uint32_t)cand_depth(cd));
      N.next_sibling[i] = r > 0 ? A.inv[e - 1] : (int16_t)-1;
      // The last selected child of its run (the run's next entry is rank + 1 of one parent).
      const bool more = e + 1 < n && A.inv[e + 1] &&
                        P.cand[e + 1] == pack(cand_parent(cd), cand_rank(cd) + 1, cand_depth(cd));
      if (!more) N.first_child[A.inv[cand_parent(cd)]] = (int16_t)i;
    }
  });
  blk.mark(82);
  return used;
}

}  // namespace par
}  // namespace tree
}  // namespace kdt
