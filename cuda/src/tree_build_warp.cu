// tree_build_warp.cu: the one-warp CUDA tree build (KDT_TREE_BUILD=warp, and auto up to
// tree::wrp::kAutoMaxBudget): tree_build_warp.h on a warp per request (one CTA per request up to
// bs 512, up to four requests per CTA beyond; up to bs 256 at budgets <= 31 the CTA has three
// more warps that help stage the inputs, then leave); no barrier during the build; the frontier in
// registers (S = 16 and 32 slots per lane for budgets 256..1023: 151 and 253 registers on
// sm_90). Budget 1024 runs the parallel build.
#include <cuda_runtime.h>

#include <cstdio>

#include "common.h"
#include "pdl.cuh"
#include "tree_build_core.h"
#include "tree_build_device.cuh"
#include "tree_build_warp.h"
#include "tree_kernels.h"

namespace kdt {
namespace {


template <int S>
struct GpuWarp {
  tree::wrp::Lane<S> x;
  int lane;
  template <class F>
  __device__ __forceinline__ void each(F f) { f(x, lane); }
  template <class F>
  __device__ __forceinline__ uint32_t max(F f) { return __reduce_max_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t min(F f) { return __reduce_min_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t ballot(F f) { return __ballot_sync(kFull, f(x, lane)); }
  template <class F>
  __device__ __forceinline__ uint32_t shfl(F f, int src) {
    return __shfl_sync(kFull, f(x, lane), src);
  }
  __device__ __forceinline__ void sync() { __syncwarp(); }
};

// Per-warp shared memory: node scores [n] (8 bytes), its root id and seq_len, then, up to budget
// 63, the nodes' visibility rows [n] (8 bytes: tree::wrp::WarpNodes::mask); node cands [n] (4),
// first_child and next_sibling [n] (2 each), then its log-probs as doubles when they take
// <= kWarpStageBytes, then its token ids when they take <= kWarpIdsBytes; rounded up to 8 bytes.
// At most 16 x 1024 + 16 KB = 32 KB a warp (the ids come only with small L K).
constexpr int kWarpStageBytes = 16 * 1024;
constexpr int kWarpIdsBytes = 8 * 1024;
__host__ __device__ size_t warp_stage_bytes(int L, int K) {
  const size_t b = (size_t)L * K * sizeof(double);
  return b <= (size_t)kWarpStageBytes ? b : 0;
}
__host__ __device__ size_t warp_ids_bytes(int L, int K) {
  const size_t b = (size_t)L * K * sizeof(int64_t);
  return b <= (size_t)kWarpIdsBytes ? b : 0;
}
__host__ __device__ size_t warp_smem_per(int budget, int L, int K) {
  const size_t n = (size_t)budget + 1;
  const size_t masks = budget <= tree::wrp::kMaskMaxBudget ? 8 * n : 0;
  return (16 * n + 16 + masks + warp_stage_bytes(L, K) + warp_ids_bytes(L, K) + 7) / 8 * 8;
}

// Copies src[0, count) (global) to dst (shared; float, or double: converted) with nt threads (a
// warp, or the whole CTA: thread `lane` of nt; the head and tail go to the first warp): 16-byte
// loads from src's first 16-byte boundary on (a scalar head and tail around them), all of a
// lane's loads in flight before its first store, so that up to 32 nt floats arrive in one
// round trip (the head and tail loaded with the first round; a store that waits on its load
// before the next load issues costs a round trip of its own).
template <class T>
__device__ void warp_stage(T* dst, const float* src, int count, int lane, int nt) {
  const int head = min(count, (int)(((16 - (reinterpret_cast<uintptr_t>(src) & 15)) & 15) >> 2));
  const int nv = (count - head) >> 2;
  const int tail = head + 4 * nv;
  const bool in_head = lane < head, in_tail = lane < count - tail;
  const float4* v = reinterpret_cast<const float4*>(src + head);
  for (int i0 = 0; i0 < nv || i0 == 0; i0 += 8 * nt) {
    float4 r[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + nt * k + lane;
      if (i < nv) r[k] = __ldg(v + i);
    }
    // The scalars after the vectors: their conversion waits for them, and the vectors' loads
    // are out by then.
    float h = 0.0f, t = 0.0f;
    if (i0 == 0) {
      if (in_head) h = __ldg(src + lane);
      if (in_tail) t = __ldg(src + tail + lane);
    }
    // Keeps every load above the first conversion (ptxas otherwise interleaves the last loads
    // with the first stores, which wait for the first loads: a second round trip).
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int i = i0 + nt * k + lane;
      if (i < nv) {
        T* d = dst + head + 4 * i;
        d[0] = r[k].x;
        d[1] = r[k].y;
        d[2] = r[k].z;
        d[3] = r[k].w;
      }
    }
    if (i0 == 0) {
      if (in_head) dst[lane] = h;
      if (in_tail) dst[tail + lane] = t;
    }
  }
}

// The warp writes one request's outputs: slots (lanes on consecutive slots), then visibility
// one row per lane: from the row built with the tree (mask, budget <= 63; rows beyond the used
// slots are zero), else a single ancestor walk (descending indices) that emits the row's words
// from the last down.
// Inlined: the caller passes ids in shared or global memory, and each copy then gathers with
// that space's loads.
__device__ __forceinline__ void warp_write_outputs(const TreeBuildArgs& a, int b, int n, int W,
                                                   int used, const uint32_t* node_cand,
                                                   const double* node_score, const int16_t* fc,
                                                   const int16_t* ns, const uint64_t* mask,
                                                   const int64_t* ids, int64_t root,
                                                   int64_t seq_len, int lane) {
  const size_t o = (size_t)b * n;
  for (int i = lane; i < n; i += 32)
    write_tree_slot(a, o, i, used, root, seq_len, node_cand, node_score, fc, ns, ids);
  uint32_t* vis = a.visibility + o * W;
  if (mask) {  // W <= 2
    for (int i = lane; i < n; i += 32) {
      const uint64_t r = i < used ? mask[i] : 0ull;
      vis[(size_t)i * W] = (uint32_t)r;
      if (W > 1) vis[(size_t)i * W + 1] = (uint32_t)(r >> 32);
    }
  } else {
    write_visibility_rows(vis, n, W, used, node_cand, lane, 32);
  }
  if (lane == 0) a.num_nodes[b] = used;
}

// kStaged: the log-probs are copied to shared memory as doubles (warp_stage_bytes > 0); a
// template argument so that the pops read them with shared loads (see
// tree_build_parallel_kernel).
// At most 80 registers a thread (__maxnreg__) instead of __launch_bounds__(128), which gave 72
// registers: the same source, another schedule of the pop loop. H200, bench.tree_ab, kernel
// alone, 4 rounds, seeds 15 and 5, against the library before (2026-12-05; a byte-identical
// copy of that library, loaded beside it, took 0.997-1.002x): bs 1 budgets 1-15 0.95-0.98x, 31
// 0.975-0.98x; bs 4 and 16 at 15 0.97x, bs 4 at 31 0.985x; bs 64 0.98x (15), 0.99x (31); bs 256
// 1.00x (15), 1.006-1.011x (31); bs 512 1.00x. Measured beside it and not kept: 72 (__maxnreg__)
// 0.96-1.00x, 88 0.96-1.03x, 64 spilled; eight helper warps (kWarpHelp 8, the same SASS as at
// 72 with four) took 1.00-1.04x against four; warp 1 writing each node's outputs as warp 0
// pops it (a release store of the pop count a pop, or every second one, warp 1 polling)
// 1.04-1.15x at every case. The cap is on S = 1 (budgets <= 31, auto's range) alone, in a
// kernel of its own (tree_build_warp1_kernel): the larger frontiers take up to 255 registers
// (S = 8..32 spill under a cap of 80), and __launch_bounds__(128) keeps their code as measured
// (__launch_bounds__(128, 1) or __maxnreg__(255) schedules S = 2..16 differently).
template <int S, bool kStaged>
__device__ __forceinline__ void warp_build(TreeBuildArgs a, int help) {
#if defined(KDT_PAR_PROFILE)
  // Development probes (bench/tree_profile.py --algo warp): lane 0 of each warp prints its
  // request's cycles waiting to start (60), in the prologue (61), the pops (62) and the
  // outputs (69, the end of a build), as "PROF request id cycles" lines.
  long long wt[5];
  wt[0] = clock64();
#endif
  pdl_enter();  // before any global access (pdl.cuh)
#if defined(KDT_PAR_PROFILE)
  wt[1] = clock64();
#endif
  extern __shared__ double smem[];
  // help > 1: one request a CTA of `help` warps, which all stage its inputs (kWarpHelp below);
  // then warp 0 builds alone. Else a request a warp.
  const int lane = threadIdx.x & 31;
  const int wr = help > 1 ? 0 : (int)(threadIdx.x >> 5);  // the request's warp slot in the CTA
  const int b = help > 1 ? (int)blockIdx.x : (int)(blockIdx.x * (blockDim.x >> 5)) + wr;
  if (b >= a.bs) return;  // whole warps (help > 1: the CTA) leave
  const int t = help > 1 ? (int)threadIdx.x : lane, nt = help > 1 ? (int)blockDim.x : 32;
  const int n = a.budget + 1, W = (n + 31) / 32;
  char* base = reinterpret_cast<char*>(smem) + (size_t)wr * warp_smem_per(a.budget, a.L, a.K);
  double* node_score = reinterpret_cast<double*>(base);
  int64_t* meta = reinterpret_cast<int64_t*>(node_score + n);  // root id, seq_len
  uint64_t* rows = reinterpret_cast<uint64_t*>(meta + 2);
  uint64_t* mask = a.budget <= tree::wrp::kMaskMaxBudget ? rows : nullptr;  // [n] when used
  uint32_t* node_cand = reinterpret_cast<uint32_t*>(mask ? rows + n : rows);
  int16_t* fc = reinterpret_cast<int16_t*>(node_cand + n);
  int16_t* ns = fc + n;
  const size_t lk = (size_t)a.L * a.K;
  const float* lp = a.top_logp + b * lk;
  const int64_t* ids = a.top_ids + b * lk;
  // Every global load of the prologue goes out before any of them is waited for: the root id
  // and seq_len (kept in shared memory over the build, not in registers), the token ids (into
  // shared memory when they fit, else into L1), the log-probs. Before, the root id's store, the
  // staging's head and its vectors each waited for a load in turn, and the outputs gathered the
  // token ids from L1 or L2 after the build. H200, bench.tree_ab, kernel alone, both launched
  // with PDL: 0.93-0.96x at budgets 15 and 31, bs 1-64; the outputs' phase at bs 1, budget 15
  // from 1187 to 960 cycles (KDT_PAR_PROFILE probes below). The staging phase stayed at ~2.7k
  // cycles there; a second pass over the same request in the same kernel (its data in L1, its
  // code cached) still took ~1.6k: the phase is mostly its ~390 instructions a lane, not the
  // round trip. (Two bulk copies instead, cp.async.bulk on an mbarrier, lane 0 issuing, the
  // lanes loading the sub-16-byte tails and converting the log-probs in shared memory
  // afterwards: about half the instructions, and the phase went from
  // 2.84k to 2.36k cycles at bs 1 and 2.88k to 2.04k at bs 64, budget 15; yet bench.tree_ab,
  // kernel alone, measured it 1.03-1.055x slower at bs 1, budgets 1-31, 1.00x at bs 64 and
  // 0.98-1.00x at bs 1024. Not kept. Three more, measured 2026-12-04 with bench.tree_ab
  // against this prologue, kernel alone, seeds 15 and 5, budgets 1-31, bs 1-1024, and the
  // KDT_PAR_PROFILE probes at bs 1, budget 15: the log-probs left in global memory, their lines
  // asked into L1 (prefetch) and read as floats by the pops: prologue 2.6k -> 1.4k cycles, but
  // the pops 5.3k -> 7.7k, 1.13-1.54x (budget 1 0.94x); the log-probs staged as floats by
  // cp.async (their own group, waited for before the pops; the token ids' after them), read and
  // converted by the pops: prologue 1.55k, pops 6.0k, 1.05-1.28x (budget 1 0.85-0.87x); only the
  // columns a build can read staged, ranks 0 .. min(K - 1, budget) (a quarter of them at budget
  // 15, K = 64), token ids likewise: the prologue did not shrink (2.9k cycles), 1.02-1.08x.)
  const int64_t m = t < 2 ? __ldg(t == 0 ? a.root_ids + b : a.seq_lens + b) : 0;
  double* staged = kStaged ? reinterpret_cast<double*>(ns + n) : nullptr;
  int64_t* sids = warp_ids_bytes(a.L, a.K)
                      ? reinterpret_cast<int64_t*>(reinterpret_cast<char*>(ns + n) +
                                                   warp_stage_bytes(a.L, a.K))
                      : nullptr;
  if (sids) ids_copy_async(sids, ids, (int)lk, t, nt);
  else if (t < 32) warp_prefetch_l1(ids, lk * sizeof(int64_t), lane);
  if (kStaged) warp_stage(staged, lp, (int)lk, t, nt);
  if (t < 2) meta[t] = m;
  if (sids) ids_wait();
  if (help > 1) {
    __syncthreads();
    if (t >= 32) return;  // the helpers only stage
  } else {
    __syncwarp();
  }
#if defined(KDT_PAR_PROFILE)
  wt[2] = clock64();
#endif
  tree::Scratch ks{};
  tree::set_key_layout(ks, a.L, a.K);
  GpuWarp<S> w;
  w.lane = lane;
  // Opaque to the compiler, so that the pops keep the lane in a register rather than read the
  // thread index again at every pop (an S2R on the reduction's operand).
  asm volatile("" : "+r"(w.lane));
  const tree::wrp::WarpNodes N{node_score, node_cand, fc, ns, mask};
  const int used =
      kStaged ? tree::wrp::build<S>(w, (const double*)staged, a.L, a.K, a.budget, ks.key_bits,
                                    ks.key_depth, N)
              : tree::wrp::build<S>(w, lp, a.L, a.K, a.budget, ks.key_bits, ks.key_depth, N);
#if defined(KDT_PAR_PROFILE)
  wt[3] = clock64();
#endif
  if (sids)  // two inlined copies, so that each gathers with its own address space's loads
    warp_write_outputs(a, b, n, W, used, node_cand, node_score, fc, ns, mask, sids, meta[0],
                       meta[1], lane);
  else
    warp_write_outputs(a, b, n, W, used, node_cand, node_score, fc, ns, mask, ids, meta[0],
                       meta[1], lane);
#if defined(KDT_PAR_PROFILE)
  __syncwarp();
  wt[4] = clock64();
  if (lane == 0)
    printf("PROF %d 60 %lld\nPROF %d 61 %lld\nPROF %d 62 %lld\nPROF %d 69 %lld\n", b,
           wt[1] - wt[0], b, wt[2] - wt[1], b, wt[3] - wt[2], b, wt[4] - wt[3]);
#endif
}

template <int S, bool kStaged>
__global__ void __launch_bounds__(128) tree_build_warp_kernel(TreeBuildArgs a, int help) {
  warp_build<S, kStaged>(a, help);
}

template <bool kStaged>
__global__ void __maxnreg__(80) tree_build_warp1_kernel(TreeBuildArgs a, int help) {
  warp_build<1, kStaged>(a, help);
}

template <int S>
void launch_warp(const TreeBuildArgs& a, int grid, int threads, int help, size_t smem,
                 cudaStream_t st) {
  const bool staged = warp_stage_bytes(a.L, a.K) != 0;
  if constexpr (S == 1) {
    if (staged)
      launch_pdl(tree_build_warp1_kernel<true>, grid, threads, smem, st, a, help);
    else
      launch_pdl(tree_build_warp1_kernel<false>, grid, threads, smem, st, a, help);
  } else if (staged) {
    launch_pdl(tree_build_warp_kernel<S, true>, grid, threads, smem, st, a, help);
  } else {
    launch_pdl(tree_build_warp_kernel<S, false>, grid, threads, smem, st, a, help);
  }
}

// Helper warps: up to bs kWarpHelpMaxBs and budget kWarpHelpMaxBudget, a request's CTA has
// kWarpHelp warps. All of them issue the prologue's loads and stage the log-probs and token ids
// (the prologue is mostly its instructions, ~390 a lane on one warp, not the round trip: see
// above), they meet at one barrier, and all but warp 0 leave: the pops and the outputs stay one
// warp's, with no barrier. The warp count is a kernel argument, not a template one, so that the
// helped and the unhelped launches run one kernel whose pops compile once.
// H200, bench.tree_ab against the one-warp CTA, kernel alone, 4 rounds (each library leading
// one), seeds 15 and 5 (2026-12-04): budgets 1-7 at bs 1 0.90-0.92x, budget 15 at bs 1-64
// 0.94-0.96x, budget 31 at bs 1-64 0.98-0.99x; bs 256 0.98x (15) and 1.00x (31); bs 512 0.98x
// and bs 1024 0.955x (unhelped: the same kernel with help 1). Of that, the helpers' own share is
// 1-4% at budgets 1-15 and ~4% at 31: the same kernel never helped (a build with kWarpHelp 1)
// took 0.92-0.98x at budgets 1-15 and 1.02-1.04x at 31 (its new code, or the library's own
// offset, which bench.tree_ab documents). Profile, bs 1, budget 15: prologue 2.60k -> 1.75k
// cycles, pops 5.07k -> 4.93k, outputs 1.06k -> 0.98k. Not kept:
//   - the warp count as a template argument (a kernel per count): ptxas scheduled the helped
//     kernel's pop loop differently (a diff of its ~1000 instructions against the one-warp
//     kernel's, registers aside, of 849 lines, against 233 here), and it measured 1.02-1.03x at
//     budget 31 where this measures 0.98-0.99x;
//   - the helpers staying on to write the outputs by part (a barrier after the pops; template
//     kernels): the pops 5.86k cycles against 5.07k, 1.04x at budget 15, 1.14-1.16x at 31, and
//     two warps a request slower than four;
//   - helpers at bs 512 (four CTAs an SM: the helpers take issue slots from other requests'
//     pops): 1.10-1.12x.
constexpr int kWarpHelp = 4;
constexpr int kWarpHelpMaxBs = 256;
constexpr int kWarpHelpMaxBudget = 31;

}  // namespace

kdt_status tree_build_warp_cuda(const TreeBuildArgs& a, void* stream) {
  static const char* fn = "kdt_tree_build";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  // One warp per CTA while the batch fits the device many times over (each request then has an
  // SM's issue slots to itself at small batches); up to 4 per CTA beyond, within the 48 KB of
  // shared memory that needs no opt-in.
  const size_t per = warp_smem_per(a.budget, a.L, a.K);
  int R = a.bs <= 512 ? 1 : 4;
  while (R > 1 && (size_t)R * per > 48 * 1024) --R;
  const int grid = (a.bs + R - 1) / R;
  const size_t smem = (size_t)R * per;
  const bool helped = R == 1 && a.bs <= kWarpHelpMaxBs && a.budget <= kWarpHelpMaxBudget;
  const int help = helped ? kWarpHelp : 1;
  const int threads = 32 * (help > 1 ? help : R);
  switch (tree::wrp::slots_for(a.budget)) {
    case 1: launch_warp<1>(a, grid, threads, help, smem, st); break;
    case 2: launch_warp<2>(a, grid, threads, help, smem, st); break;
    case 4: launch_warp<4>(a, grid, threads, help, smem, st); break;
    case 8: launch_warp<8>(a, grid, threads, help, smem, st); break;
    case 16: launch_warp<16>(a, grid, threads, help, smem, st); break;
    default: launch_warp<32>(a, grid, threads, help, smem, st); break;
  }
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
