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
//   3. The kept nodes are ordered by (score desc, rank path asc): a bucket sort on the score
//      (order_bins: 256, 1024 or 4096 buckets by the pool's capacity), ranks counted inside
//      a bucket with no branch; the first B are nodes 1..B. (Counting each kept entry's rank over
//      the whole pool instead, one phase with no buckets, for pools up to 256 entries: H200,
//      bench.tree_ab, 1.07x at bs 1 and 1.20x at bs 64, budget 63, 1.25-1.30x at 127, with a
//      branch-free loop unrolled 4 times; its phase took 5.6k cycles at budget 63, bs 64, against
//      4.5k for the bucket sort's three. A warp an entry and a lane a column instead, the columns'
//      scores in registers: 1.32x at bs 64 and 1.13x at bs 1, budget 63, ~350 cycles an entry in
//      series in its warp, ~800 with a tie; four entries an iteration was slower still: 8f7e796 and
//      7e71da8, reverted. G lanes an entry, G picked from the pool's size, each a stride of the
//      columns, a shuffle sum: 7.5k cycles at bs 1, budget 63 (profile, seed 5) against the
//      buckets' 5.0k; bs 64's slowest block 42.7k against 21.7k. Not kept.
//      A merge for the queue's pool up to 256 entries: each warp sorts a chunk of 32 entries
//      with a bitonic network of shuffles, then an entry's rank is its slot plus a six-probe
//      binary search of every other chunk on score and key (ties of both, rare, compared by
//      rank path after). Two phases, but at bs 64, budget 63 (profile, seed 5) the sort took
//      2.8k cycles and the ranks 6.6k, against 4.2k for the buckets' three phases: H200,
//      bench.tree_ab, 1.11-1.21x at budgets 33-63, bs 1-1024. Not kept. The queue's entries
//      binned into these buckets as the queue takes them (t and the top score are known before
//      it: a bucket, a slot by a shared atomic, a list of up to 8 entries a bucket, 1 request
//      in 768 overflowing one), so that the order is one phase: an entry's rank is the count
//      of the buckets before its own, from 32 group sums scanned by shuffles plus its group's
//      buckets before it, and the entries of its bucket that precede it. The one phase took
//      2.8-3.6k cycles against the three's 3.9k, but each batch's run lengths ~250 cycles more
//      (binning after the queue instead, each warp its own entries once it has no batch left:
//      no cheaper); H200, bench.tree_ab, seeds 15 and 5, five variants: budget 63 1.00-1.13x
//      at bs 1-1024, budgets 33 and 47 1.02-1.07x at bs 64 and 0.97-1.05x at bs 1. Not kept.)
//      Parents and child lists (prepend rule) follow from the order: a run is contiguous, so
//      a node's left sibling is the entry before it.
// Masses of exact ties that overflow the pool even so are declined as well.
//
// The Block (tree_build.cu's GpuBlock, tree_build_cpu.cpp's CpuBlock) runs each phase for every
// thread then synchronises (run), and provides the collectives (an exclusive scan, run lengths
// with their offsets, a suffix pick over a histogram, the chain prefix sums, a chain run's
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

namespace kdt {
namespace tree {
namespace par {

constexpr int kBinsLog2 = 8;
constexpr int kBins = 1 << kBinsLog2;  // histogram bins of the threshold refinement
constexpr int kOrderBins = 1024; // score buckets of the final order, at least (order_bins)
constexpr int kMaxPool = 3072;  // pool capacity bound

// Budgets up to which the build expands the nodes at or above the first bound through a queue
// (section 1'; see Block::expand below), and the queue's pool there.
constexpr int kQueueMaxBudget = 63;
constexpr int kQueuePool = 512;
// The queue starts from the runs of the rank-0 chain's first kChainRuns nodes: the root's, its
// rank-0 child's and that child's rank-0 child's (build, section 1'), so that the deepest
// subtree is shared among the warps from its third level on. Each run's length is two ballots
// of a warp (Block::count_run; a lane a rank), and a chain node's liveness is its own score
// against t, so the counts do not wait on one another. H200, bench.tree_ab, kernel alone, 3
// rounds: three runs against two (both with those counts), seed 15 / seed 5: budget 63 bs 64
// 0.927x / 0.949x, bs 4 0.930x / 0.889x, bs 16 0.965x, bs 256 0.979x / 0.974x, bs 1024 0.982x,
// bs 1 0.992x / 1.002x; budgets 33 and 47 at bs 64 0.95-0.98x, bs 1 0.99x. Four, five and six
// runs against three (seed 15): bs 64 budget 63 0.95-0.97x but every other case 1.00-1.07x
// (seed 5, five runs: bs 64 1.04x). (With the counts one after another and searched a thread
// each by count_at_least64, as before: three runs against two took 0.98-1.01x at bs 64 budget
// 63, bs 1 1.01-1.04x; the root's run alone against two, 1.04-1.16x at bs 64.)
constexpr int kChainRuns = 3;

// Pool capacity for a budget: kQueuePool up to kQueueMaxBudget, else 4 (budget + 1) rounded up
// to a multiple of 256, at most kMaxPool. Any capacity > budget is correct (a pool that
// overflows even after the threshold rose and the pool was compacted declines the request); a
// larger one overflows less often. A queue that overflows gives way to the levels, which cost
// more than the whole queue (the kernels suite's run c858683: one of 64 requests at budget 63
// had 300 nodes at or above the first bound, and that batch took 21.5 us against 16.7 us in the
// tree_build suite). H200, bench.tree_ab, 512 against 256 entries on requests that fit both: bs
// 1 1.00x, bs 64 0.995-1.007x (nine draws), bs 256 1.00x, bs 1024 1.00x.
KDT_HD int pool_capacity(int budget) {
  if (budget <= kQueueMaxBudget) return kQueuePool;
  const int c = (4 * (budget + 1) + 255) / 256 * 256;
  return c < kMaxPool ? c : kMaxPool;
}

// Score buckets of the final order for a pool capacity (hist holds this many; a power of two,
// Bins): kBins (256) for a pool of at most kQueuePool entries (budgets up to 127), 4096 for one
// above 2048 entries, else kOrderBins. Buckets are 2^k wide, so that between half and all of
// them span the scores. The pool's scores crowd toward the threshold (a tree has more nodes at
// lower scores), and ranking an entry inside its bucket costs the bucket's size. H200,
// bench.tree_ab, when buckets were linear: one per entry against 1024 took budget 1023 (3072
// entries) 0.95x at bs 1 and 0.95-0.97x at bs 64, and budget 511 (2048 entries) 1.00-1.01x,
// so it keeps 1024. The power-of-two buckets came with the exact bins
// (Bins), and were measured with them (see Bins). 256 buckets for the queue's pool (budget
// <= 63) took 0.99-1.01x at bs 1-16 and 1.03-1.045x at bs 64 (bench.tree_ab) when a bucket's
// ranks were counted with a branch an entry; with the branch-free count (build, section 3),
// 256 for pools of up to 512 entries against 1024, H200, bench.tree_ab, seeds 15 and 5:
// budget 63 0.973-0.999x at bs 1-256, 33 0.979-0.986x, 127 0.987-0.998x.
KDT_HD int order_bins(int cap) {
  return cap <= kQueuePool ? kBins : cap > 2048 ? 4 * kOrderBins : kOrderBins;
}

// Ranks of the first bound's chain deviations, (0, ..., 0, r) for r < family_ranks (build,
// section 0): every rank a budget can select, except that the queue's budgets take 32 at most.
// The family's B-th best sits among its best members, so the deviations of high rank rarely
// move it, and they are most of the family (945 of 1167 scores at budget 63, L = 15, K = 64):
// with 32, 702 scores are binned (bins over a narrower range, too), and on bench inputs at
// budget 63, bs 64, the queue's pool keeps 85 nodes at the median (CPU emulation; the largest of
// the 64 grows from 165 nodes to 199). Larger budgets keep every rank: at budget 255 a cap of
// 32 grows the pool's median from 428 nodes to 508 (a Python replica of the family). H200,
// bench.tree_ab against every rank, kernel alone: budget 63 0.98-0.99x at bs 1, 4, 16, 64, 256
// and 1024; budget 47 0.99-1.00x. (The opposite, 175 more deep members, cost 1.01-1.24x.)
// A tighter first bound does not pay either: the deviations carried on by rank-0 steps,
// (0, ..., 0, r, 0, ..., 0) with 1 <= r < 32 at depth >= 2 and one step more (403 members at
// budget 63, L = 15), shrink the queue's pool (bench inputs, bs 64, budget 63, a Python replica
// of the binning: median 85 -> 76 nodes, largest 199 -> 142; two steps, 775 members: 114), but
// the histogram pass took 2.0k cycles against 1.2k, and the slowest block's deepest warp ran as
// many batches as before (its queue's end 4.7k cycles both; H200, KDT_PAR_PROFILE, seed 5).
// H200, bench.tree_ab, kernel alone, seeds 15 and 5: budget 63 bs 64 1.01-1.02x, bs 1
// 1.03-1.04x, bs 4-1024 0.90-1.03x, budgets 33 and 47 0.97-1.04x; two steps 1.045-1.07x; at
// every budget (127-1023, the levels) 0.98-1.07x. Not kept.
constexpr int kFamilyRanksQueue = 32;
KDT_HD int family_ranks(int K, int budget) {
  const int kc = K < budget ? K : budget;
  return budget <= kQueueMaxBudget && kc > kFamilyRanksQueue ? kFamilyRanksQueue : kc;
}

// Exact floor(n / d) as a 32-bit multiply and a shift, for 0 <= n < 2^12 and n d < 2^20 (the
// family's indices: n < 2^11, d <= 506): n ceil(2^20 / d) >> 20 exceeds n / d by less than
// n / 2^20 < 1 / d, so it never reaches the next integer, and the product stays below 2^32. A
// division by a run-time value costs a thread a chain of ~20 instructions.
KDT_HD uint32_t div_magic(int d) { return ((1u << 20) + (uint32_t)d - 1) / (uint32_t)d; }
KDT_HD int div_by(int n, uint32_t magic) { return (int)(((uint32_t)n * magic) >> 20); }
// (t - o) mod T for 0 <= t, o < T: thread t's first index in a family part that starts at
// thread o (Consts::oG, oE, oC).
KDT_HD int from_thread(int t, int o, int T) { return t < o ? t - o + T : t - o; }

// The side q of the first bound's depth-3 cube at the queue's budgets: the nodes (a, b, c) with
// a, b < q, 1 <= c < q and (a, b) != (0, 0) (build, section 0), 45 members at q = 4. It is
// for the wide shallow requests, whose best nodes deviate at depth 3 after a deviation above:
// the family without it leaves such a request's queue ~3x its budget (a Python replica of the
// bound, bs 64, budget 63: run 20261204T142837Z's draw, largest pool 224 nodes -> 174, median
// 78 -> 71). H200, bench.tree_ab, kernel alone, with the balanced start (the family's visit)
// against the build with neither: that run's draw bs 64 0.844x, bs 1 0.930x; 18 fresh draws
// (seeds 1-18) bs 64 mean 0.991x (median 1.004x, largest 13.46 -> 12.20 us), bs 16 0.991x,
// bs 1 1.008x (median 1.013x); budget 15 bs 4 1.00x. A side of 5 (96 members) measured the
// same. KDT_CUBE_SIDE=0 builds without it.
#ifndef KDT_CUBE_SIDE
#define KDT_CUBE_SIDE 4
#endif
constexpr int kCubeSide = KDT_CUBE_SIDE;

// The build's scalars for one launch (budget, L, K, threads T, order buckets), computed once on
// the host (consts) and read by every thread: as loops or divisions by run-time values in each
// thread they cost the block ~2-3k cycles before its first phase (H200, KDT_PAR_PROFILE, bs 64,
// budget 63: 835 cycles for the family's grid side alone, a 12-step loop).
struct Consts {
  int kc;                   // ranks a budget can select: min(K, budget)
  int kf;                   // the family's chain-deviation ranks (family_ranks)
  int lg;                   // the smallest lg with 2^lg >= L + 2 (the exactness check)
  int key_bits, key_depth;  // tree::set_key_layout
  int mord;                 // log2 of the order buckets (nord)
  int g, h, E;              // the family's grid side, its corner's side, the corner's extensions
  int ngrid, next, nfam;    // the grid's members, the corner's, the family's
  int q, ncube;             // the depth-3 cube's side and members (0 when none)
  int oG, oE, oC;           // the thread that takes the grid's, the extensions' and the cube's
                            // first member: the family's members before them, mod T
  int dT, rT, aT, bT;       // T % L, T / L, T % (g - 1), T / (g - 1) (g > 1)
  int step32;               // 32 % K (the CUDA staging)
  uint32_t mL, mw, mnext, mh;  // div_magic of L, g - 1, next and h (of 1 when unused)
  uint32_t mq1, mq;             // div_magic of q - 1 and q (of 1 when unused)
};

inline Consts consts(int budget, int L, int K, int T, int nord) {
  Consts c{};
  c.kc = K < budget ? K : budget;
  c.kf = family_ranks(K, budget);
  while ((1 << c.lg) < L + 2) ++c.lg;
  Scratch ks{};
  set_key_layout(ks, L, K);
  c.key_bits = ks.key_bits;
  c.key_depth = ks.key_depth;
  while (1 << c.mord < nord) ++c.mord;
  if (L >= 2) {
    while (c.g < c.kc && c.g * c.g < 2 * budget) ++c.g;
  }
  c.h = (c.g + 1) / 2;
  c.E = L - 2 < 3 ? (L > 2 ? L - 2 : 0) : 3;
  c.ngrid = c.g > 1 ? (c.g - 1) * c.g : 0;
  c.next = c.h > 1 ? (c.h - 1) * c.h : 0;
  c.q = budget <= kQueueMaxBudget && L >= 3 ? (kCubeSide < c.kc ? kCubeSide : c.kc) : 0;
  c.ncube = c.q > 1 ? (c.q * c.q - 1) * (c.q - 1) : 0;
  c.nfam = L * c.kf + c.ngrid + c.next * c.E + c.ncube;
  c.oG = L * c.kf % T;
  c.oE = (L * c.kf + c.ngrid) % T;
  c.oC = (L * c.kf + c.ngrid + c.next * c.E) % T;
  const int w = c.g > 1 ? c.g - 1 : 1;
  c.dT = T % L;
  c.rT = T / L;
  c.aT = T % w;
  c.bT = T / w;
  c.step32 = 32 % K;
  c.mL = div_magic(L);
  c.mw = div_magic(w);
  c.mnext = div_magic(c.next > 0 ? c.next : 1);
  c.mh = div_magic(c.h > 0 ? c.h : 1);
  c.mq1 = div_magic(c.q > 1 ? c.q - 1 : 1);
  c.mq = div_magic(c.q > 0 ? c.q : 1);
  return c;
}

// A level whose refinement leaves more than cap / kCompactShare entries below the new bound
// compacts the pool at once when a next level as large as it would overflow (see build).
constexpr int kCompactShare = 4;

// Entries of a compaction round when the pool has one copy (Arrays::twin false).
constexpr int kCompactBuf = 256;

// Shared memory of the build's arrays for a budget, L, pool capacity, copies and order buckets
// (the CUDA kernel's layout: 8-byte arrays first, then 4-byte, then 2-byte), the staged
// log-probs aside. Per pool entry: 20 bytes a copy (score, key, cand), then cnt, srt, order and
// inv (10 bytes); 4 bytes an order bucket.
inline size_t smem_bytes(int budget, int L, int cap, bool twin, int nord) {
  const size_t n = (size_t)budget + 1, c = (size_t)cap, copies = twin ? 2 : 1;
  const size_t nbuf = twin ? 0 : (size_t)kCompactBuf;
  return n * 8 + (size_t)(L + 1) * 8 + copies * c * 16 + nbuf * 16 + n * 4 + copies * c * 4 +
         nbuf * 8 + (c + (size_t)nord + 34) * 4 + c * 3 * 2 + n * 2 * 2;
}

// The request's log-probs are staged in shared memory when they take at most this many bytes
// (and the layout leaves room): the searches then read them at shared-memory latency.
constexpr size_t kStageLogpBytes = 16 * 1024;
inline size_t stage_bytes(int L, int K) {
  const size_t b = (size_t)L * K * sizeof(float);
  return b <= kStageLogpBytes ? b : 0;
}

// A layout of the build for one launch.
struct Plan {
  int cap;       // pool capacity
  bool twin;     // two pool copies
  bool staged;   // log-probs in shared memory
  int nord;      // order buckets
  size_t bytes;  // dynamic shared memory in all
};

// The fastest layout within `limit` bytes of shared memory per block: two pool copies with
// staged log-probs, then without staging, then one copy (staged, then not); in each, the pool
// shrinks in steps of 256 entries from pool_capacity, never below 2 (budget + 1), and takes
// order_bins buckets where they fit, else kOrderBins (finer buckets never cost pool entries: a
// smaller pool overflows more often, 1.36x slower at budget 1023 on sm_120's layout). False
// when none fits (the caller builds another way). H200 (227 KB a block, L = 15): two copies and
// order_bins at every budget. sm_120 (99 KB a block): two copies up to budget 767, one copy
// at 1023 and 1024 (a pool of 2304 entries, 1024 buckets; two copies would need 124 KB at the
// smallest pool).
inline bool plan(int budget, int L, int K, size_t limit, Plan* p) {
  const size_t stage = stage_bytes(L, K);
  for (int twin = 1; twin >= 0; --twin) {
    for (int staged = stage ? 1 : 0; staged >= 0; --staged) {
      for (int cap = pool_capacity(budget); cap >= 2 * (budget + 1); cap -= 256) {
        for (int fine = 1; fine >= 0; --fine) {
          const int nord = fine ? order_bins(cap) : kOrderBins;
          const size_t b = smem_bytes(budget, L, cap, twin != 0, nord) + (staged ? stage : 0);
          if (b <= limit) {
            *p = Plan{cap, twin != 0, staged != 0, nord, b};
            return true;
          }
        }
      }
    }
  }
  return false;
}

// Threads per CTA for a budget (the CUDA launch and the CPU emulation's default). H200,
// bench.tree_ab against this choice, kernel alone: 512 threads from budget 128 on took 1.00x at
// 127 and 1.02-1.07x at 255 (bs 1-64; 1.45x at bs 256), 128 threads up to budget 63 took
// 1.02-1.03x at 32 and 1.08-1.12x at 63 (bs 1-64); at budgets 47 and 63 (seed 15), 384
// threads took 1.02-1.04x (bs 256 0.98x) and 512 1.04-1.06x (bs 256 1.53x).
KDT_HD int threads_for(int budget) { return budget < 512 ? 256 : 512; }

// Measurement and test knobs, read per call by the CUDA launch and the CPU emulation alike:
// KDT_TREE_BUILD_THREADS, threads per CTA (a multiple of 32 in [32, 1024]; else threads_for;
// the CUDA launch refuses more than the kernel's registers allow, e.g. 768 at 80 registers),
// and KDT_TREE_BUILD_SMEM, the shared memory per block to plan for (bytes; 0 when unset: the
// device's), which emulates a smaller device, e.g. 100352 for sm_120's 99 KB less the kernel's
// static kilobyte.
inline int threads_from_env(int budget) {
  const char* v = getenv("KDT_TREE_BUILD_THREADS");
  const int t = v ? atoi(v) : 0;
  return t >= 32 && t % 32 == 0 && t <= 1024 ? t : threads_for(budget);
}
inline size_t smem_from_env() {
  const char* v = getenv("KDT_TREE_BUILD_SMEM");
  const long x = v ? atol(v) : 0;
  return x > 0 ? (size_t)x : 0;
}

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
// sums, their runs placed together; the root's chain by the block) cut the batches on paper
// but cost 2.5-3.0k cycles a batch before its allocation: with the order above, 1.81x at bs 64,
// budget 63 (8f7e796, reverted). Measured again with the first runs (each entry of rank >= 1 and
// the first runs' tail a head, a rank-0 entry never expanded; bench inputs at budget 63: at most
// 3 batches a path against 7 levels), bit-exact (the CUDA tree tests passed), H200,
// bench.tree_ab, budget 63, two draws: each child finding its unit by walking its head's chain,
// bs 64 1.42-1.59x, bs 1 1.13-1.17x, bs 4-1024 1.28-1.50x; the units flattened a lane each (a
// second counting pass past 32 units), bs 64 1.87-2.08x, bs 1 1.18-1.21x; budgets 33 and 47
// 1.04-1.40x. The slowest warp still expands the same nodes, each at a higher cost: the queue is
// bound by a warp's serial work, not by its depth. The root's chain alone, by the block before the
// queue (each chain node's run at or above t, placed by blk.offsets, written in one phase; the
// chain nodes then not expanded again): the median block ran 3 batches instead of 5, but the phase
// took 3.3k cycles against the root's run's 1.0k. H200, bench.tree_ab, budget 63, three draws: bs
// 64 0.90x, 0.94x and 1.00x; bs 256 0.87-0.92x; bs 4 0.89-1.08x; bs 1 1.01-1.09x; budget 32 at bs
// 64 1.08x. Counting the runs in every warp's lanes instead (no barrier before the writes) took
// 2.7k cycles and made every later batch slower (its run lengths 620 -> 1370 cycles), 1.03-1.26x.
// Neither kept. The first two runs of that chain instead (kChainRuns), counted by every thread
// alike and written in the root's phase, with no phase of their own: kept.

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

// Builds one request into N (node order; slot 0 the root); returns the slots used (root
// included), or -1 when it declines the request (S.flags says why, unless pre): the caller then
// runs the serial build. lp is [L, K] (rows sorted descending). init(S) must have run. pre: the
// caller has done the first phase's work already (first_entries, A.chain and S.fmin by
// Block::chain_sums, and the check of every log-prob: its verdict, the same in every thread),
// and a barrier since; nullptr: the build does it.
template <class Block>
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
      for (int j = from_thread(t, C.oE, T); j < next * E; j += T) {  // few
        const int e = 1 + div_by(j, C.mnext), x = j - (e - 1) * next;
        const int r1 = 1 + div_by(x, C.mh), r2 = x - (r1 - 1) * h;
        f(((double)lp[r1] + (double)lp[(size_t)K + r2]) + (A.chain[2 + e] - A.chain[2]));
      }
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
  if (bd.has && budget <= kQueueMaxBudget) {
    const Pool P = A.pool(0);
    const double tt = bd.t;
    // Child r of entry i into entry e (score and key); returns its cand. The root (entry 0,
    // score 0, key 0, cand 0: depth 0) is a parent like any other.
    auto put = [&](int i, int e, int r) {
      const int d = cand_depth(P.cand[i]) + 1;
      const float* row = lp + (size_t)(d - 1) * K;
      P.score[e] = child_score(row, P.score[i], r, d);
      P.key[e] = child_key(A, P.key[i], r, d);
      return pack((uint32_t)i, (uint32_t)r, (uint32_t)d);
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
    const int n = blk.expand(&S.work, P.cand, A.cnt, n0, cap, kc, probe, put);
    blk.mark(7);
    if (n >= 0) {
      le = n;
      queued = true;
    }
  }
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
  for (int d = 1; !queued && d <= L; ++d) {
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
  // ---- 3. the order: buckets by score (a bucket sort), ranks counted inside a bucket --------
  const int n = le;
  const Pool P = A.pool(c);
  const bool all = !bd.has;
  const double tt = bd.t;
  const double lo = all ? unordered(S.pmin) : tt;
#if defined(__CUDA_ARCH__)
  Bins bins;
#else
  Bins bins{};  // read only when spread; g++ (-Wmaybe-uninitialized) cannot see that
#endif
  const int mord = C.mord;  // nord = 2^mord buckets
  const bool spread = n > 1 && make_bins(lo, top, mord, lsb, bins);
  // hist's bins above kBins are still zero from the first phase; its first kBins are too
  // unless a refinement ran after the last level's write.
  if (!hist_clean) {
    blk.run([&](int t) {
      for (int i = t; i < kBins; i += T) A.hist[i] = 0;
    });
  }
  blk.run([&](int t) {
    if (t == 0) A.inv[0] = 0;
    for (int e = 1 + t; e < n; e += T) {
      A.inv[e] = 0;
      const double s = P.score[e];
      if (!(all || s >= tt)) { A.cnt[e] = -1; continue; }
      const int bk = spread ? bins.nb - 1 - bins.of(s) : 0;  // bucket 0: the best scores
      A.cnt[e] = (bk << 16) | hist_add(A.hist, bk);
    }
  });
  const int kept_n = blk.scan(A.hist, A.nord);  // hist: each bucket's first position
  blk.mark(80);
  // Bucket by bucket: the entries (srt), and with two copies their scores and keys beside them in
  // the other one (free now), so that counting an entry's rank in its bucket reads independent
  // values; with one copy the count reads them through srt.
  const bool twin = A.twin;
  const Pool Q = twin ? A.pool(c ^ 1) : P;
  blk.run([&](int t) {
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
    for (int i = t; i < used; i += T) N.first_child[i] = -1;
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
