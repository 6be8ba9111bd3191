// tree_build_parallel_state.h: the parallel tree build's state and primitives
// (tree_build_parallel.h has the build): order-preserving score images, shared-memory atomics,
// the CTA's shared scalars and pool arrays, the score bins, the counts along a row, the bound's
// refinement, and the exactness check.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kdtree/hd.h"
#include "tree_build_core.h"
#include "tree_build_parallel_plan.h"

namespace kdt {
namespace tree {
namespace par {

// Order-preserving map of a double to uint64 (a < b iff map(a) < map(b), -0.0 < +0.0).
KDT_HD uint64_t ordered(double x) {
  union { double d; uint64_t u; } v;
  v.d = x;
  return (v.u >> 63) ? ~v.u : (v.u | (1ull << 63));
}
KDT_HD double unordered(uint64_t u) {
  union { double d; uint64_t u; } v;
  v.u = (u >> 63) ? (u & ~(1ull << 63)) : ~u;
  return v.d;
}

// Shared-memory atomics; the CPU's plain updates give the same values (sums, minima and maxima
// do not depend on the order). atomic_min_int, atomic_max_int and atomic_or combine the warp's
// active lanes first (one atomic per warp).
KDT_HD void atomic_min_int(int* p, int v) {
#if defined(__CUDA_ARCH__)
  const unsigned m = __activemask();
  const int r = __reduce_min_sync(m, v);
  if ((int)(threadIdx.x & 31) == __ffs((int)m) - 1) atomicMin(p, r);
#else
  if (v < *p) *p = v;
#endif
}
KDT_HD void atomic_max_int(int* p, int v) {
#if defined(__CUDA_ARCH__)
  const unsigned m = __activemask();
  const int r = __reduce_max_sync(m, v);
  if ((int)(threadIdx.x & 31) == __ffs((int)m) - 1) atomicMax(p, r);
#else
  if (v > *p) *p = v;
#endif
}
// hist[bin] += 1, returning this lane's slot (the count before it). A plain shared atomic:
// aggregating a warp's equal bins first (match_any) measured slower on the H200 (the family's
// binning at budget 63: 7.8k cycles against 4.8k).
KDT_HD int hist_add(int* hist, int bin) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(&hist[bin], 1);
#else
  return hist[bin]++;
#endif
}
KDT_HD void atomic_or(int* p, int v) {
#if defined(__CUDA_ARCH__)
  const unsigned m = __activemask();
  const int r = (int)__reduce_or_sync(m, (unsigned)v);
  if ((int)(threadIdx.x & 31) == __ffs((int)m) - 1 && r) atomicOr(p, r);
#else
  *p |= v;
#endif
}
KDT_HD void atomic_min_u64(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__)
  atomicMin(p, v);
#else
  if (v < *p) *p = v;
#endif
}

enum : int { kAnomaly = 1, kInexact = 2, kOverflow = 4 };

// The CTA's shared scalars (written inside phases, by one thread or atomically; read after a
// barrier and never modified before the next barrier).
struct Shared {
  int flags;                // kAnomaly | kInexact | kOverflow
  int emin, emax;           // lowest set bit / top bit exponents of the log-probs
  unsigned long long fmin;  // ordered minimum of the first threshold's family
  unsigned long long pmin;  // ordered minimum of the pool's scores (before t exists)
  unsigned long long rmin;  // ordered minimum of a level's run tails (before t exists)
  unsigned work;            // the queue (Block::expand): entries allocated
};

// One copy of the pool (compaction writes the other one).
struct Pool {
  double* score;
  uint32_t* cand;  // tree::pack(pool parent, rank, depth); the root: 0
  uint64_t* key;   // rank-path prefix keys (tree::Scratch's layout)
};

// A pool entry as the queue's parent (Block::expand reads it once for all the children it
// writes), and a child as put wrote it.
struct Parent {
  double score;
  uint64_t key;
  int depth;
};
struct Child {
  uint32_t cand;
  double score;
};

// The CTA's arrays in shared memory (the pointers themselves are per thread: registers; no
// pointer array is indexed at run time, which would put them in local memory).
struct Arrays {
  Pool p0, p1;        // p1: the second copy, when twin
  bool twin;          // false: one copy (a device whose shared memory fits no second one)
  Pool buf;           // one copy only: [nbuf] entries of a compaction round
  int* buf_to;        // [nbuf] an entry's new index (-1: dropped)
  int nbuf;
  KDT_HD Pool pool(int c) const {
    Pool p = c ? p1 : p0;
#if defined(__CUDA_ARCH__)
    __builtin_assume(__isShared(p.score));
    __builtin_assume(__isShared(p.cand));
    __builtin_assume(__isShared(p.key));
#endif
    return p;
  }
  KDT_HD Pool buffer() const {
    Pool p = buf;
#if defined(__CUDA_ARCH__)
    __builtin_assume(__isShared(p.score));
    __builtin_assume(__isShared(p.cand));
    __builtin_assume(__isShared(p.key));
    __builtin_assume(__isShared(buf_to));
#endif
    return p;
  }
  int* cnt;           // [cap] compaction positions; per kept entry its bucket << 16 | slot
  uint16_t* srt;      // [cap] kept entries, bucket by bucket
  uint16_t* order;    // [cap] the entry of node r + 1
  int16_t* inv;       // [cap] node index of a pool entry (0: not selected)
  int* hist;          // [nord]
  double* chain;      // [L + 1] prefix sums of the rows' first log-probs
  int key_bits, key_depth;
  int nord;           // order_bins(cap)
};

// Before each request: the scalars' starting values.
KDT_HD void init(Shared& S) {
  S.flags = 0;
  S.emin = 1 << 30;
  S.emax = -(1 << 30);
  S.fmin = ~0ull;
  S.pmin = ~0ull;
  S.rmin = ~0ull;
  S.work = 0;
}

// Result arrays (node order), shared with the serial fallback.
struct Nodes {
  double* score;
  uint32_t* cand;  // tree::pack(node parent, rank, depth)
  int16_t* first_child;
  int16_t* next_sibling;
};

KDT_HD uint64_t child_key(const Arrays& A, uint64_t parent_key, int rank, int depth) {
  return depth <= A.key_depth ? parent_key | ((uint64_t)rank << (64 - A.key_bits * depth))
                              : parent_key;
}

// Pool entry a precedes b: score descending, then rank path ascending.
KDT_HD bool before(const Pool& P, int key_depth, int a, int b) {
  const double sa = P.score[a], sb = P.score[b];
  if (sa != sb) return sa > sb;
  const uint64_t ka = P.key[a], kb = P.key[b];
  if (ka != kb) return ka < kb;
  const uint32_t ca = P.cand[a], cb = P.cand[b];
  const int da = cand_depth(ca), db = cand_depth(cb);
  if (da <= key_depth && db <= key_depth) return da < db;
  return compare_paths(ca, cb, P.cand) < 0;
}

// Histogram bins of width w = 2^k hung from hi, numbered upward: bin b holds the scores s with
// edge(b) < s <= edge(b + 1), edge(b) = hi - (nb - b) w. Every score and every edge is a multiple
// of 2^g (g: the log-probs' lowest set bit; k >= g) and lies in [-(L + 1) max|lp|, 0], where the
// exactness check makes float64 exact: hi - s, its scaling by 2^-k and hi - (nb - b) w are exact,
// so a score's bin is one subtraction, one multiplication and a truncation, and the edge a
// threshold takes is exactly the one the binning used. (Linear bins over [lo, hi] took a float64
// division per pass and, per score, a multiply-add and correction loops.) H200, bench.tree_ab
// against linear bins, kernel alone: bs 64 budget 63 0.95x, 127 0.94x, 255 0.92x, 1023 0.99x;
// bs 1 budget 63 0.96x, 255 0.92x, 1023 0.97-0.98x (two runs).
struct Bins {
  double hi, w, iw;  // iw = 2^-k
  int nb;
  KDT_HD double edge(int b) const { return hi - (double)(nb - b) * w; }
  // The bin of s, lo <= s <= hi (make_bins' lo).
  KDT_HD int of(double s) const {
    const int j = (int)((hi - s) * iw);  // hi - s >= 0: truncation is the floor
    return j < nb ? nb - 1 - j : 0;
  }
};
// Bins for the scores in [lo, hi]: nb = 2^m of them (m >= 0) at the smallest width 2^k >= 2^g
// with nb 2^k > hi - lo (so that lo falls in bin 0; fewer bins hold scores when 2^g decides).
// False when hi <= lo.
KDT_HD bool make_bins(double lo, double hi, int m, int g, Bins& B) {
  const double x = hi - lo;
  if (!(x > 0.0)) return false;
  union { double d; uint64_t u; } v;
  v.d = x;
  const int e = (int)((v.u >> 52) & 0x7FFu) - 1022;  // 2^(e - 1) <= x < 2^e (x is normal)
  const int k = e - m > g ? e - m : g;
  v.u = (uint64_t)(1023 + k) << 52;
  B.w = v.d;
  v.u = (uint64_t)(1023 - k) << 52;
  B.iw = v.d;
  B.hi = hi;
  B.nb = 1 << m;
  return true;
}

// Lowest-set-bit and top-bit exponents of a finite nonzero float: |x| = m 2^lsb with m odd,
// |x| < 2^top.
KDT_HD void float_exponents(float x, int& lsb, int& top) {
  union { float f; uint32_t u; } v;
  v.f = x;
  const uint32_t E = (v.u >> 23) & 0xFFu, mant = v.u & 0x7FFFFFu;
  const uint32_t m = E ? (mant | 0x800000u) : mant;
#if defined(__CUDA_ARCH__)
  const int tz = __ffs((int)m) - 1;
#else
  const int tz = __builtin_ctz(m);
#endif
  lsb = (E ? (int)E - 150 : -149) + tz;
  top = E ? (int)E - 126 : -126;
}

// The largest i in [lo, hi) with pass(i), given pass(lo) and that the passing indices are a
// prefix of [lo, hi). A 4-ary search: three independent probes a step, so that the chain of
// dependent loads is about half a binary search's (3 steps instead of 6 over 64 entries).
template <class Pass>
KDT_HD int last_pass(int lo, int hi, Pass pass) {
  while (hi - lo > 1) {
    const int q = hi - lo, a = q >> 2 ? q >> 2 : 1;
    const int m1 = lo + a, m2 = lo + (q >> 1), m3 = hi - a;  // lo < m1 <= m2 <= m3 < hi
    const bool p1 = pass(m1), p2 = pass(m2), p3 = pass(m3);
    if (p3) {
      lo = m3;
    } else if (p2) {
      lo = m2;
      hi = m3;
    } else if (p1) {
      lo = m1;
      hi = m2;
    } else {
      hi = m1;
    }
  }
  return lo;
}

// The smallest float >= d (-FLT_MAX for every d below it).
KDT_HD float float_at_least(double d) {
#if defined(__CUDA_ARCH__)
  const float f = __double2float_ru(d);
  return f < -FLT_MAX ? -FLT_MAX : f;
#else
  float f = (float)d;
  if ((double)f < d) f = nextafterf(f, FLT_MAX);
  return f < -FLT_MAX ? -FLT_MAX : f;
#endif
}

// Ranks r < kc of row `row` with s + row[r] >= t, given s + row[0] >= t (rows non-increasing).
// Under the exactness check s + row[r] is exact, and so is t - s (t <= t - s <= row[0] <= 0), so
// the test is row[r] >= t - s, i.e. row[r] >= the smallest float at or above it: the search
// compares floats, with no conversion and no float64 add on its chain. H200, kernel alone,
// each against the same base in one bench.tree_ab run: 0.99x the float64 test at bs 1, 4 and
// 64, budgets 63 to 1023.
KDT_HD int count_at_least(const float* row, int kc, double s, double t) {
  const float u = float_at_least(t - s);
  return last_pass(0, kc, [&](int r) { return row[r] >= u; }) + 1;
}

// count_at_least for kc <= 64 (the queue's budgets) with no data-dependent branch, given
// u = float_at_least(t - s): the last rank of each group of eight first (eight independent
// loads: the groups that pass whole are a prefix, since the row does not rise), then the ranks
// of the first group that does not (eight more). Two rounds of loads against the 4-ary search's
// three, each behind a branch. Ranks >= kc never count (their loads are clamped to kc - 1).
// (The queue's rows padded instead, a copy staged beside the log-probs: ranks 0..63 with -inf
// from kc on, then each row's eight group ends, so that a count was four aligned 16-byte loads
// and no clamps: the first batch's run lengths at bs 64, budget 63 took ~1.0k cycles against
// ~1.2k, but the copy cost the staging more; H200, bench.tree_ab, kernel alone, seeds 15 and 5:
// budget 63 1.01-1.05x at bs 1-1024, budgets 33 and 47 1.00-1.05x. Not kept.)
KDT_HD int count_ge64(const float* row, int kc, float u) {
  const int last = kc - 1;
  int g = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 8; ++j) {
    const int r = 8 * j + 7;
    g += r < kc && row[r < last ? r : last] >= u;
  }
  int c = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int k = 0; k < 8; ++k) {
    const int r = 8 * g + k;
    c += r < kc && row[r < last ? r : last] >= u;
  }
  return 8 * g + c;
}
KDT_HD int count_at_least64(const float* row, int kc, double s, double t) {
  return count_ge64(row, kc, float_at_least(t - s));
}
// The queue's run length of entry i from its probe (build, section 1'; 0 when nothing to expand).
template <class Probe>
KDT_HD int probe_len(Probe& probe, int i, int kc) {
  float u = 0.0f;
  const float* row = probe(i, &u);
  return row ? count_ge64(row, kc, u) : 0;
}

// The run of flattened element k: the last q < m with off[q] <= k (off: exclusive offsets of
// the runs, off[0] = 0 <= k < total). An empty run shares its offset with the next, so q's run
// holds k.
KDT_HD int run_of(const int* off, int m, int k) {
  return last_pass(0, m, [&](int q) { return off[q] <= k; });
}

// A score that sums to zero (every log-prob on its path is +-0.0) with the sign the reference's
// chain gives it: depth 1 rank 0 is lp itself, a rank-0 child parent + lp, a sibling
// (left - lp[r - 1]) + lp[r]. Only zeros are involved, so the replay is exact and short.
KDT_HD double zero_score(const float* row, double parent, int r, int d) {
  double z = d == 1 ? (double)row[0] : parent + (double)row[0];
  for (int i = 1; i <= r; ++i) z = (z - (double)row[i - 1]) + (double)row[i];
  return z;
}

// The threshold t (uniform: every thread holds it) and whether it exists yet.
struct Bound {
  double t;
  bool has;
};

// Bins the scores in [lo, hi] that visit(t, f) passes to f (hist must be zero), then raises the
// bound to the lower edge of the highest bin j whose suffix (bins >= j) holds >= need of them: a
// valid lower bound on the need-th best. When that suffix still holds more than `limit` scores
// (the bins are linear, and scores may crowd into one bin), up to two more passes bin bin j
// alone, (edge(j), edge(j + 1)], with need less the scores above it (a radix select). Returns
// the suffix count of the final edge (0: no change). hist is left dirty. g: the log-probs'
// lowest set bit (make_bins).
template <class Block, class Visit>
KDT_HD int refine(Block& blk, const Arrays& A, Bound& bd, double lo, double hi, int need,
                  int limit, int g, Visit visit) {
  int above = 0, got = 0;
  bool lo_in = true;  // lo itself is in range (pass 0)
  double nt = 0.0;
  for (int pass = 0; pass < 3; ++pass) {
    Bins bins;
    if (!make_bins(lo, hi, kBinsLog2, g, bins)) break;
    if (pass > 0) {
      blk.run([&](int t) {
        KDT_NO_UNROLL
        for (int i = t; i < kBins; i += blk.threads()) A.hist[i] = 0;
      });
    }
    const bool in = lo_in;
    blk.mark(4);
    blk.run([&](int t) {
      visit(t, [&](double s) {
        if (s <= hi && (s > lo || (in && s == lo))) hist_add(A.hist, bins.of(s));
      });
    });
    blk.mark(5);
    int c = 0;
    const int j = blk.suffix_pick(A.hist, kBins, need, &c);
    if (j < 0) break;
    nt = bins.edge(j);
    got = above + c;
    if (got <= limit) break;
    const int in_j = A.hist[j];
    blk.run([](int) {});  // every thread has read hist[j] before the next pass clears it
    above += c - in_j;
    need -= c - in_j;
    lo_in = false;
    lo = nt;
    hi = bins.edge(j + 1);
  }
  if (got && (!bd.has || nt > bd.t)) { bd.t = nt; bd.has = true; }
  return got;
}

// The score of child r (depth d) of a pool entry of score s: s + row[r], with the sign the
// reference's chain gives a zero (zero_score).
KDT_HD double child_score(const float* row, double s, int r, int d) {
  const double sc = s + (double)row[r];
  return sc == 0.0 ? zero_score(row, s, r, d) : sc;
}

// The queue: up to kQueueMaxBudget (above), the build expands the nodes at or above the first bound
// through a queue (Block::expand) instead of level by level. On the GPU each warp expands a share
// of the first runs (of the rank-0 chain's first kChainRuns nodes) and then the children it wrote
// itself, a batch at a time: the batch's run lengths, one shared atomic to place all its runs,
// its children written a lane each. No barrier and no hand-over between warps, so no level waits
// for the block's slowest parent or for a count, scan and write (~2.6k cycles a level). The
// first bound leaves few
// nodes above it at small budgets (bench inputs, 64 requests: 79 at budget 63, at most 162) and
// more at larger ones (428 at 255, at most 1460; 3675 at 1023), where the levels' refinements keep
// the pool and the order's buckets small. H200, bench.tree_ab against the levels (with the
// block-wide queue below), kernel alone: budget 63 0.96x at bs 64, 0.93x at bs 16, 0.89x at bs 4,
// 0.92x at bs 1; budget 127 1.06x at bs 64 (0.95x at bs 1); budget 255 1.15x. Measured again with
// today's warp-local batches, the queue up to budget 255 (runs longer than 64 counted by
// count_at_least): budget 127 0.98-1.01x at bs 1, 1.04x at bs 4, 1.48x at bs 64; budget 255
// 1.15-1.92x at bs 1, 1.36-2.12x at bs 4-256; up to 511, budget 511 1.8-2.7x. So the levels stay
// above 63, at bs 1 too. A queue that would overflow the pool stops, and the levels run. The
// warp-local batches replaced a block-wide queue in which any warp took any entry once its ready
// flag was set (about 1.3k
// cycles a level: ~200 to see the entry, ~200 for its run length, ~400 to allocate, ~550 to
// write a child, behind a fence): H200, bench.tree_ab against it, budget 63 0.94x at bs 64,
// 0.96x at bs 1024, 0.99-1.00x at bs 1, 4 and 256, 1.02x at bs 16; budget 47 0.98-0.99x.
// Expanding whole rank-0 chains at once (an entry's chain nodes scored from the chain's prefix
// sums, their runs placed together; the root's chain by the block) cut the batches on paper but
// cost 2.5-3.0k cycles a batch before its allocation: with the order above, 1.81x at bs 64, budget
// 63 (8f7e796, reverted). Measured again with the first runs (each entry of rank >= 1 and the first
// runs' tail a head, a rank-0 entry never expanded; bench inputs at budget 63: at most 3 batches a
// path against 7 levels), bit-exact (the CUDA tree tests passed), H200, bench.tree_ab, budget 63,
// two draws: each child finding its unit by walking its head's chain, bs 64 1.42-1.59x, bs 1
// 1.13-1.17x, bs 4-1024 1.28-1.50x; the units flattened a lane each (a second counting pass past 32
// units), bs 64 1.87-2.08x, bs 1 1.18-1.21x; budgets 33 and 47 1.04-1.40x. A third time on today's
// queue (each batch of up to 32 entries expanding each entry's spine, a spine node a lane, up to 32
// of them, else the batch's entries alone; the CPU emulation the same; bit-exact, 208 CUDA tree
// tests passed): a replay of the suites' draws of run 20261205T164124Z put the deepest warp's
// batches at 1.7 on average and at most 3, against 2.7 and 5, but H100, bench.tree_ab against
// main's kernel, seed 15: budget 63 1.10-1.16x at bs 1-1024, 33 and 47 1.05-1.17x, 255 (no queue:
// the code alone) 1.045x; the run's draws at bs 64 1.36x and 1.45x. The slowest warp still expands
// the same nodes, each at a higher cost: the queue is bound by a warp's serial work, not by its
// depth. The root's chain alone, by the block before the queue (each chain node's run at or above
// t, placed by blk.offsets, written in one phase; the chain nodes then not expanded again): the
// median block ran 3 batches instead of 5, but the phase took 3.3k cycles against the root's run's
// 1.0k. H200, bench.tree_ab, budget 63, three draws: bs 64 0.90x, 0.94x and 1.00x; bs 256
// 0.87-0.92x; bs 4 0.89-1.08x; bs 1 1.01-1.09x; budget 32 at bs 64 1.08x. Counting the runs in
// every warp's lanes instead (no barrier before the writes) took 2.7k cycles and made every later
// batch slower (its run lengths 620 -> 1370 cycles), 1.03-1.26x. Neither kept. The first two runs
// of that chain instead (kChainRuns), counted by every thread alike and written in the root's
// phase, with no phase of their own: kept.

// The exactness check's verdict over some log-probs: kAnomaly | kInexact, and the lowest set
// bit and the top bit exponents of the nonzero ones (1 << 30 and -(1 << 30) when there are none).
struct Checked {
  int flags = 0, emin = 1 << 30, emax = -(1 << 30);
  // One log-prob x; next: the next one in its row, when has_next (the row must not rise).
  KDT_HD void add(float x, bool has_next, float next) {
    union { float f; uint32_t u; } v;
    v.f = x;
    if (((v.u >> 23) & 0xFFu) == 0xFFu) { flags |= kInexact; return; }
    if (x > 0.0f) flags |= kAnomaly;
    if (has_next && !(next <= x)) flags |= kAnomaly;
    if (x != 0.0f) {
      int lsb, top;
      float_exponents(x, lsb, top);
      if (lsb < emin) emin = lsb;
      if (top > emax) emax = top;
    }
  }
  KDT_HD void merge(const Checked& o) {
    flags |= o.flags;
    emin = o.emin < emin ? o.emin : emin;
    emax = o.emax > emax ? o.emax : emax;
  }
};

// Thread t of T's share of the entries every build starts from: the pool's root entry, and hist
// zeroed (all nord buckets: the refinements use the first kBins, the order all of them).
KDT_HD void first_entries(const Arrays& A, int t, int T) {
  if (t == 0) { A.p0.score[0] = 0.0; A.p0.cand[0] = 0; A.p0.key[0] = 0; }
  KDT_NO_UNROLL
  for (int i = t; i < A.nord; i += T) A.hist[i] = 0;
}
// The first phase's work for thread t of T, when the caller has not done it (build's pre): its
// first entries, and the exactness check of the log-probs t, t + T, ... into S.flags, S.emin
// and S.emax (build reads the verdict after the phase's barrier).
KDT_HD void check_phase(Shared& S, const Arrays& A, const float* lp, int L, int K, int t, int T) {
  first_entries(A, t, T);
  Checked ck;
  const int step = T % K;
  int col = t % K;  // i's column, advanced without a division per element
  for (int i = t; i < L * K; i += T) {  // one flat loop: few iterations per thread
    const bool has_next = col + 1 < K;
    ck.add(lp[i], has_next, has_next ? lp[i + 1] : 0.0f);
    col += step;
    if (col >= K) col -= K;
  }
  if (ck.flags) atomic_or(&S.flags, ck.flags);
  if (ck.emin < (1 << 30)) atomic_min_int(&S.emin, ck.emin);
  if (ck.emax > -(1 << 30)) atomic_max_int(&S.emax, ck.emax);
}

}  // namespace par
}  // namespace tree
}  // namespace kdt
