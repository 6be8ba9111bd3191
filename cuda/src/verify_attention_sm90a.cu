// verify_attention_sm90a.cu: the Hopper (sm_90a) path of kdt_verify_attention: wgmma tensor
// cores fed by a TMA load pipeline, for bf16 caches at the MLA shape (d_latent 512, d_rope 64,
// any head count). Raw PTX (verify_attention_sm90a_ptx.cuh: wgmma.mma_async with shared-memory
// matrix descriptors, mbarrier, cp.async.bulk.tensor), no CUTLASS: nothing to vendor onto a
// host without internet, and a compile that stays short on small build machines.
//
// Work decomposition. Rows of request b are (node, head) pairs, row = node * H + head, so with
// 64 heads one M tile of 64 rows is one tree node. Grid (M tiles, splits, bs): a CTA owns one
// 64-row M tile of one request and one chunk of its key range [0, kv_len) (prefix then tree;
// at most VerifyAttentionPlan's split count, so the workspace query is shared with the other
// backends). With one split the CTA writes out / lse itself; with several it writes a
// normalised partial state (o / d, lse) into the workspace and a merge kernel combines the
// chunks by LSE (kdt::merge_weight / merged_lse of attention_state.cuh): a warp a row for a few
// splits, a block a (row, column quarter) with the splits spread over its warps for many (the
// AR step at bs 1). A chunk past a request's kv_len writes the empty state (lse = -inf).
//
// Inside a CTA: 3 warpgroups. WG0 is the producer: one thread streams 64-row cache tiles
// (64 x 576 bf16 = 72 KB) into a 2-stage ring, laid out as nine 64 x 64 column blocks in the
// 128-byte-swizzled form that wgmma reads: nine cp.async.bulk.tensor boxes a tile (tensor map
// encoded on the host per call, swizzle done by the TMA unit), each on its own mbarrier with an
// expect-tx arrive; the rest of the producer WG exits. The consumers wait for the whole tile.
// Rows past the chunk are other requests' rows (or zeros past the cache): the consumers zero
// them in V before P V reads them, so a non-finite value there cannot leak through 0 * NaN.
// WG1 and WG2 are the consumers. WG1 scores all 64 keys of a tile (S = Q K^T, wgmma m64n64k16
// x 36, Q and K both K-major from shared memory) and owns the softmax; it writes P = exp(S - m)
// as bf16 into a shared 64 x 64 tile and the per-row rescale factors beside it, and scores tile
// i + 1 while WG2 still multiplies P(i) V. WG w owns output columns [256 w, 256 w + 256)
// (O_w += P V_w: wgmma m64n256k16 x 4, P K-major, V = the first 512 columns of the same cache
// tile, MN-major). Each consumer WG holds a 64 x 256 fp32 accumulator (128 registers a thread);
// setmaxnreg gives the consumers 232 registers and the producer 40. The tree mask is applied
// only on tiles that reach the tree tail (or the chunk end); prefix keys are visible to every
// row. Scores are kept in base 2 (scale * log2 e) and the LSE converted back to the natural log.
//
// History: the H200 dev run of 2026-12-01 measured six variants of this kernel (tree 64,
// prefix 32k): cp.async loads by the whole producer WG with the two consumer WGs splitting the
// keys (v0) or with one scoring WG (v1), 290-305 TFLOP/s, load-bound; TMA loads with split keys
// (v2) 450; TMA with one scoring WG (v3) 500-512; TMA with Q K^T starting on the first three
// column blocks (v6 split keys, v7 one scorer) 458 / 505. All were correct; v3 was kept, and is
// the code below (its machine code unchanged by the removal of the others).
//
// nvcc 13.0 -O3 -Xptxas -v, sm_90a: 168 registers at entry (setmaxnreg then moves them to the
// consumers), no spills, 231584 B of dynamic shared memory, 1 CTA per SM.
//
// The sm_90a code exists only in the compute_90a pass (__CUDA_ARCH_FEAT_SM90_ALL); in the other
// passes the kernels are empty stubs, and the host entry returns KDT_ERR_UNSUPPORTED unless the
// device is compute capability 9.0 and the binary carries sm_90a code for it.
#include <cuda.h>  // CUtensorMap (the encode function comes through the runtime, no -lcuda)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "kdtree/attention_state.cuh"
#include "verify_attention_sm90a_ptx.cuh"
#include "verify_attention.h"

namespace kdt {
namespace sm90a {
namespace {

constexpr int kDL = 512, kDR = 64, kDK = kDL + kDR;  // the supported MLA shape
constexpr int kM = 64;                               // rows per CTA (one wgmma M)
constexpr int kN = 64;                               // cache rows per tile
constexpr int kBlocks = kDK / 64;                    // 9 column blocks of 64 bf16 (128 B)
constexpr int kBlockBytes = 64 * 128;                // one 64-row x 128 B block
constexpr int kTileBytes = kBlocks * kBlockBytes;    // 73728: Q tile and one cache stage
constexpr int kStages = 2;
constexpr int kThreads = 384;  // producer WG + 2 consumer WGs
// shared memory: Q | stages | P | rescale factors, row sums | mbarriers (+1 KB slack to align to
// 1 KB). The factor / sum area keeps the [2 (max, sum)][2 WGs][64 rows] size of the split-keys
// variant this file once had (only [0][0] and [1][*] are used), so that the offsets, and with
// them the kernel's machine code, stay those of the kernel that was measured.
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kTileBytes;
constexpr int kOffP = kOffKV + kStages * kTileBytes;
constexpr int kOffRed = kOffP + kM * 128;
constexpr int kOffBar = kOffRed + 2 * 2 * kM * 4;
constexpr int kSmemUsed = kOffBar + (kBlocks + 1) * kStages * 8;  // full [stage][block], empty
constexpr int kSmemBytes = kSmemUsed + 1024;
static_assert(kSmemBytes <= 232448, "over the 227 KB an sm_90 block may use");
static_assert(kN == 64 && kM == 64, "the wgmma shapes below assume 64-row tiles");

struct Params {
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const uint16_t* q_lat;  // [total_q * H, 512] bf16 bits
  const uint16_t* q_pe;   // [total_q * H, 64]
  const uint16_t* kv;     // [total_kv, 576]; unread (the TMA reads the cache through the tensor
                          // map), kept so that the parameter layout stays the measured kernel's
  const uint32_t* vis;
  float* out;
  float* lse;
  float* ws_o;    // [splits, total_q * H, 512]
  float* ws_lse;  // [splits, total_q * H]
  int32_t H, total_q, total_kv, max_tree, max_kv, vis_words;
  int64_t chunk, splits;
  float scale_log2;  // softmax_scale * log2(e)
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDT_SM90A_DEVICE 1
#endif

#if defined(KDT_SM90A_DEVICE)

// Zeroes rows [valid, 64) of a stage's V part (column blocks 0-7) with threads t of n: on a
// tile that the chunk ends inside, the TMA brought other requests' cache rows there, and P = 0
// times a non-finite value would still be NaN. The caller fences (proxy) and syncs before P V.
__device__ __forceinline__ void zero_tail_rows(uint8_t* stage, int valid, int t, int n) {
  const int count = (kN - valid) * 64;  // rows x 8 blocks x 8 chunks of 16 bytes
  for (int e = t; e < count; e += n) {
    const int r = valid + (e >> 6), blk = (e >> 3) & 7, c = e & 7;
    *reinterpret_cast<uint4*>(stage + blk * kBlockBytes + r * 128 + c * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// O *= the per-row factors (rows r0, r1 of this thread). Skipped, exactly, when no row of the
// warp changed its running max (every factor 1): after the first tiles of a long prefix that is
// most tiles, and it saves 128 multiplies a thread on the consumers' critical path.
__device__ __forceinline__ void rescale_o(float (&o)[128], float f0, float f1) {
  if (!__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) return;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j + 0] *= f0;
    o[4 * j + 1] *= f0;
    o[4 * j + 2] *= f1;
    o[4 * j + 3] *= f1;
  }
}

#endif  // KDT_SM90A_DEVICE

// The attention kernel (see the top of the file): producer WG0, consumers WG1 (scores, softmax)
// and WG2.
__global__ void __launch_bounds__(kThreads, 1)
    attention_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
#if defined(KDT_SM90A_DEVICE)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t s_base = smem_u32(smem);
  const uint32_t s_q = s_base + kOffQ, s_kv = s_base + kOffKV, s_p = s_base + kOffP;
  float* red = reinterpret_cast<float*>(smem + kOffRed);  // [2 (factor, sum)][2 WGs][64 rows]
  // full barrier of (stage s, column block b): bar_full + 8 (s kBlocks + b); each 64-column
  // block's TMA box completes on its own barrier.
  const uint32_t bar_full = s_base + kOffBar, bar_empty = bar_full + 8 * kStages * kBlocks;

  const int tid = threadIdx.x;
  const int b = blockIdx.z;
  const int64_t q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int64_t k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int64_t n = q1 - q0, kv_len = k1 - k0, P = kv_len - n;
  const int64_t H = p.H;
  const int64_t rows = n * H;
  const int64_t row_base = int64_t(blockIdx.x) * kM;
  const int64_t all_rows = int64_t(p.total_q) * H;
  const bool direct = p.splits == 1;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  if (!valid) {
    // A broken index-pointer contract cannot be reported without a host sync: poison the rows
    // this CTA would own, where addressable (the merge propagates a NaN partial).
    if (q0 >= 0 && q1 <= p.total_q && n > 0) {
      const float nan = __int_as_float(0x7fc00000);
      for (int64_t r = row_base; r < min(rows, row_base + kM); ++r) {
        const int64_t g = q0 * H + r;
        float* o = direct ? p.out + g * kDL : p.ws_o + (int64_t(blockIdx.y) * all_rows + g) * kDL;
        for (int k = tid; k < kDL; k += kThreads) o[k] = nan;
        if (tid == 0) (direct ? p.lse[g] : p.ws_lse[int64_t(blockIdx.y) * all_rows + g]) = nan;
      }
    }
    return;
  }
  if (row_base >= rows) return;  // uniform over the CTA
  const int64_t begin = int64_t(blockIdx.y) * p.chunk;
  const int64_t end = min(kv_len, begin + p.chunk);
  const int n_tiles = begin < end ? int((end - begin + kN - 1) / kN) : 0;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (int b = 0; b < kBlocks; ++b)  // one arrive + the transaction bytes
        mbar_init(bar_full + 8 * (s * kBlocks + b), 1);
      mbar_init(bar_empty + 8 * s, 256);  // every consumer thread arrives
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    // ============================== producer warpgroup
    setmaxnreg_dec<40>();
    // One thread streams the tiles: nine 64 x 64 boxes (one per 128-byte column block, the
    // tensor map swizzles them as wgmma reads them) on the stage's full barriers. Rows past the
    // cache are zero-filled by the TMA unit; rows past the chunk but inside the cache are other
    // requests' rows, zeroed by the consumers before P V reads them (zero_tail_rows).
    if (tid == 0) {
      for (int i = 0; i < n_tiles; ++i) {
        const int s = i % kStages;
        mbar_wait(bar_empty + 8 * s, ((i / kStages) & 1) ^ 1);
        const int32_t row = int32_t(k0 + begin + int64_t(i) * kN);
        const uint32_t dst0 = s_kv + s * kTileBytes;
#pragma unroll
        for (int blk = 0; blk < kBlocks; ++blk) {
          const uint32_t bar = bar_full + 8 * (s * kBlocks + blk);
          mbar_arrive_expect_tx(bar, kBlockBytes);
          tma_load_2d(dst0 + blk * kBlockBytes, &kv_map, blk * 64, row, bar);
        }
      }
    }
    return;
  }

  // ============================== consumer warpgroups
  setmaxnreg_inc<232>();
  const int ct = tid - 128;       // 0..255
  const int w = ct >> 7;          // consumer WG: 0 scores; each owns out cols [256 w, +256)
  const int t = ct & 127;
  const int lane = t & 31, warp = t >> 5;
  const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two rows of the tile
  const int q4 = lane & 3;

  // ---- Q tile [64 rows, 576] into shared memory (swizzled K-major), zero past the rows
  for (int e = ct; e < kM * 72; e += 256) {
    const int r = e / 72, c = e - r * 72;
    const int blk = c >> 3, cc = c & 7;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    const int64_t rr = row_base + r;
    if (rr < rows) {
      const int64_t g = q0 * H + rr;
      const uint16_t* src = c < 64 ? p.q_lat + g * kDL + c * 8 : p.q_pe + g * kDR + (c - 64) * 8;
      v = __ldg(reinterpret_cast<const uint4*>(src));
    }
    *reinterpret_cast<uint4*>(smem + kOffQ + blk * kBlockBytes + swz(r, cc)) = v;
  }
  fence_proxy_async();
  named_bar_sync(1, 256);

  // per-row state: rows r0, r1 (the running max lives in WG 0, which scores)
  const int64_t rg0 = row_base + r0, rg1 = row_base + r1;
  const int64_t node0 = rg0 / H, node1 = rg1 / H;
  const uint32_t* vis0 = p.vis + (q0 + min(node0, n - 1)) * p.vis_words;
  const uint32_t* vis1 = p.vis + (q0 + min(node1, n - 1)) * p.vis_words;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (base 2)
  float d0 = 0.f, d1 = 0.f;              // this thread's partial sums over its keys
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float* fac = red;               // [64]: the current tile's per-row rescale factors (w 0 -> w 1)
  float* red_sum = red + 2 * kM;  // [2][64]

  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % kStages;
    const int64_t t0 = begin + int64_t(i) * kN;
    const uint32_t st = s_kv + s * kTileBytes;
    const uint32_t full = bar_full + 8 * kBlocks * s, parity = (i / kStages) & 1;
    for (int b = 0; b < kBlocks; ++b) mbar_wait(full + 8 * b, parity);
    if (w == 0) {
      // ---- S = Q K^T for all 64 keys of the tile
      float sc[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) sc[k] = 0.f;
      reg_fence(sc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 36; ++ks) {
        const uint32_t koff = (ks >> 2) * kBlockBytes + (ks & 3) * 32;
        wgmma_m64n64_ss(sc, make_desc(s_q + koff, 16, 1024), make_desc(st + koff, 16, 1024),
                        ks > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(sc);
      if (t0 + kN > end) zero_tail_rows(smem + kOffKV + s * kTileBytes, int(end - t0), t, 128);
      const bool masked = t0 + kN > P || t0 + kN > end;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t kk = t0 + j * 8 + q4 * 2 + h;
          float x0 = sc[4 * j + h] * p.scale_log2;
          float x1 = sc[4 * j + 2 + h] * p.scale_log2;
          if (masked) {
            bool v0 = kk < end, v1 = kk < end;
            if (kk >= P && kk < end) {
              const int64_t tk = kk - P;
              v0 = (__ldg(vis0 + (tk >> 5)) >> (tk & 31)) & 1u;
              v1 = (__ldg(vis1 + (tk >> 5)) >> (tk & 31)) & 1u;
            }
            x0 = v0 ? x0 : -INFINITY;
            x1 = v1 ? x1 : -INFINITY;
          }
          sc[4 * j + h] = x0;
          sc[4 * j + 2 + h] = x1;
          mx0 = fmaxf(mx0, x0);
          mx1 = fmaxf(mx1, x1);
        }
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
      const float base0 = nm0 == -INFINITY ? 0.f : nm0;
      const float base1 = nm1 == -INFINITY ? 0.f : nm1;
      const float f0 = exp2f(m0 - base0), f1 = exp2f(m1 - base1);
      m0 = nm0;
      m1 = nm1;
      d0 *= f0;
      d1 *= f1;
      if (i > 0) named_bar_sync(2, 256);  // the other WG is done with P(i - 1) and its factors
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p00 = exp2f(sc[4 * j + 0] - base0), p01 = exp2f(sc[4 * j + 1] - base0);
        const float p10 = exp2f(sc[4 * j + 2] - base1), p11 = exp2f(sc[4 * j + 3] - base1);
        d0 += p00 + p01;
        d1 += p10 + p11;
        *reinterpret_cast<uint32_t*>(smem + kOffP + swz(r0, j) + q4 * 4) = pack_bf16(p00, p01);
        *reinterpret_cast<uint32_t*>(smem + kOffP + swz(r1, j) + q4 * 4) = pack_bf16(p10, p11);
      }
      if (q4 == 0) {
        fac[r0] = f0;
        fac[r1] = f1;
      }
      rescale_o(o, f0, f1);
      fence_proxy_async();
      named_bar_sync(1, 256);  // P(i) and the factors are in shared memory
    } else {
      named_bar_sync(1, 256);
      const float f0 = fac[r0], f1 = fac[r1];
      rescale_o(o, f0, f1);
    }
    // ---- O_w += P V_w
    reg_fence(o);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t da = make_desc(s_p + ks * 32, 16, 1024);
      const uint64_t db = make_desc(st + (4 * w) * kBlockBytes + ks * 16 * 128, kBlockBytes, 1024);
      wgmma_m64n256_ss_tb(o, da, db, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
    mbar_arrive(bar_empty + 8 * s);
    if (w == 1 && i + 1 < n_tiles) named_bar_arrive(2, 256);  // P(i) and factors consumed
  }

  // ---- epilogue: total row sums over both WGs' keys, normalise, write
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    d0 += __shfl_xor_sync(0xffffffffu, d0, off);
    d1 += __shfl_xor_sync(0xffffffffu, d1, off);
  }
  if (q4 == 0) {
    red_sum[w * kM + r0] = d0;
    red_sum[w * kM + r1] = d1;
  }
  named_bar_sync(1, 256);
  const float dt0 = red_sum[r0] + red_sum[kM + r0];
  const float dt1 = red_sum[r1] + red_sum[kM + r1];
  const float inv0 = dt0 > 0.f ? 1.f / dt0 : 0.f, inv1 = dt1 > 0.f ? 1.f / dt1 : 0.f;
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse0 = dt0 > 0.f ? m0 * kLn2 + logf(dt0) : -INFINITY;
  const float lse1 = dt1 > 0.f ? m1 * kLn2 + logf(dt1) : -INFINITY;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t rr = h == 0 ? rg0 : rg1;
    if (rr >= rows) continue;
    const int64_t g = q0 * H + rr;
    const float inv = h == 0 ? inv0 : inv1;
    float* orow = direct ? p.out + g * kDL : p.ws_o + (int64_t(blockIdx.y) * all_rows + g) * kDL;
    orow += 256 * w + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(orow + 8 * j) = make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    if (w == 0 && q4 == 0) {
      const float l = h == 0 ? lse0 : lse1;
      if (direct) p.lse[g] = l;
      else p.ws_lse[int64_t(blockIdx.y) * all_rows + g] = l;
    }
  }
#endif  // KDT_SM90A_DEVICE
}

// Merges the split partial states of every (query, head) row: one warp a row, 16 columns a lane.
__global__ void __launch_bounds__(256) merge_kernel(const Params p) {
#if defined(KDT_SM90A_DEVICE)
  const int64_t all_rows = int64_t(p.total_q) * p.H;
  const int64_t g = int64_t(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (g >= all_rows) return;
  float lmax = -INFINITY;
  bool nan = false;
  for (int64_t sp = 0; sp < p.splits; ++sp) {
    const float l = p.ws_lse[sp * all_rows + g];
    nan |= l != l;
    lmax = fmaxf(lmax, l);
  }
  float4 acc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int64_t sp = 0; sp < p.splits; ++sp) {
    const int64_t slot = sp * all_rows + g;
    const float wgt = merge_weight(p.ws_lse[slot], lmax);
    if (wgt == 0.f) continue;  // an empty chunk's o is not read
    wsum += wgt;
    const float4* src = reinterpret_cast<const float4*>(p.ws_o + slot * kDL);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = src[lane + 32 * i];
      acc[i].x = fmaf(wgt, v.x, acc[i].x);
      acc[i].y = fmaf(wgt, v.y, acc[i].y);
      acc[i].z = fmaf(wgt, v.z, acc[i].z);
      acc[i].w = fmaf(wgt, v.w, acc[i].w);
    }
  }
  const float winv = nan ? __int_as_float(0x7fc00000) : (wsum > 0.f ? 1.f / wsum : 0.f);
  float4* dst = reinterpret_cast<float4*>(p.out + g * kDL);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    dst[lane + 32 * i] = make_float4(acc[i].x * winv, acc[i].y * winv, acc[i].z * winv, acc[i].w * winv);
  if (lane == 0) p.lse[g] = nan ? __int_as_float(0x7fc00000) : merged_lse(lmax, wsum);
#endif
}

// The same merge for many splits (the AR step: one M tile a request, up to ~130 chunks), where
// one warp a row would walk the splits one dependent load after another on a handful of SMs: a
// block per (row, 128-column quarter), warp w taking splits w, w + 8, ..., a lane 4 columns; the
// eight warps' partial sums meet in shared memory.
constexpr int kWideWarps = 8;
__global__ void __launch_bounds__(256) merge_wide_kernel(const Params p) {
#if defined(KDT_SM90A_DEVICE)
  __shared__ float4 part[kWideWarps][32];
  __shared__ float wred[kWideWarps];
  __shared__ int wnan[kWideWarps];
  const int64_t all_rows = int64_t(p.total_q) * p.H;
  const int64_t g = blockIdx.x;
  const int quarter = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float lmax = -INFINITY;
  bool nan = false;
  for (int64_t sp = threadIdx.x; sp < p.splits; sp += 32 * kWideWarps) {
    const float l = p.ws_lse[sp * all_rows + g];
    nan |= l != l;
    lmax = fmaxf(lmax, l);
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffffu, lmax, off));
  nan = __any_sync(0xffffffffu, nan);
  if (lane == 0) {
    wred[warp] = lmax;
    wnan[warp] = nan ? 1 : 0;
  }
  __syncthreads();
  lmax = wred[0];
  int any_nan = wnan[0];
#pragma unroll
  for (int w = 1; w < kWideWarps; ++w) {
    lmax = fmaxf(lmax, wred[w]);
    any_nan |= wnan[w];
  }
  __syncthreads();  // wred is reused for the weight sums below
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
#pragma unroll 4
  for (int64_t sp = warp; sp < p.splits; sp += kWideWarps) {
    const int64_t slot = sp * all_rows + g;
    const float wgt = merge_weight(p.ws_lse[slot], lmax);
    const float4 v = wgt == 0.f ? make_float4(0.f, 0.f, 0.f, 0.f)  // an empty chunk's o is not read
                                : reinterpret_cast<const float4*>(p.ws_o + slot * kDL)[quarter * 32 + lane];
    wsum += wgt;
    acc.x = fmaf(wgt, v.x, acc.x);
    acc.y = fmaf(wgt, v.y, acc.y);
    acc.z = fmaf(wgt, v.z, acc.z);
    acc.w = fmaf(wgt, v.w, acc.w);
  }
  part[warp][lane] = acc;
  if (lane == 0) wred[warp] = wsum;
  __syncthreads();
  if (warp != 0) return;
  float4 a = part[0][lane];
  float ws = wred[0];
#pragma unroll
  for (int w = 1; w < kWideWarps; ++w) {
    const float4 b = part[w][lane];
    a.x += b.x;
    a.y += b.y;
    a.z += b.z;
    a.w += b.w;
    ws += wred[w];
  }
  const float winv = any_nan ? __int_as_float(0x7fc00000) : (ws > 0.f ? 1.f / ws : 0.f);
  reinterpret_cast<float4*>(p.out + g * kDL)[quarter * 32 + lane] =
      make_float4(a.x * winv, a.y * winv, a.z * winv, a.w * winv);
  if (quarter == 0 && lane == 0) p.lse[g] = any_nan ? __int_as_float(0x7fc00000) : merged_lse(lmax, ws);
#endif
}

// Whether this binary carries the sm_90a kernel for the current device: the sm_90 / sm_120
// cubins hold only the empty stub (a handful of registers), the sm_90a one the real kernel
// (over a hundred). cudaFuncGetAttributes reports the cubin the driver picked, without a sync,
// so this is safe under stream capture. Cached per process (one kind of GPU per process).
bool have_sm90a_code() {
  static std::atomic<int> cached{-1};  // -1 unknown, 0 no, 1 yes
  int c = cached.load(std::memory_order_relaxed);
  if (c >= 0) return c == 1;
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, attention_kernel);
  if (e != cudaSuccess) (void)cudaGetLastError();  // no image for this device: not sticky, clear it
  const bool ok = e == cudaSuccess && attr.binaryVersion == 90 && attr.numRegs >= 64;
  cached.store(ok ? 1 : 0, std::memory_order_relaxed);
  return ok;
}

// Key-range splits for `base` CTAs per split (M tiles x requests) on `sms` multiprocessors, at
// most the plan's count (the workspace is sized by the plan): the count whose waves x (tiles a
// CTA streams + its fixed cost: Q load, epilogue; more with a partial state to write and merge)
// is least. One CTA per SM (224 KB of shared memory each).
int64_t choose_splits(const VerifyAttentionPlan& plan, int64_t base, int32_t max_kv, int sms) {
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t s = 1; s <= plan.splits; ++s) {
    const int64_t chunk = ((int64_t(max_kv) + s - 1) / s + kN - 1) / kN * kN;
    const int64_t used = (int64_t(max_kv) + chunk - 1) / chunk;
    if (used != s) continue;  // the same split as a smaller count
    const int64_t waves = (base * s + sms - 1) / sms;
    const int64_t cost = waves * (chunk / kN + (s > 1 ? 3 : 1));
    if (cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda at link time);
// null when the driver does not offer it. Looked up once per process.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// The cache [total_kv, 576] bf16 as a 2-D tensor of 64 x 64 boxes (128 bytes wide, swizzled
// the way the K-major / MN-major wgmma descriptors read them); rows past total_kv read as zero.
bool encode_kv_map(CUtensorMap* map, const void* kv, int32_t total_kv) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {cuuint64_t(kDK), cuuint64_t(total_kv)};
  const cuuint64_t strides[1] = {cuuint64_t(kDK) * 2};
  const cuuint32_t box[2] = {64, kN};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(kv), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
}  // namespace sm90a

kdt_status verify_attention_sm90a(const VerifyAttentionArgs& a, void* stream, void* workspace,
                                  size_t workspace_bytes) {
  using namespace sm90a;
  constexpr const char* fn = "kdt_verify_attention";
  if (a.dtype != KDT_DTYPE_BF16 || a.d_latent != kDL || a.d_rope != kDR)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path supports bf16 caches with d_latent 512 and d_rope 64 "
                     "(got dtype %d, %d + %d)",
                     int(a.dtype), a.d_latent, a.d_rope);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(a.q_lat) || !aligned(a.q_pe) || !aligned(a.kv_cache) || !aligned(a.out) ||
      (workspace != nullptr && !aligned(workspace)))
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs 16-byte aligned q_lat, q_pe, kv_cache, out and workspace");
  int dev = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  int major = 0, minor = 0;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), fn);
  if (major != 9 || minor != 0)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs a compute capability 9.0 device (this one is %d.%d)",
                     major, minor);
  if (!have_sm90a_code())
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "this build has no sm_90a code (build with --arch sm_90a,...)");
  const auto plan = VerifyAttentionPlan::make(a.bs, a.num_heads, a.max_tree, a.max_kv);
  if (plan.splits == 0) return KDT_OK;  // max_kv == 0: no cache rows, so no query rows either
  const int64_t m_tiles = (int64_t(a.max_tree) * a.num_heads + kM - 1) / kM;
  if (plan.splits > 65535 || a.bs > 65535 || m_tiles > 0x7fffffff)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "grid too large for one launch (splits %lld, bs %d, M tiles %lld)",
                     (long long)plan.splits, a.bs, (long long)m_tiles);
  int sms = 132;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn);
  const int64_t splits = choose_splits(plan, m_tiles * a.bs, a.max_kv, sms);
  const int64_t chunk = (int64_t(a.max_kv) + splits - 1) / splits;
  const int64_t chunk_tiled = (chunk + kN - 1) / kN * kN;
  const size_t need = plan.workspace_bytes(a.total_q, a.num_heads, a.d_latent);
  if (splits > 1 && (workspace == nullptr || workspace_bytes < need))
    return set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                     "workspace_bytes = %zu is below the %zu bytes the split prefix needs",
                     workspace_bytes, need);
  Params prm{};
  prm.q_indptr = a.q_indptr;
  prm.kv_indptr = a.kv_indptr;
  prm.q_lat = static_cast<const uint16_t*>(a.q_lat);
  prm.q_pe = static_cast<const uint16_t*>(a.q_pe);
  prm.kv = static_cast<const uint16_t*>(a.kv_cache);
  prm.vis = a.visibility;
  prm.out = a.out;
  prm.lse = a.lse;
  const size_t o_elems = size_t(plan.splits) * size_t(a.total_q) * size_t(a.num_heads) * kDL;
  prm.ws_o = static_cast<float*>(workspace);
  prm.ws_lse = workspace ? static_cast<float*>(workspace) + o_elems : nullptr;
  prm.H = a.num_heads;
  prm.total_q = a.total_q;
  prm.total_kv = a.total_kv;
  prm.max_tree = a.max_tree;
  prm.max_kv = a.max_kv;
  prm.vis_words = a.vis_words;
  prm.chunk = chunk_tiled;
  prm.splits = (int64_t(a.max_kv) + chunk_tiled - 1) / chunk_tiled;
  prm.scale_log2 = a.softmax_scale * 1.4426950408889634f;
  static std::atomic<uint64_t> smem_set{0};
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (!bit || !(smem_set.load(std::memory_order_relaxed) & bit)) {
    KDT_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                   fn);
    smem_set.fetch_or(bit, std::memory_order_relaxed);
  }
  CUtensorMap map;
  std::memset(&map, 0, sizeof map);
  if (!encode_kv_map(&map, a.kv_cache, a.total_kv))
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs cuTensorMapEncodeTiled, which this driver did not give "
                     "(or it refused the cache's tensor map)");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(unsigned(m_tiles), unsigned(prm.splits), unsigned(a.bs));
  attention_kernel<<<grid, kThreads, kSmemBytes, s>>>(prm, map);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  if (prm.splits > 1) {
    const int64_t all_rows = int64_t(a.total_q) * a.num_heads;
    if (prm.splits > kWideWarps && all_rows <= 0x7fffffff)
      merge_wide_kernel<<<dim3(unsigned(all_rows), 4), 32 * kWideWarps, 0, s>>>(prm);
    else
      merge_kernel<<<unsigned((all_rows + 7) / 8), 256, 0, s>>>(prm);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
  }
  return KDT_OK;
}

}  // namespace kdt
