// verify_attention_sm90a_merge.cuh: the split-KV merge kernels of the sm_90a path: the chunks'
// partial states combined by LSE, merge_kernel (a warp a row, for a few splits) and
// merge_wide_kernel (a block a row quarter, for many). Included by verify_attention_sm90a.cu
// inside its kdt::sm90a anonymous namespace (uses its kDL, Params, KDT_SM90A_DEVICE and the
// merge_weight / merged_lse of attention_state.cuh); not a separate unit.
#pragma once

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
