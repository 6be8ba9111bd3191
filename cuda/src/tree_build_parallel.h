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
// is exact), so a node scores s(parent) + lp[d][r], computed directly, bit for bit; no node
// scores above its generator (a zero score takes the sign the chain gives it: zero_score); and
// the heap pops exactly the B best nodes of the implicit tree
// in (score desc, rank path asc) order. Inputs that fail the check (mixed magnitudes, positive
// log-probs, unsorted rows) are declined and the caller runs the serial build: the result is the
// reference's in every case.
//
// The build (a pool of candidates in shared memory; t: a lower bound on the B-th best score):
//   0. t from a family of known nodes: the rank-0 chain with one deviation at its end,
//      (0, ..., 0, r), whose scores are prefix sums; its B-th best is <= the tree's B-th best.
//   1. Level by level, each kept node of the previous level gets a run of children, ranks
//      0..c-1 with s(parent) + lp[d][r] >= t (c by binary search: scores fall along a row); runs
//      are laid out by a block scan and written one entry per thread.
//   2. t rises with a score histogram whenever the pool keeps many more than B nodes: if the
//      bins at or above bin j hold >= B nodes, the B-th best is >= bin j's lower edge. A level
//      whose runs would overflow the pool raises t over the pool and the runs first, then
//      compacts the pool (stable; dropped nodes are below t, and so are their subtrees).
//   3. The kept nodes are ordered by (score desc, rank path asc): rank counting up to 2 T of
//      them, a bitonic sort above; the first B are nodes 1..B. Parents, child lists (prepend rule)
//      follow from the order: a run is contiguous, so a node's left sibling is the entry before.
// Masses of exact ties that overflow the pool even so are declined as well.
//
// The Block (tree_build.cu's GpuBlock, tree_build_cpu.cpp's CpuBlock) runs each phase for every
// thread then synchronises (run), and provides two collectives: an exclusive scan and a suffix
// pick over a histogram. Code outside run() is uniform: it runs once on the CPU and on every
// thread on the GPU, and writes no shared state.
#pragma once

#include <stdint.h>

#include "kdtree/hd.h"
#include "tree_build_core.h"

namespace kdt {
namespace tree {
namespace par {

constexpr int kBins = 256;      // histogram bins of the threshold refinement
constexpr int kMaxPool = 2048;  // pool capacity bound

// Pool capacity for a budget: a power of two >= 4 (budget + 1), at least 256, at most kMaxPool.
KDT_HD int pool_capacity(int budget) {
  int c = 256;
  while (c < 4 * (budget + 1) && c < kMaxPool) c *= 2;
  return c;
}

// Threads per CTA for a budget (the CUDA launch and the CPU emulation's default).
KDT_HD int threads_for(int budget) { return budget < 128 ? 128 : (budget < 512 ? 256 : 512); }

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

// Shared-memory atomics (aggregated over the warp on CUDA); the CPU's plain updates give the
// same values (sums, minima and maxima do not depend on the order).
KDT_HD int atomic_add(int* p, int v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, v);
#else
  const int old = *p;
  *p += v;
  return old;
#endif
}
KDT_HD void atomic_min_int(int* p, int v) {
#if defined(__CUDA_ARCH__)
  atomicMin(p, v);
#else
  if (v < *p) *p = v;
#endif
}
KDT_HD void atomic_max_int(int* p, int v) {
#if defined(__CUDA_ARCH__)
  atomicMax(p, v);
#else
  if (v > *p) *p = v;
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

// Shared state of one CTA. Pool arrays have `cap` entries, two copies (compaction writes the
// other one); entry 0 is the root.
struct Shared {
  double* score[2];
  uint32_t* cand[2];  // tree::pack(pool parent, rank, depth); the root: 0
  uint64_t* key[2];   // rank-path prefix keys (tree::Scratch's layout)
  int* cnt;           // [cap] run lengths, then their offsets (scan); compaction positions
  uint16_t* idx;      // [cap] kept entries, then (sorted) the node order
  int16_t* inv;       // [cap] node index of a pool entry (0: not selected)
  int* hist;          // [kBins]
  double* chain;      // [L + 1] prefix sums of the rows' first log-probs
  // scalars (written by one thread inside a phase)
  int cur, pool_n, lvl_b, flags, kept;
  int emin, emax;               // lowest set bit / top bit exponents of the log-probs
  unsigned long long fmin;      // ordered minimum of the first threshold's family
  unsigned long long pmin;      // ordered minimum of the pool's scores (before t exists)
  unsigned long long rmin;      // ordered minimum of a level's run tails
  double t;                     // the lower bound on the B-th best score
  int has_t;
  int key_bits, key_depth;
};

// Result arrays (node order), shared with the serial fallback.
struct Nodes {
  double* score;
  uint32_t* cand;  // tree::pack(node parent, rank, depth)
  int16_t* first_child;
  int16_t* next_sibling;
};

KDT_HD uint64_t child_key(const Shared& S, uint64_t parent_key, int rank, int depth) {
  return depth <= S.key_depth ? parent_key | ((uint64_t)rank << (64 - S.key_bits * depth))
                              : parent_key;
}

// Pool entry a precedes b: score descending, then rank path ascending.
KDT_HD bool before(const Shared& S, int a, int b) {
  const int c = S.cur;
  const double sa = S.score[c][a], sb = S.score[c][b];
  if (sa != sb) return sa > sb;
  const uint64_t ka = S.key[c][a], kb = S.key[c][b];
  if (ka != kb) return ka < kb;
  const uint32_t ca = S.cand[c][a], cb = S.cand[c][b];
  const int da = cand_depth(ca), db = cand_depth(cb);
  if (da <= S.key_depth && db <= S.key_depth) return da < db;
  return compare_paths(ca, cb, S.cand[c]) < 0;
}

// Histogram bin edges lo + w * b in float64, never contracted into an fma, so that the edge a
// threshold takes is the edge the binning used.
KDT_HD double edge(double lo, double w, int b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(lo, __dmul_rn(w, (double)b));
#else
  volatile double m = w * (double)b;
  return lo + m;
#endif
}
// The bin of s >= lo: the largest b < kBins with edge(b) <= s.
KDT_HD int bin_of(double s, double lo, double w) {
  const double f = (s - lo) / w;
  int b = f >= (double)(kBins - 1) ? kBins - 1 : (f > 0.0 ? (int)f : 0);
  while (b > 0 && s < edge(lo, w, b)) --b;
  while (b + 1 < kBins && s >= edge(lo, w, b + 1)) ++b;
  return b;
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

// Ranks r < kc of row `row` with s + row[r] >= t, given s + row[0] >= t (rows non-increasing).
KDT_HD int count_at_least(const float* row, int kc, double s, double t) {
  int lo = 0, hi = kc;  // row[lo] passes, row[hi] fails (hi == kc: past the end)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (s + (double)row[mid] >= t) lo = mid; else hi = mid;
  }
  return lo + 1;
}

// A score that sums to zero (every log-prob on its path is +-0.0) with the sign the reference's
// chain gives it: depth 1 rank 0 is lp itself, a rank-0 child parent + lp, a sibling
// (left - lp[r - 1]) + lp[r]. Only zeros are involved, so the replay is exact and short.
KDT_HD double zero_score(const float* row, double parent, int r, int d) {
  double z = d == 1 ? (double)row[0] : parent + (double)row[0];
  for (int i = 1; i <= r; ++i) z = (z - (double)row[i - 1]) + (double)row[i];
  return z;
}

// Raises S.t to the lower edge of the highest bin j whose suffix (bins >= j) holds >= need of the
// scores that visit(t, f) passes to f, over [lo, hi]: a valid lower bound on the need-th best
// of them. Returns that suffix count (0: t unchanged).
template <class Block, class Visit>
KDT_HD int refine(Block& blk, Shared& S, double lo, double hi, int need, Visit visit) {
  if (!(hi > lo)) return 0;
  const double w = (hi - lo) / kBins;
  if (!(w > 0.0)) return 0;
  blk.run([&](int t) {
    for (int b = t; b < kBins; b += blk.threads()) S.hist[b] = 0;
  });
  blk.run([&](int t) { visit(t, [&](double s) { atomic_add(&S.hist[bin_of(s, lo, w)], 1); }); });
  int got = 0;
  const int j = blk.suffix_pick(S.hist, kBins, need, &got);
  if (j < 0) return 0;
  const double nt = edge(lo, w, j);
  blk.run([&](int t) {
    if (t == 0 && (!S.has_t || nt > S.t)) { S.t = nt; S.has_t = 1; }
  });
  return got;
}

// Stable compaction of the pool to the root and the entries >= t (parents remapped); the level
// [lvl_b, pool_n) stays the last range.
template <class Block>
KDT_HD void compact(Block& blk, Shared& S) {
  const int n = S.pool_n, c = S.cur;
  const bool all = !S.has_t;
  blk.run([&](int t) {
    for (int e = t; e < n; e += blk.threads()) S.cnt[e] = (e == 0 || all || S.score[c][e] >= S.t);
  });
  const int total = blk.scan(S.cnt, n);
  blk.run([&](int t) {
    for (int e = t; e < n; e += blk.threads()) {
      if (!(e == 0 || all || S.score[c][e] >= S.t)) continue;
      const int ne = S.cnt[e];
      const uint32_t cd = S.cand[c][e];
      S.score[c ^ 1][ne] = S.score[c][e];
      S.key[c ^ 1][ne] = S.key[c][e];
      S.cand[c ^ 1][ne] = e == 0 ? 0u : pack(S.cnt[cand_parent(cd)], cand_rank(cd), cand_depth(cd));
    }
  });
  blk.run([&](int t) {
    if (t != 0) return;
    S.lvl_b = S.lvl_b < n ? S.cnt[S.lvl_b] : total;
    S.pool_n = total;
    S.cur = c ^ 1;
  });
}

// Builds one request into N (node order; slot 0 the root); returns the slots used (root
// included), or -1 when it declines the request (S.flags says why): the caller then runs the
// serial build. lp is [L, K] (rows sorted descending).
template <class Block>
KDT_HD int build(Block& blk, Shared& S, const Nodes& N, const float* lp, int L, int K, int budget,
                 int cap) {
  const int T = blk.threads();
  const int kc = K < budget ? K : budget;  // ranks >= budget are never selected
  const int lk = L * K;
  // ---- 0. the exactness check, the chain sums, the first threshold ------------------------
  blk.run([&](int t) {
    if (t != 0) return;
    S.cur = 0; S.flags = 0; S.has_t = 0; S.t = 0.0;
    S.emin = 1 << 30; S.emax = -(1 << 30);
    S.score[0][0] = 0.0; S.cand[0][0] = 0; S.key[0][0] = 0;
    S.pool_n = 1; S.lvl_b = 0; S.kept = 0;
    S.pmin = ~0ull;
  });
  blk.run([&](int t) {
    int emin = 1 << 30, emax = -(1 << 30), bad = 0;
    for (int i = t; i < lk; i += T) {
      const float x = lp[i];
      union { float f; uint32_t u; } v;
      v.f = x;
      if (((v.u >> 23) & 0xFFu) == 0xFFu) { bad |= kInexact; continue; }
      if (x > 0.0f) bad |= kAnomaly;
      if ((i % K) + 1 < K && !(lp[i + 1] <= x)) bad |= kAnomaly;
      if (x != 0.0f) {
        int lsb, top;
        float_exponents(x, lsb, top);
        if (lsb < emin) emin = lsb;
        if (top > emax) emax = top;
      }
    }
    if (bad) atomic_max_int(&S.flags, bad);  // (flags only grow; max of or-able bits is enough)
    if (emin < (1 << 30)) atomic_min_int(&S.emin, emin);
    if (emax > -(1 << 30)) atomic_max_int(&S.emax, emax);
  });
  blk.run([&](int t) {
    if (t != 0) return;
    int lg = 0;
    while ((1 << lg) < L + 2) ++lg;
    if (S.emin < (1 << 30) && S.emax + lg > S.emin + 53) S.flags |= kInexact;
    double c = 0.0;
    S.chain[0] = 0.0;
    unsigned long long lo = ~0ull;
    for (int d = 0; d < L; ++d) {
      const uint64_t u = ordered(c + (double)lp[(size_t)d * K + kc - 1]);
      if (u < lo) lo = u;
      c += (double)lp[(size_t)d * K];
      S.chain[d + 1] = c;
    }
    S.fmin = lo;
  });
  if (S.flags) return -1;
  const double top = (double)lp[0];  // the best score of all: depth 1, rank 0
  if ((long long)L * kc >= budget) {
    refine(blk, S, unordered(S.fmin), top, budget, [&](int t, auto f) {
      for (int i = t; i < L * kc; i += T) {
        const int d = i / kc, r = i - d * kc;
        f(S.chain[d] + (double)lp[(size_t)d * K + r]);
      }
    });
  }
  // ---- 1, 2. level by level -----------------------------------------------------------------
  int kept = 0;  // pool entries >= t but the root (an upper bound between refinements)
  for (int d = 1; d <= L; ++d) {
    const float* row = lp + (size_t)(d - 1) * K;
    int total = 0, m = 0;
    for (int attempt = 0;; ++attempt) {
      const int lb = S.lvl_b;
      m = S.pool_n - lb;
      const int c = S.cur;
      blk.run([&](int t) {
        if (t == 0) S.rmin = ~0ull;
        for (int q = t; q < m; q += T) {
          const double s = S.score[c][lb + q];
          int n = 0;
          if (!S.has_t) n = kc;
          else if (s + (double)row[0] >= S.t) n = count_at_least(row, kc, s, S.t);
          S.cnt[q] = n;
        }
      });
      total = blk.scan(S.cnt, m);
      if (S.pool_n + total <= cap || attempt == 2) break;
      if (attempt == 0) {
        // Raise t over the kept pool and the runs (their scores: parent + row[r]).
        // lo: t, or before t exists the lowest score of the pool and the runs. Scores below lo
        // are not binned, so every binned score is >= lo whatever lo is.
        if (!S.has_t) {
          blk.run([&](int t) {
            for (int q = t; q < m; q += T) {
              const int n = (q + 1 < m ? S.cnt[q + 1] : total) - S.cnt[q];
              if (n) atomic_min_u64(&S.rmin, ordered(S.score[c][lb + q] + (double)row[n - 1]));
            }
          });
        }
        const double lo = S.has_t ? S.t : unordered(S.pmin < S.rmin ? S.pmin : S.rmin);
        const int pn = S.pool_n;
        refine(blk, S, lo, top, budget, [&](int t, auto f) {
          for (int e = 1 + t; e < pn; e += T)
            if (S.score[c][e] >= lo) f(S.score[c][e]);
          for (int k = t; k < total; k += T) {
            int a = 0, b = m;  // the last run q with offset <= k
            while (b - a > 1) { const int mid = (a + b) >> 1; if (S.cnt[mid] <= k) a = mid; else b = mid; }
            const double s = S.score[c][lb + a] + (double)row[k - S.cnt[a]];
            if (s >= lo) f(s);
          }
        });
      } else {
        compact(blk, S);
      }
    }
    if (S.pool_n + total > cap) {
      blk.run([&](int t) { if (t == 0) S.flags |= kOverflow; });
      return -1;
    }
    if (total == 0) break;
    // Write the runs: entry pool_n + k is rank k - offset of the last run q with offset <= k.
    const int lb = S.lvl_b, base = S.pool_n, c = S.cur;
    blk.run([&](int t) {
      for (int k = t; k < total; k += T) {
        int a = 0, b = m;
        while (b - a > 1) { const int mid = (a + b) >> 1; if (S.cnt[mid] <= k) a = mid; else b = mid; }
        const int p = lb + a, r = k - S.cnt[a], e = base + k;
        double s = S.score[c][p] + (double)row[r];
        if (s == 0.0) s = zero_score(row, S.score[c][p], r, d);
        S.score[c][e] = s;
        S.cand[c][e] = pack((uint32_t)p, (uint32_t)r, (uint32_t)d);
        S.key[c][e] = child_key(S, S.key[c][p], r, d);
        if (!S.has_t) atomic_min_u64(&S.pmin, ordered(s));
      }
      if (t == 0) { S.lvl_b = base; S.pool_n = base + total; }
    });
    kept += total;
    if (kept > budget + (budget >> 2) + 8) {
      const int n = S.pool_n;
      const double lo = S.has_t ? S.t : unordered(S.pmin);
      const int got = refine(blk, S, lo, top, budget, [&](int t, auto f) {
        for (int e = 1 + t; e < n; e += T)
          if (S.score[c][e] >= lo) f(S.score[c][e]);
      });
      if (got) kept = got;
    }
  }
  // ---- 3. the order -------------------------------------------------------------------------
  const int n = S.pool_n, c = S.cur;
  blk.run([&](int t) {
    if (t == 0) S.kept = 0;
    for (int e = t; e < n; e += T) S.inv[e] = 0;
  });
  blk.run([&](int t) {
    for (int e = 1 + t; e < n; e += T)
      if (!S.has_t || S.score[c][e] >= S.t) S.idx[atomic_add(&S.kept, 1)] = (uint16_t)e;
  });
  const int A = S.kept;
  const int used = (A < budget ? A : budget) + 1;
  if (A <= 2 * T) {
    // Rank counting: node r + 1 is the entry that exactly r kept entries precede.
    blk.run([&](int t) {
      for (int i = t; i < A; i += T) {
        const int e = S.idx[i];
        int r = 0;
        for (int k = 0; k < A; ++k) r += before(S, S.idx[k], e);
        if (r < budget) S.inv[e] = (int16_t)(r + 1);
      }
    });
    blk.run([&](int t) {
      for (int e = 1 + t; e < n; e += T)
        if (S.inv[e]) S.cnt[S.inv[e] - 1] = e;
    });
  } else {
    // Bitonic sort of idx[0..P) (P a power of two; padding sorts last), then inv.
    int P = 1;
    while (P < A) P <<= 1;
    blk.run([&](int t) {
      for (int i = A + t; i < P; i += T) S.idx[i] = 0xFFFFu;
    });
    for (int k = 2; k <= P; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        blk.run([&](int t) {
          for (int i = t; i < P / 2; i += T) {
            const int lo = 2 * j * (i / j) + (i % j), hi = lo + j;
            const bool up = (lo & k) == 0;  // this block sorts ascending in "precedes" order
            const int a = S.idx[lo], b = S.idx[hi];
            const bool ab = b == 0xFFFF || (a != 0xFFFF && before(S, a, b));
            if (ab != up) { S.idx[lo] = (uint16_t)b; S.idx[hi] = (uint16_t)a; }
          }
        });
      }
    }
    blk.run([&](int t) {
      for (int r = t; r < used - 1; r += T) {
        S.inv[S.idx[r]] = (int16_t)(r + 1);
        S.cnt[r] = S.idx[r];
      }
    });
  }
  // ---- nodes: cnt[r] is the entry of node r + 1 ---------------------------------------------
  blk.run([&](int t) {
    if (t == 0) {
      N.score[0] = 0.0; N.cand[0] = 0; N.first_child[0] = -1; N.next_sibling[0] = -1;
    }
    for (int i = 1 + t; i < used; i += T) {
      const int e = S.cnt[i - 1];
      const uint32_t cd = S.cand[c][e];
      const int r = cand_rank(cd);
      N.score[i] = S.score[c][e];
      N.cand[i] = pack((uint32_t)S.inv[cand_parent(cd)], (uint32_t)r, (uint32_t)cand_depth(cd));
      N.next_sibling[i] = r > 0 ? S.inv[e - 1] : (int16_t)-1;
      N.first_child[i] = -1;
    }
  });
  blk.run([&](int t) {
    for (int i = 1 + t; i < used; i += T) {
      const int e = S.cnt[i - 1];
      const uint32_t cd = S.cand[c][e];
      // The last selected child of its run (the run's next entry is rank + 1 of one parent).
      const bool more = e + 1 < n && S.inv[e + 1] &&
                        S.cand[c][e + 1] == pack(cand_parent(cd), cand_rank(cd) + 1, cand_depth(cd));
      if (!more) N.first_child[S.inv[cand_parent(cd)]] = (int16_t)i;
    }
  });
  return used;
}

}  // namespace par
}  // namespace tree
}  // namespace kdt
