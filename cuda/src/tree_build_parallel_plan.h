// tree_build_parallel_plan.h: the parallel tree build's sizes and launch plan
// (tree_build_parallel.h has the build): its constants, the pool's capacity, the order's
// buckets, the launch's scalars (Consts), the shared-memory layout and the plan that fits it to
// a device, threads per CTA, and the measurement knobs. __host__ __device__ where the build
// reads them too.
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
// every budget (127-1023, the levels) 0.98-1.07x. Not kept. Fewer and longer ones, the
// deviations 1 <= r <= 4 at depth >= 2 carried on by one to three rank-0 steps (144 members at
// L = 15): the replica's pools on the 64 requests of four draws, median 78 -> 72 nodes, largest
// 187 / 128 / 166 / 152 -> 125 / 93 / 98 / 105. H100, bench.tree_ab, kernel alone, budget 63,
// seeds 15 / 5 / 2: bs 64 0.968 / 0.989 / 1.023x, bs 256 0.944-0.989x, bs 1 1.006-1.009x; run
// 20261205T164124Z's draws at bs 64 0.985x (tree_build) and 1.004x (kernels); in the replica
// the deepest warp runs as many batches as before. Not kept.
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

}  // namespace par
}  // namespace tree
}  // namespace kdt
