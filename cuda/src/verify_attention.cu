// verify_attention.cu: the CUDA backend of kdt_verify_attention (DDTREE.md section 6).
//
// Paths (VerifyPath, chosen per call by verify_attention_cuda; KDT_VERIFY_PATH forces one):
//   mma   bf16 caches at d_latent 512 / d_rope 64 (verify_attention_mma.cuh): a pipelined
//         mma.sync kernel over the request's whole cache (prefix and masked tree tail) per
//         split-KV chunk, plus an LSE merge kernel when there is more than one chunk.
//         Its launch configurations and split-KV chunking: verify_attention_mma_launch.cuh.
//   sm90a the wgmma kernel (verify_attention_sm90a.cu), auto's first choice on sm_90.
//   simt  any dtype and shape (the fp32 path and the reference for the others), below.
//
// SIMT: two kernels on the caller's stream, no host sync, grid sized from max_tree / max_kv
// only (graph-capturable; the index pointers are read on the device):
//   1. prefix pass (grid row_tiles x splits x bs): unmasked flash-decoding over one chunk of
//      the request's committed prefix; writes a normalised partial state (o / d, lse) per
//      (query, head) row and chunk into the workspace.
//   2. tree pass (grid row_tiles x 1 x bs): the masked pass over the request's n tree rows,
//      then the exact LSE merge with the request's prefix partials; writes out and lse.
// A block owns kRows = 16 consecutive (node, head) rows of one request (row = node * H + head)
// and streams the cache in 32-row tiles through shared memory (converted to fp32 once), so each
// tile is read from global memory once per block and used for all its rows: every head of a
// node and several nodes when H is small. MLA shares the latent row across heads, which is
// what makes this reuse possible.
//
// Inside a block: 8 warps x 2 rows. A lane holds its rows' query slice q[k = lane + 32 i]
// (18 registers per row for d_latent + d_rope <= 576) and output slice o[k = lane + 32 i]
// (16 per row for d_latent <= 512). Scores for a 32-row tile: each lane forms 32 partial dot
// products over its k slice, and a transpose-reduce (31 shuffles) leaves lane j with the full
// score of cache row j. Softmax statistics (kdt::SoftmaxState) are warp-uniform.
// Accumulation is fp32 throughout (dot products, d, o) with bf16 inputs converted exactly.
//
// nvcc 13.0 -O3 -Xptxas -v: SIMT kernels (prefix / tree pass) sm_90 233-237 / 253-255
// registers, sm_120 189-192 / 255, no spills, 1 block (8 warps) per SM; mma kernel 64 rows x 3
// stages x 32-row tiles (default on sm_90) / 64 x 4 x 16 (KDT_MMA_TILE=16) / 32 x 3 x 16
// (small) / 32 x 2 x 16 with query fragments in registers (smallq, sm_120's default): sm_90
// 240 / 228 / 227 / 254 registers, sm_120 214 / 170 / 168 / 254, no spills; merge kernel 38
// (sm_90) / 40 (sm_120).
//
// Measured on the H200 before the mma path (one run, Kimi K2 shape H 64, 512 + 64, tree 64,
// bs 1, L2 flushed): fp32 SIMT 2.55 ms at P 4096 (14.5 TFLOP/s), 19.8 ms at P 32768; the old
// bf16 tensor-core prefix kernel (hi + lo split of P, recomputed S) 0.62 / 4.41 ms (~60-66
// TFLOP/s, ~9% of the measured bf16 GEMM). First H200 run of the mma path (16-row tiles, CUDA
// graph): 125 TFLOP/s at bs 1 P 32k T 64, 154 at bs 64 P 32k T 64 (16-19% of the GEMM).
// With 32-row tiles (the sm_90 default; H200 run 20261201T052933Z, CUDA graph): 175 TFLOP/s at
// bs 1 P 32k T 64, 177 at bs 64 P 32k T 64 (22%); smallq 178-182. The sm90a path is 2.9x that.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "kdtree/attention_state.cuh"
#include "verify_attention.h"

namespace kdt {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 2;
constexpr int kRows = kWarps * kRowsPerWarp;  // rows per block
constexpr int kTile = VerifyAttentionPlan::kKvTile;
constexpr int kKPerLane = 18;  // (d_latent + d_rope) <= 576 = 18 * 32
constexpr int kVPerLane = 16;  // d_latent <= 512 = 16 * 32
constexpr unsigned kFull = 0xffffffffu;
static_assert(kRows == VerifyAttentionPlan::kRowsPerBlock, "plan and kernel disagree on rows");
static_assert(kTile == 32, "the transpose-reduce maps one cache row of a tile to one lane");

struct Params {
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const void* q_lat;
  const void* q_pe;
  const void* kv;
  const uint32_t* vis;
  float* out;
  float* lse;
  float* ws_o;    // [splits, total_q * H, d_latent]
  float* ws_lse;  // [splits, total_q * H]
  int32_t bs, H, dl, dr, dk, total_q, total_kv, max_tree, max_kv, vis_words;
  int64_t chunk, splits;
  float scale;
  bool vec;  // the cache pointer and row width allow 4-element vector loads
};

__device__ __forceinline__ float load_el(const float* p, int64_t i) { return __ldg(p + i); }
__device__ __forceinline__ float load_el(const uint16_t* p, int64_t i) {
  return bf16_bits_to_float(__ldg(p + i));
}

// Copies `count` consecutive cache elements starting at src into dst as fp32, zero-filling
// up to `total` (the whole tile) so that rows past the range never carry NaN into p * v.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* src, int64_t count, int64_t total,
                                          bool vec) {
  if (vec) {
    for (int64_t e = 4 * int64_t(threadIdx.x); e < total; e += 4 * kThreads) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (e < count) {
        if constexpr (sizeof(T) == 4) {
          v = __ldg(reinterpret_cast<const float4*>(src + e));
        } else {
          uint2 u = __ldg(reinterpret_cast<const uint2*>(src + e));
          v.x = __uint_as_float(u.x << 16);
          v.y = __uint_as_float(u.x & 0xffff0000u);
          v.z = __uint_as_float(u.y << 16);
          v.w = __uint_as_float(u.y & 0xffff0000u);
        }
      }
      *reinterpret_cast<float4*>(dst + e) = v;
    }
  } else {
    for (int64_t e = threadIdx.x; e < total; e += kThreads)
      dst[e] = e < count ? load_el(src, e) : 0.f;
  }
}

// One halving step of transpose_reduce: lanes whose bit kOff is set keep the upper half of
// v[0 .. 2 kOff), the others the lower half, and each adds the half its partner gave away.
template <int kOff>
__device__ __forceinline__ void transpose_step(float (&v)[32], int lane) {
  const bool upper = lane & kOff;
#pragma unroll
  for (int k = 0; k < kOff; ++k) {
    const float send = upper ? v[k] : v[k + kOff];
    const float keep = upper ? v[k + kOff] : v[k];
    v[k] = keep + __shfl_xor_sync(kFull, send, kOff);
  }
}
// v[0..31] are a lane's partial sums for 32 keys; returns, in lane j, the warp-wide sum for
// key j (31 shuffles instead of 32 x 5 for separate reductions).
__device__ __forceinline__ float transpose_reduce(float (&v)[32], int lane) {
  transpose_step<16>(v, lane);
  transpose_step<8>(v, lane);
  transpose_step<4>(v, lane);
  transpose_step<2>(v, lane);
  transpose_step<1>(v, lane);
  return v[0];
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x += __shfl_xor_sync(kFull, x, off);
  return x;
}

template <typename T, bool kTree>
__global__ void __launch_bounds__(kThreads) verify_attention_kernel(Params p) {
  extern __shared__ float kv_s[];  // [kTile, dk] fp32
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.z;
  const int64_t q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int64_t k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int64_t n = q1 - q0, kv_len = k1 - k0, P = kv_len - n;
  const int64_t H = p.H, dl = p.dl, dr = p.dr, dk = p.dk;
  const int64_t rows = n * H;
  const int64_t row_base = int64_t(blockIdx.x) * kRows;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  if (!valid) {
    // A broken index-pointer contract cannot be reported without a host sync: poison the
    // rows this block would own, where they are addressable, so the caller sees NaN.
    if (kTree && q0 >= 0 && q1 <= p.total_q && n > 0) {
      const float nan = __int_as_float(0x7fc00000);
      for (int64_t r = row_base + warp; r < min(rows, row_base + kRows); r += kWarps) {
        const int64_t g = q0 * H + r;
        for (int64_t k = lane; k < dl; k += 32) p.out[g * dl + k] = nan;
        if (lane == 0) p.lse[g] = nan;
      }
    }
    return;
  }
  if (row_base >= rows) return;  // uniform over the block: no barrier is skipped by some only
  int64_t begin, end;            // cache rows [begin, end) of the request, relative to k0
  if (kTree) {
    begin = P;
    end = kv_len;
  } else {
    begin = int64_t(blockIdx.y) * p.chunk;
    end = min(P, begin + p.chunk);
    if (begin >= end) return;
  }
  const T* q_lat = static_cast<const T*>(p.q_lat);
  const T* q_pe = static_cast<const T*>(p.q_pe);
  const T* kv = static_cast<const T*>(p.kv);

  // ---- this warp's rows: query slices in registers, empty states
  int64_t g[kRowsPerWarp];  // global (query, head) row, or -1
  int64_t node[kRowsPerWarp];
  float q[kRowsPerWarp][kKPerLane];
  float o[kRowsPerWarp][kVPerLane];
  SoftmaxState<float> st[kRowsPerWarp];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t r = row_base + warp * kRowsPerWarp + rr;
    g[rr] = r < rows ? q0 * H + r : -1;
    node[rr] = r / H;
    st[rr].init();
#pragma unroll
    for (int i = 0; i < kKPerLane; ++i) {
      const int64_t k = lane + 32 * i;
      float x = 0.f;
      if (g[rr] >= 0 && k < dl) x = load_el(q_lat, g[rr] * dl + k);
      else if (g[rr] >= 0 && k < dk) x = load_el(q_pe, g[rr] * dr + (k - dl));
      q[rr][i] = x;
    }
#pragma unroll
    for (int i = 0; i < kVPerLane; ++i) o[rr][i] = 0.f;
  }
  const bool any_row = g[0] >= 0;  // rows fill a warp in order: the first is valid if any is

  for (int64_t t0 = begin; t0 < end; t0 += kTile) {
    const int64_t tn = end - t0 < kTile ? end - t0 : int64_t(kTile);
    __syncthreads();  // the previous tile is consumed
    load_tile<T>(kv_s, kv + (k0 + t0) * dk, tn * dk, kTile * dk, p.vec);
    __syncthreads();
    if (!any_row) continue;

    // ---- scores of the tile: lane j ends with row rr's score for cache row t0 + j
    float s[kRowsPerWarp];
    {
      float part[kRowsPerWarp][32];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
        for (int j = 0; j < 32; ++j) part[rr][j] = 0.f;
#pragma unroll 18
      for (int i = 0; i < kKPerLane; ++i) {
        const int64_t k = lane + 32 * i;
        if (k < dk) {
#pragma unroll 32
          for (int j = 0; j < 32; ++j) {
            const float kvv = kv_s[j * dk + k];
#pragma unroll
            for (int rr = 0; rr < kRowsPerWarp; ++rr) part[rr][j] = fmaf(q[rr][i], kvv, part[rr][j]);
          }
        }
      }
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) s[rr] = transpose_reduce(part[rr], lane) * p.scale;
    }
    // ---- mask, online softmax update
    float pw[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      bool visible = g[rr] >= 0 && lane < tn;
      if (kTree && visible) {
        const uint32_t word =
            p.vis[(q0 + node[rr]) * p.vis_words + ((t0 - P) >> 5)];  // t0 - P is a multiple of 32
        visible = (word >> lane) & 1u;
      }
      const float sc = visible ? s[rr] : att_neg_inf<float>();
      const float f = st[rr].rescale(warp_max(sc));
      if (f != 1.f) {
#pragma unroll
        for (int i = 0; i < kVPerLane; ++i) o[rr][i] *= f;
      }
      pw[rr] = st[rr].weight(sc);
      st[rr].d += warp_sum(pw[rr]);
    }
    // ---- o += p . v over the tile (v = the latent part of each cache row)
    for (int j = 0; j < tn; ++j) {
      float pj[kRowsPerWarp];
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) pj[rr] = __shfl_sync(kFull, pw[rr], j);
#pragma unroll
      for (int i = 0; i < kVPerLane; ++i) {
        const int64_t k = lane + 32 * i;
        if (k < dl) {
          const float v = kv_s[j * dk + k];
#pragma unroll
          for (int rr = 0; rr < kRowsPerWarp; ++rr) o[rr][i] = fmaf(pj[rr], v, o[rr][i]);
        }
      }
    }
  }
  if (!any_row) return;

  const int64_t all_rows = int64_t(p.total_q) * H;
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    if (g[rr] < 0) continue;
    const float inv = st[rr].inv_d();
    const float lse_own = st[rr].lse();
    if (!kTree) {
      const int64_t slot = int64_t(blockIdx.y) * all_rows + g[rr];
#pragma unroll
      for (int i = 0; i < kVPerLane; ++i) {
        const int64_t k = lane + 32 * i;
        if (k < dl) p.ws_o[slot * dl + k] = o[rr][i] * inv;
      }
      if (lane == 0) p.ws_lse[slot] = lse_own;
      continue;
    }
    // ---- tree pass: merge with this request's prefix partials (kdt::merge_weight)
    const int64_t nsp = P > 0 ? (P + p.chunk - 1) / p.chunk : 0;
    float lmax = lse_own;
    for (int64_t sp = 0; sp < nsp; ++sp) lmax = fmaxf(lmax, p.ws_lse[sp * all_rows + g[rr]]);
    const float w_own = merge_weight(lse_own, lmax);
    float wsum = w_own;
    float acc[kVPerLane];
#pragma unroll
    for (int i = 0; i < kVPerLane; ++i) acc[i] = w_own * o[rr][i] * inv;
    for (int64_t sp = 0; sp < nsp; ++sp) {
      const int64_t slot = sp * all_rows + g[rr];
      const float w = merge_weight(p.ws_lse[slot], lmax);
      wsum += w;
#pragma unroll
      for (int i = 0; i < kVPerLane; ++i) {
        const int64_t k = lane + 32 * i;
        if (k < dl) acc[i] = fmaf(w, p.ws_o[slot * dl + k], acc[i]);
      }
    }
    const float winv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
    for (int i = 0; i < kVPerLane; ++i) {
      const int64_t k = lane + 32 * i;
      if (k < dl) p.out[g[rr] * dl + k] = acc[i] * winv;
    }
    if (lane == 0) p.lse[g[rr]] = merged_lse(lmax, wsum);
  }
}

#include "verify_attention_mma.cuh"

// Raises a kernel's dynamic shared-memory limit once per (kernel, device): cudaFuncSetAttribute
// is not a stream operation, and calling it only on first use keeps replays of a captured
// graph and steady-state calls free of it.
template <auto kKernel>
cudaError_t ensure_smem_limit(size_t bytes) {
  static std::atomic<uint64_t> done{0};  // one per kernel; bit d: set on device d (0..63)
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_relaxed);
  return e;
}

#include "verify_attention_mma_launch.cuh"

template <typename T>
kdt_status launch(const Params& prm, const VerifyAttentionPlan& plan, cudaStream_t stream) {
  constexpr const char* fn = "kdt_verify_attention";
  // The SIMT kernels' tile is sized for the largest supported row (576 floats): one limit
  // per kernel, whatever this call's d_latent + d_rope.
  const size_t smem = size_t(kTile) * size_t(prm.dk) * sizeof(float);
  constexpr size_t kSmemMax = size_t(kTile) * 32 * kKPerLane * sizeof(float);
  auto prefix_kernel = verify_attention_kernel<T, false>;
  auto tree_kernel = verify_attention_kernel<T, true>;
  const cudaError_t limit_prefix = ensure_smem_limit<verify_attention_kernel<T, false>>(kSmemMax);
  KDT_CUDA_CHECK(limit_prefix, fn);
  const cudaError_t limit_tree = ensure_smem_limit<verify_attention_kernel<T, true>>(kSmemMax);
  KDT_CUDA_CHECK(limit_tree, fn);
  const dim3 block(kThreads);
  if (plan.splits > 0) {
    const dim3 grid(unsigned(plan.row_tiles), unsigned(plan.splits), unsigned(prm.bs));
    prefix_kernel<<<grid, block, smem, stream>>>(prm);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
  }
  const dim3 grid(unsigned(plan.row_tiles), 1u, unsigned(prm.bs));
  tree_kernel<<<grid, block, smem, stream>>>(prm);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace

kdt_status verify_attention_cuda(const VerifyAttentionArgs& a, VerifyPath path, void* stream,
                                 void* workspace, size_t workspace_bytes) {
  constexpr const char* fn = "kdt_verify_attention";
  const auto plan = VerifyAttentionPlan::make(a.bs, a.num_heads, a.max_tree, a.max_kv);
  if (plan.splits > 65535 || a.bs > 65535 || plan.row_tiles > 0x7fffffff)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "grid too large for one launch (prefix splits %lld, bs %d, row tiles %lld)",
                     (long long)plan.splits, a.bs, (long long)plan.row_tiles);
  Params prm{};
  prm.q_indptr = a.q_indptr;
  prm.kv_indptr = a.kv_indptr;
  prm.q_lat = a.q_lat;
  prm.q_pe = a.q_pe;
  prm.kv = a.kv_cache;
  prm.vis = a.visibility;
  prm.out = a.out;
  prm.lse = a.lse;
  const size_t o_elems = size_t(plan.splits) * size_t(a.total_q) * size_t(a.num_heads) *
                         size_t(a.d_latent);
  prm.ws_o = static_cast<float*>(workspace);
  prm.ws_lse = workspace ? static_cast<float*>(workspace) + o_elems : nullptr;
  prm.bs = a.bs;
  prm.H = a.num_heads;
  prm.dl = a.d_latent;
  prm.dr = a.d_rope;
  prm.dk = a.d_latent + a.d_rope;
  prm.total_q = a.total_q;
  prm.total_kv = a.total_kv;
  prm.max_tree = a.max_tree;
  prm.max_kv = a.max_kv;
  prm.vis_words = a.vis_words;
  prm.chunk = plan.chunk > 0 ? plan.chunk : 1;
  prm.splits = plan.splits;
  prm.scale = a.softmax_scale;
  const size_t align = a.dtype == KDT_DTYPE_F32 ? 16 : 8;
  prm.vec = prm.dk % 4 == 0 && reinterpret_cast<uintptr_t>(a.kv_cache) % align == 0;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool bf16 = a.dtype == KDT_DTYPE_BF16;
  auto simt = [&] { return bf16 ? launch<uint16_t>(prm, plan, s) : launch<float>(prm, plan, s); };
  const char* why_not_mma = mma_unsupported(prm, bf16);
  switch (path) {
    case VerifyPath::kSimt:
      return simt();
    case VerifyPath::kMma:
      if (why_not_mma)
        return set_error(KDT_ERR_UNSUPPORTED, fn, "KDT_VERIFY_PATH=mma: the mma path cannot take "
                         "this call: %s", why_not_mma);
      return launch_mma(prm, s);
    case VerifyPath::kSm90a:
      return verify_attention_sm90a(a, stream, workspace, workspace_bytes);
    case VerifyPath::kCpu:
      return set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                       "KDT_VERIFY_PATH=cpu but the backend is KDT_BACKEND_CUDA (device arrays)");
    case VerifyPath::kAuto:
      break;
  }
  if (why_not_mma) return simt();
  int dev = 0, major = 0, minor = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), fn);
  if (major == 9 && minor == 0) {
    const kdt_status st = verify_attention_sm90a(a, stream, workspace, workspace_bytes);
    if (st != KDT_ERR_UNSUPPORTED) return st;
    clear_error();  // not built for sm_90a (or not this shape): the mma path takes it
  }
  return launch_mma(prm, s);
}

}  // namespace kdt
