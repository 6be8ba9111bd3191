// tree_build_parallel.h: the parallel DDTree build (DDTREE.md section 2) as block-synchronous
// __host__ __device__ code. One CTA of T threads builds one request; the same code runs on the
// CPU thread by thread (tree_build_cpu.cpp, KDT_TREE_BUILD=parallel) so that it is tested
// exhaustively against the reference without a GPU.
//
// Why it is exact. The reference pops a heap whose entries are scored along generator chains in
// float64 (a rank-0 child: parent + lp[d][0]; a sibling: (left - lp[d][r]) + lp[d][r + 1]). The
// build first checks, for the whole request, that
//   - every log-prob is finite and <= 0, and each row is non-increasing, and
//   - every float64 sum of at most L + 2 of them is exact: all log-probs are multiples of
//     2^g (g: the lowest set bit over all of them) and (L + 2) * max|lp| < 2^(g + 53).
// Then every reference score equals the exact sum of its path's log-probs (each chain operation
// is exact), so a node scores s(parent) + lp[d][r], computed directly, bit for bit (a zero score
// takes the sign the chain gives it: zero_score); no node scores above its generator; and the
// heap pops exactly the B best nodes of the implicit tree in (score desc, rank path asc) order.
// Inputs that fail the check (mixed magnitudes, positive log-probs, unsorted rows, non-finite
// values) are declined and the caller runs the serial build: the result is the reference's in
// every case.
//
// The build (a pool of candidates in shared memory; t: a lower bound on the B-th best score):
//   0. t from a family of nodes whose scores are known sums: the rank-0 chain with one deviation
//      at its end, (0, ..., 0, r), the depth-2 grid (r1 >= 1, r2) of side about sqrt(2 B), and
//      the grid's corner extended by up to three rank-0 steps; the family's B-th best is <= the
//      tree's B-th best.
//   1'. Up to budget kQueueMaxBudget, the nodes at or above t go through a queue instead: the runs
//      of the rank-0 chain's first three nodes by the block (kChainRuns), then each warp expands a
//      share of them and, batch by batch, the children it wrote itself, each entry's run (the same
//      count) placed at the end of the pool (Block::expand). A queue that would overflow the pool
//      gives way to the levels.
//   1. Level by level, each kept node of the previous level gets a run of children, ranks
//      0..c-1 with s(parent) + lp[d][r] >= t (c by a 4-ary search, last_pass: scores fall
//      along a row), placed by a block scan of the lengths (runs in parent order), then
//      written flattened: thread i writes elements i, i + T, ..., each finding its run by a
//      4-ary search over the offsets, so a level costs the same whatever its run lengths.
//   2. t rises with a 256-bin score histogram whenever the pool keeps more than 1.5 B nodes: if
//      the bins at or above bin j hold >= B nodes, the B-th best is >= bin j's lower edge; when
//      many entries fall below the new t and a next level as large as this one would not fit,
//      the pool is compacted then (stable; dropped nodes are below t, and so are their
//      subtrees). A level whose runs would overflow the pool raises t over the pool and the
//      runs first, then recounts, or compacts first when the pool's entries and the runs at or
//      above t would not fit beside the stale ones. Compaction goes into the pool's second
//      copy, or, where shared memory holds one copy only (Arrays::twin; sm_120 at large
//      budgets), in place through a small buffer, a round at a time.
//   3. The kept nodes are ordered by (score desc, rank path asc), and the first B become nodes
//      1..B with their parents and child lists (tree_build_parallel_order.h: a bucket sort on
//      the score, ranks counted inside a bucket; the alternatives measured are there).
// Masses of exact ties that overflow the pool even so are declined as well.
//
// The Block (tree_build_gpu_block.cuh's GpuBlock, tree_build_cpu.cpp's CpuBlock) runs each phase
// for every thread then synchronises (run), and provides the collectives (an exclusive scan, run
// lengths with their offsets, a suffix pick over a histogram, the chain prefix sums, a chain run's
// length (count_run), the queue of section 1': expand, which ends with a barrier); mark(id) is a
// profiling probe (clock64 on the GPU when built with KDT_PAR_PROFILE, else nothing; an id
// names the phase that ends there, level d's are 100 + d, 200 + d and 300 + d; see
// bench/tree_profile.py). Code outside run() is uniform: it runs once on the CPU and on every
// thread on the GPU, and writes no shared state.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kdtree/hd.h"
#include "tree_build_core.h"
#include "tree_build_parallel_order.h"
#include "tree_build_parallel_plan.h"
#include "tree_build_parallel_state.h"

namespace kdt {
namespace tree {
namespace par {

// Builds one request into N (node order; slot 0 the root); returns the slots used (root
// included), or -1 when it declines the request (S.flags says why, unless pre): the caller then
// runs the serial build. lp is [L, K] (rows sorted descending). init(S) must have run. pre: the
// caller has done the first phase's work already (first_entries, A.chain and S.fmin by
// Block::chain_sums, and the check of every log-prob: its verdict, the same in every thread),
// and a barrier since; nullptr: the build does it.
// kPaths: the expansions compiled in (kQueuePath, kLevelPath; both by default). Without the
// levels, a request the queue does not take (no first bound, or a pool overflow) is declined.
constexpr int kQueuePath = 1, kLevelPath = 2;
template <class Block, int kPaths = kQueuePath | kLevelPath>
KDT_HD int build(Block& blk, Shared& S, const Arrays& A, const Nodes& N, const float* lp, int L,
                 int K, int budget, int cap, const Consts& C, const Checked* pre = nullptr) {
  const int T = blk.threads();
  const int kc = C.kc;  // ranks >= budget are never selected
  const int kf = C.kf;  // the chain deviations' ranks in the family
  // ---- 0. the exactness check, the chain sums, the first threshold ------------------------
  // chain[d] = lp[0][0] + ... + lp[d - 1][0], fmin: the family's lowest chain score (warp 0,
  // alongside the check: no barrier of its own; both are read after the check's). They are
  // used only when the check passes, when every such sum is exact.
  Checked ck;
  if (pre) {
    ck = *pre;
  } else {
    blk.chain_sums(lp, L, K, kf, A.chain, &S.fmin);
    blk.run([&](int t) { check_phase(S, A, lp, L, K, t, T); });
    ck.flags = S.flags;
    ck.emin = S.emin;
    ck.emax = S.emax;
  }
  blk.mark(1);
  // The verdict, by every thread from the scalars (uniform): no phase of its own.
  {
    const int lg = C.lg;
    const bool inexact = ck.emin < (1 << 30) && ck.emax + lg > ck.emin + 53;
    if (ck.flags || inexact) {
      if (pre) return -1;
      blk.run([](int) {});  // every thread has read S.flags before thread 0 adds to it
      blk.run([&](int t) { if (t == 0 && inexact) S.flags |= kInexact; });
      return -1;
    }
  }
  blk.mark(2);
  const double top = (double)lp[0];  // the best score of all: depth 1, rank 0
  const int lsb = ck.emin;  // every score is a multiple of 2^lsb (Bins)
  Bound bd{0.0, false};
  bool hist_clean = true;  // hist is all zero (uniform)
  // The family: (0, ..., 0, r) at every depth, r < family_ranks; the depth-2 grid (r1, r2),
  // 1 <= r1 < g, r2 < g, g ~ sqrt(2 B); and the grid's corner r1 < h, r2 < h, h = (g + 1) / 2,
  // extended by e = 1..E rank-0 steps, (r1, r2, 0, ..., 0) (E = min(3, L - 2)): distinct nodes
  // (an extension has depth >= 3 and r1 >= 1, unlike every chain deviation) whose scores are
  // sums of known values. The extensions bring deeper nodes in, where most of a large budget's
  // best nodes lie: on the CPU emulation (100 bench inputs, budget 1023) the first bound's
  // median gap to the B-th best falls from 2.0 to 1.2 and the pool overflows 57 times instead
  // of 122. At the queue's budgets, the depth-3 cube (a, b, c), a, b < q, 1 <= c < q, (a, b)
  // != (0, 0) (kCubeSide): distinct from the rest (its third rank is >= 1, and (0, 0, c) is a
  // chain deviation), it brings in the wide shallow trees' nodes.
  const int g = C.g, h = C.h, E = C.E, next = C.next, nfam = C.nfam;
  blk.mark(20);
  if (nfam >= budget) {
    // The family's lowest score: the chain deviations' (fmin) or the grid's last corner.
    double flo = unordered(S.fmin);
    if (g > 1) {
      const double corner = (double)lp[g - 1] + (double)lp[(size_t)K + g - 1];
      flo = corner < flo ? corner : flo;
    }
    hist_clean = false;
    blk.mark(21);
    refine(blk, A, bd, flo, top, budget, cap / 2, lsb, [&](int t, auto f) {
      // Thread t takes elements j, j + T, ... of each part, j = (t - o) mod T where o is the
      // members before the part (C.oG, oE, oC): the family read as one list, each thread at
      // most ceil(nfam / T) members. Without o, at budget 63 and L 15, threads 0-89 took 4
      // and, with the cube, threads 0-44 took 5, while threads 224-255 took 1. H200,
      // bench.tree_ab, seeds 15 and 5: alone 0.995-1.006x at budgets 15-1023 (budget 15 bs 1
      // 1.01x); with a cube of side 5 bs 1 1.004-1.009x against 1.017-1.021x without o, bs
      // 64 1.004-1.008x against 1.010-1.013x. The chain deviations and the grid with their fast
      // index across the warp's lanes (the depth; r1), so that a warp's scores fall in
      // different bins (lanes adding to one bin serialise), each index stepped by T without a
      // division (the first index by div_by).
      {
        const int dT = C.dT, rT = C.rT, r0 = div_by(t, C.mL);
        for (int d = t - r0 * L, r = r0; r < kf;) {  // (0, ..., 0, r) at depth d + 1
          f(A.chain[d] + (double)lp[(size_t)d * K + r]);
          d += dT;
          r += rT;
          if (d >= L) { d -= L; ++r; }
        }
      }
      if (g > 1) {
        const int j0 = from_thread(t, C.oG, T);
        const int w = g - 1, aT = C.aT, bT = C.bT, b0 = div_by(j0, C.mw);
        for (int a = j0 - b0 * w, r2 = b0; r2 < g;) {  // (1 + a, r2)
          f((double)lp[1 + a] + (double)lp[(size_t)K + r2]);
          a += aT;
          r2 += bT;
          if (a >= w) { a -= w; ++r2; }
        }
      }
      KDT_NO_UNROLL
      for (int j = from_thread(t, C.oE, T); j < next * E; j += T) {  // few
        const int e = 1 + div_by(j, C.mnext), x = j - (e - 1) * next;
        const int r1 = 1 + div_by(x, C.mh), r2 = x - (r1 - 1) * h;
        f(((double)lp[r1] + (double)lp[(size_t)K + r2]) + (A.chain[2 + e] - A.chain[2]));
      }
      KDT_NO_UNROLL
      for (int j = from_thread(t, C.oC, T); j < C.ncube; j += T) {
        // (a, b, c): ab = q a + b >= 1, c >= 1
        const int ab = 1 + div_by(j, C.mq1), c3 = 1 + j - (ab - 1) * (C.q - 1);
        const int a = div_by(ab, C.mq), b = ab - a * C.q;
        f(((double)lp[a] + (double)lp[(size_t)K + b]) + (double)lp[(size_t)2 * K + c3]);
      }
    });
  }
  blk.mark(3);
  int c = 0, lb = 0, le = 1, kept = 0;
  // ---- 1'. the queue: every node at or above t, expanded as soon as it is written ----------
  // The first runs by the block (kChainRuns), then Block::expand: each entry's run length, its run
  // allocated at the end of the pool, its children written. The pool then holds exactly the nodes
  // at or above t (scores fall along a path), in an order that depends on the schedule; nothing
  // below depends on that order (a run stays contiguous).
  bool queued = false;
  if ((kPaths & kQueuePath) && bd.has && budget <= kQueueMaxBudget) {
    const Pool P = A.pool(0);
    const double tt = bd.t;
    // Entry i as a parent (its score, key and depth: read once for all its children), and child
    // r of entry i (p: parent(i)) into entry e, score and key; put returns its cand and score.
    // The root (entry 0, score 0, key 0, cand 0: depth 0) is a parent like any other. (put read
    // the parent's fields itself before, and live the child's score back from the pool: the
    // compiler cannot tell that a child's store leaves its parent's entry alone, so a lane that
    // wrote several children of one parent in a narrow batch reloaded them for each. H100 (the
    // H200's time kept for the suites), bench.tree_ab against that, kernel alone, bit-exact,
    // seeds 15 / 5 / 2: budget 63 0.979-0.988x at bs 1-256, bs 1024 0.991-0.992x, budgets 33
    // and 47 0.981-0.994x, 255 (no queue) 0.999-1.000x; the suites' draws of run
    // 20261205T164124Z at bs 64: 0.984x (kernels, 10.14 -> 9.98 us), 0.986x (tree_build, 10.82
    // -> 10.67 us).)
    auto parent = [&](int i) { return Parent{P.score[i], P.key[i], (int)cand_depth(P.cand[i])}; };
    auto put = [&](const Parent& p, int i, int e, int r) {
      const int d = p.depth + 1;
      const float* row = lp + (size_t)(d - 1) * K;
      const double sc = child_score(row, p.score, r, d);
      P.score[e] = sc;
      P.key[e] = child_key(A, p.key, r, d);
      return Child{pack((uint32_t)i, (uint32_t)r, (uint32_t)d), sc};
    };
    static_assert(kQueueMaxBudget <= 64, "the queue counts runs with count_at_least64");
    // The runs of the rank-0 chain's first kChainRuns nodes (the root's first), computed by
    // every thread alike and written in one phase, run d (of the chain node of depth d) after
    // run d - 1, whose first entry is that node. Each chain node's score is its parent's
    // child_score, as put gives it; its key is 0. The chain nodes of depth >= 1 whose runs are
    // written here are not expanded again (len gives them 0).
    double cs[kChainRuns] = {};  // every entry is set below (g++ cannot tell)
    int cc[kChainRuns], cp[kChainRuns + 1];
    cp[0] = 1;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int d = 0; d < kChainRuns; ++d) {
      cs[d] = d == 0 || d > L ? 0.0 : child_score(lp + (size_t)(d - 1) * K, cs[d - 1], 0, d);
      // Chain node d is at or above t (its parent's run holds it) when its score is: under the
      // exactness check that is rank 0 passing count_at_least64 in the run before, and the
      // counts do not wait on one another. (The test only spares a dead node's loads: a node
      // below t counts no children anyway, since none scores above it.)
      const bool live = d < L && (d == 0 ? top >= tt : cs[d] >= tt);
      cc[d] = blk.count_run(live, lp + (size_t)d * K, kc, cs[d], tt);
      cp[d + 1] = cp[d] + cc[d];
    }
    const int n0 = cp[kChainRuns];
    blk.run([&](int t) {
      KDT_NO_UNROLL
      for (int k = 1 + t; k < n0; k += T) {
        // k's run d, its first entry, its parent's entry and score (selects: the arrays stay
        // in registers)
        int d = 0, first = cp[0], parent = 0;
        double ps = cs[0];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
        for (int j = 1; j < kChainRuns; ++j) {
          if (k >= cp[j]) { d = j; first = cp[j]; parent = cp[j - 1]; ps = cs[j]; }
        }
        const int r = k - first;
        const float* row = lp + (size_t)d * K;
        P.score[k] = child_score(row, ps, r, d + 1);
        P.key[k] = child_key(A, 0ull, r, d + 1);
        P.cand[k] = pack((uint32_t)parent, (uint32_t)r, (uint32_t)(d + 1));
      }
      if (t == 0) S.work = (unsigned)n0;
      KDT_NO_UNROLL
      for (int i = t; i < kBins; i += T) A.hist[i] = 0;  // the order's, here without a barrier
    });
    hist_clean = true;
    blk.mark(6);
    // Entry i's children: the row they take their log-probs from and the least log-prob that
    // keeps a child at or above t (count_at_least64's u), or nullptr when i has none to expand;
    // its run's length is then count_ge64 (probe_len).
    auto probe = [&](int i, float* u) -> const float* {
      bool done = false;  // a chain node whose run is written
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int j = 0; j + 1 < kChainRuns; ++j) done |= i == cp[j] && cc[j] > 0;
      const int d = cand_depth(P.cand[i]);
      if (d >= L || (i < n0 && done)) return nullptr;
      *u = float_at_least(tt - P.score[i]);
      return lp + (size_t)d * K;
    };
    // Whether a child put wrote has a child to expand: its rank-0 child passes
    // count_ge64's test (rows do not rise, so a run is empty exactly when its rank 0 fails), and
    // it is not at the last depth. A warp whose batch writes no such child ends its queue there
    // instead of running one more batch whose runs all count empty (Block::expand). H100 (no
    // H200 came), bench.tree_ab against the loop without it, kernel alone, bit-exact: budget 63
    // 0.95-0.99x at bs 1-1024 (seeds 15 and 5; the requests of 20261205T040516Z's suite: bs 1
    // 0.973x, bs 64 0.987x), budgets 33 and 47 0.96-0.98x, 255 and 1023 1.00x. Listing the
    // live children as the next batch (a warp's list of up to 32) was mixed: bs 64, budget 63
    // 1.02x (seed 15) and 0.97x (seed 5); not kept.
    auto live = [&](const Child& ch) {
      const int d = cand_depth(ch.cand);
      return d < L && lp[(size_t)d * K] >= float_at_least(tt - ch.score);
    };
    const int n = blk.expand(&S.work, P.cand, A.cnt, n0, cap, kc, probe, parent, put, live);
    blk.mark(7);
    if (n >= 0) {
      le = n;
      queued = true;
    }
  }
  if (!(kPaths & kLevelPath) && !queued) return -1;
  // ---- 1, 2. level by level: the parents are the entries [lb, le) -------------------------
  // Stable compaction of the pool to the root and the entries >= t (parents remapped); the
  // entries [lb, le) stay the current level's.
  auto compact_pool = [&]() {
    const Pool P = A.pool(c);
    const bool all = !bd.has;
    const double tt = bd.t;
    blk.run([&](int t) {
      for (int e = t; e < le; e += T) A.cnt[e] = (e == 0 || all || P.score[e] >= tt);
    });
    const int kept_c = blk.scan(A.cnt, le);
    if (A.twin) {
      const Pool Q = A.pool(c ^ 1);
      blk.run([&](int t) {
        for (int e = t; e < le; e += T) {
          if (!(e == 0 || all || P.score[e] >= tt)) continue;
          const int ne = A.cnt[e];
          const uint32_t cd = P.cand[e];
          Q.score[ne] = P.score[e];
          Q.key[ne] = P.key[e];
          Q.cand[ne] = e == 0 ? 0u
                              : pack((uint32_t)A.cnt[cand_parent(cd)], cand_rank(cd),
                                     cand_depth(cd));
        }
      });
      c ^= 1;
    } else {
      // In place, nbuf entries a round: each round's kept entries go to the buffer, then
      // from it to their new indices. A new index is <= the old one and the new indices
      // rise with the old ones, so a round overwrites only entries of its own round (in the
      // buffer by then) or of earlier rounds (moved already).
      const Pool B = A.buffer();
      for (int r0 = 0; r0 < le; r0 += A.nbuf) {
        const int r1 = le < r0 + A.nbuf ? le : r0 + A.nbuf;
        blk.run([&](int t) {
          for (int e = r0 + t; e < r1; e += T) {
            const int i = e - r0;
            if (!(e == 0 || all || P.score[e] >= tt)) { A.buf_to[i] = -1; continue; }
            const uint32_t cd = P.cand[e];
            A.buf_to[i] = A.cnt[e];
            B.score[i] = P.score[e];
            B.key[i] = P.key[e];
            B.cand[i] = e == 0 ? 0u
                               : pack((uint32_t)A.cnt[cand_parent(cd)], cand_rank(cd),
                                      cand_depth(cd));
          }
        });
        blk.run([&](int t) {
          for (int i = t; i < r1 - r0; i += T) {
            const int ne = A.buf_to[i];
            if (ne < 0) continue;
            P.score[ne] = B.score[i];
            P.key[ne] = B.key[i];
            P.cand[ne] = B.cand[i];
          }
        });
      }
    }
    lb = A.cnt[lb];
    le = kept_c;
    blk.run([](int) {});  // every thread has read cnt
  };
  for (int d = 1; (kPaths & kLevelPath) && !queued && d <= L; ++d) {
    const float* row = lp + (size_t)(d - 1) * K;
    int end = le;
    int total = 0;
    for (int attempt = 0;; ++attempt) {
      const int m = le - lb;
      const Bound b = bd;
      const Pool P = A.pool(c);
      // Each kept parent's run length by a 4-ary search (A.order) and the runs' exclusive
      // offsets in parent order (A.cnt), so that the runs are contiguous in order.
      total = blk.offsets(m, A.cnt, A.order, [&](int q) {
        const double s = P.score[lb + q];
        return !b.has ? kc : (s + (double)row[0] >= b.t ? count_at_least(row, kc, s, b.t) : 0);
      });
      end = le + total;
      blk.mark(100 + d);
      if (end <= cap) break;
      if (attempt == 2) {
        blk.run([&](int t) { if (t == 0) S.flags |= kOverflow; });
        return -1;
      }
      bool compact = attempt > 0;
      if (attempt == 0) {
        // Raise t over the kept pool and the runs (scores below lo are not binned: lo is t, or
        // before t exists the lowest score of the pool and the runs' tails). The runs are
        // flattened: an element's run by a 4-ary search over the offsets (balanced, whatever the
        // run lengths).
        if (!bd.has && S.pmin == ~0ull) continue;
        blk.run([&](int t) {
          KDT_NO_UNROLL
          for (int i = t; i < kBins; i += T) A.hist[i] = 0;
          if (bd.has) return;
          unsigned long long lo = ~0ull;
          for (int q = t; q < m; q += T) {
            const int n = A.order[q];
            if (n) {
              const unsigned long long u = ordered(P.score[lb + q] + (double)row[n - 1]);
              lo = u < lo ? u : lo;
            }
          }
          if (lo != ~0ull) atomic_min_u64(&S.rmin, lo);
        });
        const double lo = bd.has ? bd.t : unordered(S.pmin < S.rmin ? S.pmin : S.rmin);
        hist_clean = false;
        const int got = refine(blk, A, bd, lo, top, budget, cap / 2, lsb, [&](int t, auto f) {
          for (int e = 1 + t; e < le; e += T) f(P.score[e]);
          for (int k = t; k < total; k += T) {
            const int x = run_of(A.cnt, m, k);
            f(P.score[lb + x] + (double)row[k - A.cnt[x]]);
          }
        });
        // got counts the pool's entries and the runs' elements at or above the new t, so the
        // runs recounted under it fit if le + got <= cap. Otherwise they may well not (the
        // stale entries below t still take pool room): compact now rather than recount twice.
        // (H200, bench inputs at budget 1023: a recount of a deep level costs ~9k cycles.)
        compact = got > 0 && le + got > cap;
      }
      if (compact) compact_pool();
    }
    if (end == le) break;  // no children: no deeper level either
    // Write the runs, flattened: element k of the level is rank k - offset of run q, the last
    // run whose offset is <= k (an empty run shares its offset with the next one).
    {
      const Pool P = A.pool(c);
      const int m = le - lb;
      blk.run([&](int t) {
        KDT_NO_UNROLL
        for (int i = t; i < kBins; i += T) A.hist[i] = 0;  // for a refinement next
        unsigned long long lo = ~0ull;
        for (int k = t; k < total; k += T) {
          const int q = run_of(A.cnt, m, k);
          const int p = lb + q, r = k - A.cnt[q];
          const double s = P.score[p];
          const double sc = child_score(row, s, r, d);
          const int e = le + k;
          P.score[e] = sc;
          P.cand[e] = pack((uint32_t)p, (uint32_t)r, (uint32_t)d);
          P.key[e] = child_key(A, P.key[p], r, d);
          const unsigned long long u = ordered(sc);
          lo = u < lo ? u : lo;
        }
        if (!bd.has && lo != ~0ull) atomic_min_u64(&S.pmin, lo);
      });
    }
    hist_clean = true;  // the write phase zeroed the refinements' bins
    blk.mark(200 + d);
    kept += end - le;
    lb = le;
    le = end;
    if (kept > budget + budget / 2 + 16) {
      const Pool P = A.pool(c);
      const double lo = bd.has ? bd.t : unordered(S.pmin);
      hist_clean = false;
      const int got = refine(blk, A, bd, lo, top, budget, cap / 2, lsb, [&](int t, auto f) {
        for (int e = 1 + t; e < le; e += T) f(P.score[e]);
      });
      if (got) kept = got;
      // Drop the entries the new bound leaves behind when they are many and the pool could
      // not take a next level as large as this one: else that level counts runs for dead
      // parents and overflows (bench inputs at budget 1023: by level 4 two thirds of a pool of
      // ~3000 entries are below t), paying a count, a refinement and a recount. H200,
      // bench.tree_ab: bs 64 budget 1023 0.95x, 767 0.91x, 127-511 and bs 1 0.99-1.01x (without
      // the second condition, budget 255 took 1.04x).
      if (got && le - got > cap / kCompactShare && 2 * le - lb > cap) compact_pool();
    }
    blk.mark(300 + d);
  }
  // ---- 3. the order, then the nodes (tree_build_parallel_order.h) ---------------------------
  return order_nodes(blk, S, A, N, c, le, bd, top, lsb, budget, hist_clean, C.mord);
}

}  // namespace par
}  // namespace tree
}  // namespace kdt
