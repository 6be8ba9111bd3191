// tree_build_parallel.cu: the parallel CUDA tree build (KDT_TREE_BUILD=parallel, and auto above
// tree::wrp::kAutoMaxBudget): tree_build_parallel.h on one CTA of 256 or 512 threads per request
// (an exact-sum check, then level-by-level expansion under a rising score bound, or up to budget
// 63 a queue under a fixed one, then a bucket sort of the kept nodes); a request it declines
// (log-probs whose float64 sums may round, a positive log-prob or an unsorted row, or a pool
// overflow from masses of exact ties) is built by the block's warp 0 with the serial warp
// selection (tree_build_device.cuh), in the same launch.
#include <cuda_runtime.h>

#include <cstdio>

#if defined(KDT_PAR_PROFILE) && !defined(KDT_PAR_REPEAT)
#define KDT_PAR_REPEAT 1
#endif

#include "common.h"
#include "pdl.cuh"
#include "tree_build_core.h"
#include "tree_build_device.cuh"
#include "tree_build_gpu_block.cuh"
#include "tree_build_parallel.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

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


// kStaged: the request's log-probs are copied to shared memory (tree::par::Plan::staged). A
// template argument rather than a run-time choice, so that every log-prob read compiles to a
// shared (or a global) load: a pointer that may point to either compiles to slower generic loads.
// cap, twin: the pool's capacity and copies (tree::par::plan).
// C: the launch's scalars (tree::par::consts).
// kRoomy: at most 96 registers a thread instead of 80 (__maxnreg__; the launch picks, below).
// With 80, the cap the kernel took before the ballots of the queue's narrow batches and first
// runs (85 without the cap, 4 bytes spilled with it), three blocks of 256 threads fit a
// multiprocessor; with 96 (sm_90: 96 registers unstaged, 90 staged), two. Uncapped, bs 1024 at
// budget 63 took 1.20x (H200, bench.tree_ab; two blocks a multiprocessor). The staged kernel
// fits 80 without a spill (sm_90), and the cap chooses a schedule; the unstaged one (log-probs
// too large to stage: L K > 4096, e.g. K >= 274 at L = 15) spills 4 bytes at 80 since the queue
// reads a parent once for its children (tree_build_parallel.h, section 1'); not measured there
// (the suites stage every case, sm_120's shared memory included).
// The 96 cap on every launch (H200, bench.tree_ab, 2026-12-05): bs 1024 at budget 63 1.21x, where
// two blocks a multiprocessor fit instead of three. So the launch takes the roomy kernel when
// the grid fits the multiprocessors at its occupancy, or when its occupancy is the other's
// (shared memory or the block's threads bound both alike). This launch against the 80 kernel
// alone (H200, bench.tree_ab, kernel alone, 4 rounds, seeds 15 / 5): bs 256 at budget 63
// 0.918 / 0.952x, 255 0.931 / 0.917x, 1023 0.981 / 0.977x; bs 264 at 63 0.972 / 0.911x; bs 64
// at 255 0.988 / 0.990x, at 1023 0.993 / 0.972x; bs 1-128 at budgets 33-63 0.992-1.000x; bs 1
// at 1023 1.003 / 1.005x; bs 300 and 1024 (the 80 kernel) 0.999-1.001x.
// kPaths: tree::par::build's expansions compiled in (both, or the queue's alone: below).
template <bool kStaged, bool kRoomy, int kPaths = tree::par::kQueuePath | tree::par::kLevelPath>
__global__ void __maxnreg__(kRoomy ? 96 : 80)
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
  blk.mark(15);
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
    tree::par::build<GpuBlock, kPaths>(blk, S, A, nodes, lp, a.L, a.K, a.budget, cap, C,
                                       kStaged ? &pre : nullptr);
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
  int u = tree::par::build<GpuBlock, kPaths>(blk, S, A, nodes, lp, a.L, a.K, a.budget, cap, C,
                                             kStaged ? &pre : nullptr);
  if (u < 0) {
    // The serial selection (warp variant) over the pool's memory: its frontier and keys (20 n
    // bytes) fit in one copy (20 cap bytes; cap > n). (Out of line instead, a __noinline__
    // function, so that its ~16 KB of SASS no longer sits between the build's last phases and
    // the outputs: the call keeps the outputs' values live across it, 78 -> 91 registers on the
    // queue's kernel. H100, bench.tree_ab against this, kernel alone, seed 15: budget 63 bs
    // 1-132 1.000-1.017x, bs 256 and 1024 1.011-1.017x, 47 1.017x, 1023 1.010-1.018x. Branch
    // i15-oof, not kept.)
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

// The four instantiations, and what the launch needs of them (once per device). (Each split in
// two instead, one with the queue alone for the budgets and families it takes, declining an
// overflow to the serial selection, one with the levels alone, and both serving every grid:
// H100, bench.tree_ab against these four, kernel alone, seeds 15 / 5: budget 63 bs 1-64
// 0.983-0.991x, bs 1024 0.979x, but bs 256 1.056 / 1.031x (the queue's 80-register kernel
// counts as roomy and fits three blocks a multiprocessor, no longer two); budgets 33 and 47
// 0.975-0.982x; 127-1023 1.000-1.010x. Hence the queue's kernel below, at the occupancy of the
// kernel it stands in for.)
constexpr void (*kKernels[2][2])(TreeBuildArgs, int, int, int, const tree::par::Consts) = {
    {tree_build_parallel_kernel<false, false>, tree_build_parallel_kernel<false, true>},
    {tree_build_parallel_kernel<true, false>, tree_build_parallel_kernel<true, true>}};
// The queue's alone (the levels compiled out; a request the queue does not take is declined to
// the serial selection), roomy, [staged]: at the queue's budgets (tree_build_parallel_cuda, which
// holds it to the occupancy of the kernel it stands in for). Fewer instructions and registers on
// the path that runs; at bs 256 (three blocks a multiprocessor at its 80 registers against two
// at the four's 90-96) it took 1.03-1.06x when it served every grid (H100, 78a03aa), so it
// served grids of a block a multiprocessor alone until the launch held it to two (below).
// Against the four alone, on those grids (H100, bench.tree_ab,
// kernel alone, seed 15, 3 rounds, bit-exact; 2026-12-05): budget 63 bs 1 8.42 -> 8.21 us
// (0.975x), bs 4-132 0.969-0.981x (bs 64 10.82 -> 10.62), budget 47 at bs 64 0.976x; bs 256 and
// 1024 (the four serve them) and budgets 15 and 1023 1.000x; the suites' budget-63 draws
// 0.973-0.977x at bs 1 and 0.977-0.993x at bs 64.
constexpr int kQueueOnly = tree::par::kQueuePath;
constexpr void (*kQueueKernels[2])(TreeBuildArgs, int, int, int, const tree::par::Consts) = {
    tree_build_parallel_kernel<false, true, kQueueOnly>,
    tree_build_parallel_kernel<true, true, kQueueOnly>};

struct DeviceFacts {
  int limit = 0;           // the dynamic shared memory a block may take (opted in)
  int threads_limit = 0;   // the fewest of the kernels' maxThreadsPerBlock
  int sms = 0;             // multiprocessors
  int smem_per_sm = 0;     // shared memory a multiprocessor has for blocks
  int regs_per_sm = 0;     // registers a multiprocessor has
  int regs[2][2] = {};     // registers a thread, per instantiation
  int static_smem[2][2] = {};
  int queue_regs[2] = {};  // the same, for the queue's kernels, [staged]
  int queue_static_smem[2] = {};
};

// Blocks of a kernel of `regs` registers a thread and `static_smem` bytes of static shared
// memory that fit one multiprocessor at T threads and `bytes` of dynamic shared memory: the fewest
// of what the registers (allocated per warp, in units of 256), the shared memory (plus the 1 KB
// the device reserves a block) and the threads allow.
int blocks_per_sm(const DeviceFacts& f, int regs, int static_smem, int T, size_t bytes) {
  const int warps = (T + 31) / 32;
  const int warp_regs = (regs * 32 + 255) / 256 * 256;
  const int by_regs = warp_regs ? f.regs_per_sm / (warp_regs * warps) : 32;
  const size_t block_smem = bytes + (size_t)static_smem + 1024;
  const int by_smem = (int)((size_t)f.smem_per_sm / block_smem);
  const int by_threads = 2048 / T;
  int n = by_regs < by_smem ? by_regs : by_smem;
  n = n < by_threads ? n : by_threads;
  return n < 32 ? n : 32;
}

// The dynamic shared memory, at least `bytes`, at which no more than `blocks` blocks of a kernel
// of `static_smem` bytes of static shared memory fit one multiprocessor (blocks_per_sm's count).
size_t bytes_for_blocks(const DeviceFacts& f, int blocks, int static_smem, size_t bytes) {
  const size_t block_smem = (size_t)f.smem_per_sm / (size_t)(blocks + 1) + 1;
  const size_t over = (size_t)static_smem + 1024;
  const size_t need = block_smem > over ? block_smem - over : 0;
  return need > bytes ? need : bytes;
}

// Kernel k opted in to `limit` bytes of dynamic shared memory, and its attributes read into fa;
// the registers it takes bound its threads per block (a launch of more fails): g.threads_limit.
kdt_status opt_in(void (*k)(TreeBuildArgs, int, int, int, const tree::par::Consts), int limit,
                  const char* fn, DeviceFacts& g, cudaFuncAttributes& fa) {
  KDT_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, limit), fn);
  KDT_CUDA_CHECK(cudaFuncGetAttributes(&fa, k), fn);
  if (fa.maxThreadsPerBlock < g.threads_limit) g.threads_limit = fa.maxThreadsPerBlock;
  return KDT_OK;
}

// The shared-memory opt-in, once per device at the largest size the device allows, so that a
// later call under graph capture makes no attribute call (nor any other query: the facts are
// cached here). tree::par::plan picks the layout that fits (sm_120: 99 KB per block); a budget
// that fits none runs the serial kernel.
kdt_status device_facts(const char* fn, const DeviceFacts** out) {
  static DeviceFacts facts[64];
  int dev = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  static DeviceFacts other;  // a device past 64: asked every call
  DeviceFacts& f = dev >= 0 && dev < 64 ? facts[dev] : other;
  if (f.limit) {
    *out = &f;
    return KDT_OK;
  }
  int limit = 0;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
                 fn);
  limit -= 1024;  // the kernel's static shared memory (S, used)
  const int cap = tree::par::pool_capacity(tree::kMaxBudget);
  const int most = (int)(tree::par::smem_bytes(tree::kMaxBudget, tree::kMaxDepth, cap, true,
                                               tree::par::order_bins(cap)) +
                         tree::par::kStageLogpBytes);
  limit = limit < most ? limit : most;
  DeviceFacts g;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, dev), fn);
  KDT_CUDA_CHECK(
      cudaDeviceGetAttribute(&g.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev),
      fn);
  KDT_CUDA_CHECK(
      cudaDeviceGetAttribute(&g.regs_per_sm, cudaDevAttrMaxRegistersPerMultiprocessor, dev), fn);
  g.threads_limit = 1024;
  for (int staged = 0; staged < 2; ++staged) {
    for (int roomy = 0; roomy < 2; ++roomy) {
      cudaFuncAttributes fa;
      const kdt_status s = opt_in(kKernels[staged][roomy], limit, fn, g, fa);
      if (s != KDT_OK) return s;
      g.regs[staged][roomy] = fa.numRegs;
      g.static_smem[staged][roomy] = (int)fa.sharedSizeBytes;
    }
    cudaFuncAttributes fa;
    const kdt_status s = opt_in(kQueueKernels[staged], limit, fn, g, fa);
    if (s != KDT_OK) return s;
    g.queue_regs[staged] = fa.numRegs;
    g.queue_static_smem[staged] = (int)fa.sharedSizeBytes;
  }
  g.limit = limit;
  f = g;
  *out = &f;
  return KDT_OK;
}

}  // namespace

kdt_status tree_build_parallel_cuda(const TreeBuildArgs& a, void* stream, bool* launched) {
  static const char* fn = "kdt_tree_build";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  *launched = false;
  const int T = tree::par::threads_from_env(a.budget);
  const DeviceFacts* f = nullptr;
  const kdt_status s = device_facts(fn, &f);
  if (s != KDT_OK) return s;
  if (T > f->threads_limit)
    return set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                     "KDT_TREE_BUILD_THREADS=%d: the parallel build's kernel takes at most %d "
                     "threads per block on this device (its registers); use %d or fewer",
                     T, f->threads_limit, f->threads_limit);
  tree::par::Plan p;
  const size_t knob = tree::par::smem_from_env();  // a smaller device, emulated
  const size_t limit = knob && knob < (size_t)f->limit ? knob : (size_t)f->limit;
  if (!tree::par::plan(a.budget, a.L, a.K, limit, &p)) return KDT_OK;
  const int twin = p.twin ? 1 : 0, staged = p.staged ? 1 : 0;
  // The roomy kernel when the grid fits the multiprocessors at its occupancy, or it fits as
  // many blocks a multiprocessor as the other (kRoomy above).
  const int dense = blocks_per_sm(*f, f->regs[staged][0], f->static_smem[staged][0], T, p.bytes);
  const int roomy_fit =
      blocks_per_sm(*f, f->regs[staged][1], f->static_smem[staged][1], T, p.bytes);
  const int roomy = roomy_fit >= dense || a.bs <= f->sms * roomy_fit ? 1 : 0;
  const tree::par::Consts C = tree::par::consts(a.budget, a.L, a.K, T, p.nord);
  // The queue's kernel where the queue takes every request that passes the check (a budget it
  // serves, a family that gives a first bound), at the occupancy of the kernel it stands in
  // for: where that one fits fewer blocks a multiprocessor, the queue's takes more dynamic
  // shared memory than it uses, so that it fits as few (the scheduler would stack more blocks
  // on some multiprocessors, leaving others idle). Where it cannot, the general kernel runs.
  // H100, bench.tree_ab against the queue's kernel on grids of at most one block a
  // multiprocessor alone, kernel alone, 3 rounds, seeds 15 / 5, bit-exact: budget 63 bs 133
  // 0.975 / 0.973x, 160-264 0.970-0.976x, 300 0.978 / 0.988x, 396 0.963 / 0.970x, 1024 0.965x;
  // budget 47 at bs 256 0.973 / 0.977x, 33 at bs 200 0.973 / 0.969x; bs 64 1.000x (the same
  // launch). Unpadded, at three blocks a multiprocessor where the roomy kernel fits two: bs
  // 133 0.957 / 0.965x, 160 0.961-0.973x, but bs 200-264 0.99-1.04x, budget 47 at bs 256
  // 1.04-1.05x.
  size_t bytes = p.bytes;
  bool queue_only = a.budget <= tree::par::kQueueMaxBudget && C.nfam >= a.budget;
  if (queue_only && a.bs > f->sms) {
    const int want = roomy ? roomy_fit : dense;
    const int qs = f->queue_static_smem[staged];
    const int fit = blocks_per_sm(*f, f->queue_regs[staged], qs, T, p.bytes);
    if (fit > want) bytes = bytes_for_blocks(*f, want, qs, p.bytes);
    queue_only = fit == want || (fit > want && bytes <= (size_t)f->limit);
    if (!queue_only) bytes = p.bytes;
  }
  const auto kernel = queue_only ? kQueueKernels[staged] : kKernels[staged][roomy];
  KDT_CUDA_CHECK(launch_pdl(kernel, a.bs, T, bytes, st, a, p.cap, twin, p.nord, C), fn);
  *launched = true;
  return KDT_OK;
}

}  // namespace kdt
