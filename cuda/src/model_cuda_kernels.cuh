// model_cuda_kernels.cuh: the CUDA kernels of the target model's forward pass (model_cuda.cu
// launches them): embedding, norms, linears, MLA attention over the latent cache, MoE routing and
// experts, and the round's cache and length bookkeeping. Determinism: model_cuda.cu's header.
// Included by model_cuda.cu alone (an unnamed namespace: nothing exported).
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>

#include "engine.h"
#include "model_route_core.h"

namespace kdt {
namespace engine {
namespace {

constexpr int kWarp = 32;
constexpr int kBlock = 256;  // threads per block of the warp-per-output kernels
constexpr int kNormThreads = 128;  // fixed: the norm reduction order depends on it
constexpr int kAttnThreads = 128;  // fixed: the softmax-sum reduction order depends on it

__device__ __forceinline__ float warp_sum(float s) {
  // Butterfly: every lane ends with the same value (float + is commutative).
  for (int off = 16; off; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

__device__ __forceinline__ float warp_dot(const float* a, const float* b, int n, int lane) {
  float s = 0.f;
  for (int k = lane; k < n; k += kWarp) s += a[k] * b[k];
  return warp_sum(s);
}

// Fixed-shape block sum over blockDim.x == NT threads (NT a power of two).
template <int NT>
__device__ float block_sum(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = NT / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  float r = red[0];
  __syncthreads();
  return r;
}

template <int NT>
__device__ float block_max(float v, float* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = NT / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  float r = red[0];
  __syncthreads();
  return r;
}

// x [T, D] = embed[tokens] ([V, D]).
__global__ void embed_kernel(const float* embed, const int64_t* tokens, float* x, int T, int D) {
  int t = blockIdx.x;
  for (int d = threadIdx.x; d < D; d += blockDim.x) x[size_t(t) * D + d] = embed[size_t(tokens[t]) * D + d];
}

// y [rows, n] (stride ys) = rms(x [rows, n] (stride xs)) * w; one block per row; y may alias x.
__global__ void rmsnorm_kernel(const float* x, int xs, const float* w, float* y, int ys, int n,
                               float eps) {
  __shared__ float red[kNormThreads];
  const float* xr = x + size_t(blockIdx.x) * xs;
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += kNormThreads) s += xr[i] * xr[i];
  const float r = rsqrtf(block_sum<kNormThreads>(s, red) / float(n) + eps);
  float* yr = y + size_t(blockIdx.x) * ys;
  for (int i = threadIdx.x; i < n; i += kNormThreads) yr[i] = w[i] * (xr[i] * r);
}

// y [T, out] (+)= x [T, in] @ W^T (W [out, in]); one warp per output element.
__global__ void linear_kernel(const float* W, const float* x, float* y, int T, int in, int out,
                              int accumulate) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= long(T) * out) return;
  const int t = int(warp / out), o = int(warp % out);
  float s = warp_dot(W + size_t(o) * in, x + size_t(t) * in, in, lane);
  if (lane == 0) {
    float* dst = y + size_t(t) * out + o;
    *dst = accumulate ? *dst + s : s;
  }
}

// The same product for a tile of kTile tokens per warp: the warp reads each weight row once
// per tile instead of once per token. Token t's sum has exactly warp_dot's order (lane-strided
// partial sums, the same butterfly), so results are bit-identical to linear_kernel's whatever
// the batch: DDTree verify and AR decoding keep computing the same rows.
constexpr int kTile = 8;
constexpr int kTiledFromTokens = 256;
__global__ void linear_tiled_kernel(const float* W, const float* x, float* y, int T, int in,
                                    int out, int accumulate) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  const long tiles = (T + kTile - 1) / kTile;
  if (warp >= tiles * out) return;
  const int t0 = int(warp / out) * kTile, o = int(warp % out);
  const int nt = T - t0 < kTile ? T - t0 : kTile;
  const float* w = W + size_t(o) * in;
  const float* xt = x + size_t(t0) * in;
  float s[kTile];
#pragma unroll
  for (int t = 0; t < kTile; ++t) s[t] = 0.f;
  for (int k = lane; k < in; k += kWarp) {
    const float wk = w[k];
#pragma unroll
    for (int t = 0; t < kTile; ++t)
      if (t < nt) s[t] += wk * xt[size_t(t) * in + k];
  }
#pragma unroll
  for (int t = 0; t < kTile; ++t) s[t] = warp_sum(s[t]);
  if (lane < nt) {
    float v = s[0];
#pragma unroll
    for (int t = 1; t < kTile; ++t) v = lane == t ? s[t] : v;
    float* dst = y + size_t(t0 + lane) * out + o;
    *dst = accumulate ? *dst + v : v;
  }
}

// Per-token metadata of a forward batch (device): cache row of token t is
//   cache + (slot[t] * max_seq + prefix[t] + node[t]) * KD.
struct TokenMeta {
  const int32_t* slot;
  const int32_t* prefix;
  const int32_t* node;
  const int32_t* n_req_tokens;  // n_b of the token's request
  const int64_t* positions;
  const uint32_t* vis;  // [T, vis_words]
  int vis_words;
};

__device__ __forceinline__ void rope_pair(const float* x, const float* cos_t, const float* sin_t,
                                          int64_t pos, int half, int i, float* out) {
  const float c = cos_t[size_t(pos) * half + i], s = sin_t[size_t(pos) * half + i];
  const float a = x[2 * i], b = x[2 * i + 1];
  out[2 * i] = a * c - b * s;
  out[2 * i + 1] = a * s + b * c;
}

// Cache rows of the batch: c_kv = rms(kva[:, :C]) and k_pe = rope(kva[:, C:]); block per token.
__global__ void kv_store_kernel(const float* kva, const float* norm_w, float eps, int C, int R,
                                TokenMeta m, int max_seq, const float* cos_t, const float* sin_t,
                                float* cache) {
  __shared__ float red[kNormThreads];
  const int t = blockIdx.x, KD = C + R;
  const float* src = kva + size_t(t) * KD;
  float* row = cache + (size_t(m.slot[t]) * max_seq + m.prefix[t] + m.node[t]) * KD;
  float s = 0.f;
  for (int i = threadIdx.x; i < C; i += kNormThreads) s += src[i] * src[i];
  const float r = rsqrtf(block_sum<kNormThreads>(s, red) / float(C) + eps);
  for (int i = threadIdx.x; i < C; i += kNormThreads) row[i] = norm_w[i] * (src[i] * r);
  for (int i = threadIdx.x; i < R / 2; i += kNormThreads)
    rope_pair(src + C, cos_t, sin_t, m.positions[t], R / 2, i, row + C);
}

// q_lat [T, H, C] = q_nope @ W_UK per head (sum over n in order); q_pe [T, H, R] = rope(q_pe).
__global__ void q_absorb_kernel(const float* q, const float* kv_b, int T, int H, int N, int R,
                                int Dv, int C, TokenMeta m, const float* cos_t, const float* sin_t,
                                float* q_lat, float* q_pe) {
  const int t = blockIdx.x / H, h = blockIdx.x % H;
  const float* qh = q + (size_t(t) * H + h) * (N + R);
  const float* wk = kv_b + size_t(h) * (N + Dv) * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float s = 0.f;
    for (int n = 0; n < N; ++n) s += qh[n] * wk[size_t(n) * C + c];
    q_lat[(size_t(t) * H + h) * C + c] = s;
  }
  for (int i = threadIdx.x; i < R / 2; i += blockDim.x)
    rope_pair(qh + N, cos_t, sin_t, m.positions[t], R / 2, i, q_pe + (size_t(t) * H + h) * R);
}

// Absorbed attention, block per (token, head): o_lat [T, H, C]. Scratch: scores and
// tree_list [T, H, max_seq] (the visible tree rows of the query; a prefill's can be long).
__global__ void attention_kernel(const float* q_lat, const float* q_pe, const float* cache, int H,
                                 int C, int R, TokenMeta m, int max_seq, float scale,
                                 float* scores, int* tree_list, float* o_lat) {
  __shared__ float red[kAttnThreads];
  __shared__ int n_tree;
  const int t = blockIdx.x / H, h = blockIdx.x % H, KD = C + R;
  const int P = m.prefix[t], n_b = m.n_req_tokens[t];
  const float* base = cache + size_t(m.slot[t]) * max_seq * KD;
  int* tree_rows = tree_list + (size_t(t) * H + h) * max_seq;
  if (threadIdx.x == 0) {  // visible tree rows in index order (= position order along a path)
    int cnt = 0;
    const uint32_t* v = m.vis + size_t(t) * m.vis_words;
    for (int j = 0; j < n_b; ++j)
      if ((v[j >> 5] >> (j & 31)) & 1u) tree_rows[cnt++] = P + j;
    n_tree = cnt;
  }
  __syncthreads();
  const int nk = P + n_tree;
  const float* ql = q_lat + (size_t(t) * H + h) * C;
  const float* qp = q_pe + (size_t(t) * H + h) * R;
  float* sc = scores + (size_t(t) * H + h) * max_seq;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, nw = kAttnThreads / kWarp;
  for (int k = warp; k < nk; k += nw) {
    const float* row = base + size_t(k < P ? k : tree_rows[k - P]) * KD;
    const float s = warp_dot(ql, row, C, lane) + warp_dot(qp, row + C, R, lane);
    if (lane == 0) sc[k] = s * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int k = threadIdx.x; k < nk; k += kAttnThreads) mx = fmaxf(mx, sc[k]);
  mx = block_max<kAttnThreads>(mx, red);
  float part = 0.f;
  for (int k = threadIdx.x; k < nk; k += kAttnThreads) {
    const float p = expf(sc[k] - mx);
    sc[k] = p;
    part += p;
  }
  const float sum = block_sum<kAttnThreads>(part, red);  // also orders the sc[] writes
  // sum >= 1 whenever a key is visible (the maximum contributes exp(0)); a padding node of the
  // device path on an empty slot sees none and gets zeros instead of 0 / 0.
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int c = threadIdx.x; c < C; c += kAttnThreads) {
    float acc = 0.f;
    for (int k = 0; k < nk; ++k) acc += sc[k] * base[size_t(k < P ? k : tree_rows[k - P]) * KD + c];
    o_lat[(size_t(t) * H + h) * C + c] = sum > 0.f ? acc / sum : acc * inv;
  }
}

// o [T, H*Dv] = W_UV[h] @ o_lat[t, h]; warp per output.
__global__ void uv_kernel(const float* kv_b, const float* o_lat, float* o, int T, int H, int N,
                          int Dv, int C) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= long(T) * H * Dv) return;
  const int t = int(warp / (H * Dv)), h = int(warp / Dv % H), v = int(warp % Dv);
  const float s = warp_dot(kv_b + (size_t(h) * (N + Dv) + N + v) * C,
                           o_lat + (size_t(t) * H + h) * C, C, lane);
  if (lane == 0) o[size_t(t) * H * Dv + size_t(h) * Dv + v] = s;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// act [n] = silu(g) * u elementwise.
__global__ void swiglu_act_kernel(const float* g, const float* u, float* act, long n) {
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) act[i] = silu(g[i]) * u[i];
}

// DeepSeek-V3 noaux_tc routing, one thread per token (same logic as model_cpu.cpp's route()).
__global__ void route_kernel(const float* logits, const float* bias, int T, int E, int G,
                             int topk_group, int top_k, int norm_topk, float routed_scale,
                             int* idx, float* weight) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float* lg = logits + size_t(t) * E;
  const int per = E / G;
  float score[256], choice[256];  // E <= 256 (checked on the host)
  bool allowed[256], taken[256];
  for (int e = 0; e < E; ++e) {
    score[e] = 1.0f / (1.0f + expf(-lg[e]));
    choice[e] = score[e] + (bias ? bias[e] : 0.f);
    allowed[e] = true;
    taken[e] = false;
  }
  if (G > 1) {
    float gscore[64];
    bool gkeep[64];
    for (int g = 0; g < G; ++g) {
      gscore[g] = model::group_score(choice + g * per, per);
      gkeep[g] = false;
    }
    for (int r = 0; r < topk_group; ++r) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
      gkeep[best] = true;
    }
    for (int e = 0; e < E; ++e) allowed[e] = gkeep[e / per];
  }
  float wsum = 0.f;
  for (int r = 0; r < top_k; ++r) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (allowed[e] && !taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    taken[best] = true;
    idx[t * top_k + r] = best;
    weight[t * top_k + r] = score[best];
    wsum += score[best];
  }
  for (int r = 0; r < top_k; ++r) {
    float w = weight[t * top_k + r];
    if (top_k > 1 && norm_topk) w /= (wsum + 1e-20f);
    weight[t * top_k + r] = w * routed_scale;
  }
}

// Routed experts, up half: act [T, k, Fm] = silu(gate_e x) * up_e x; warp per (t, k, i).
__global__ void moe_up_kernel(const float* const* e_gate, const float* const* e_up,
                              const int* idx, const float* h, float* act, int T, int k, int D,
                              int Fm) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= long(T) * k * Fm) return;
  const int i = int(warp % Fm), tk = int(warp / Fm), t = tk / k;
  const int e = idx[tk];
  const float* x = h + size_t(t) * D;
  const float g = warp_dot(e_gate[e] + size_t(i) * D, x, D, lane);
  const float u = warp_dot(e_up[e] + size_t(i) * D, x, D, lane);
  if (lane == 0) act[size_t(tk) * Fm + i] = silu(g) * u;
}

// Routed experts, down half: ye [T, k, D] = down_e act; warp per (t, k, o).
__global__ void moe_down_kernel(const float* const* e_down, const int* idx, const float* act,
                                float* ye, int T, int k, int D, int Fm) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= long(T) * k * D) return;
  const int o = int(warp % D), tk = int(warp / D);
  const float s = warp_dot(e_down[idx[tk]] + size_t(o) * Fm, act + size_t(tk) * Fm, Fm, lane);
  if (lane == 0) ye[size_t(tk) * D + o] = s;
}

// x [T, D] += (sum_k w[t,k] ye[t,k] in k order) + shared [T, D] (shared may be null).
__global__ void moe_combine_kernel(const float* ye, const float* w, const float* shared, float* x,
                                   int T, int k, int D) {
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= long(T) * D) return;
  const int t = int(i / D), d = int(i % D);
  float y = 0.f;
  for (int r = 0; r < k; ++r) y += w[t * k + r] * ye[(size_t(t) * k + r) * D + d];
  if (shared) y += shared[i];
  x[i] += y;
}

// hidden [T, n_capture, D] slot ci = x.
__global__ void capture_kernel(const float* x, float* hidden, int T, int D, int n_capture, int ci) {
  long i = long(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= long(T) * D) return;
  hidden[(size_t(i / D) * n_capture + ci) * D + i % D] = x[i];
}

// Compaction, both halves: tmp[l, k] = cache_l[slot, P + keep[k]], then cache_l[slot, P + k] = tmp.
__global__ void gather_rows_kernel(float* const* caches, const int32_t* keep, float* tmp,
                                   size_t row0, int n_keep, int KD) {
  const int l = blockIdx.y, k = blockIdx.x;
  const float* src = caches[l] + (row0 + keep[k]) * KD;
  for (int i = threadIdx.x; i < KD; i += blockDim.x) tmp[(size_t(l) * n_keep + k) * KD + i] = src[i];
}
__global__ void scatter_rows_kernel(float* const* caches, const float* tmp, size_t row0,
                                    int n_keep, int KD) {
  const int l = blockIdx.y, k = blockIdx.x;
  float* dst = caches[l] + (row0 + k) * KD;
  for (int i = threadIdx.x; i < KD; i += blockDim.x) dst[i] = tmp[(size_t(l) * n_keep + k) * KD + i];
}

// The device path's per-token metadata from device inputs: slot, prefix (the slot's length),
// node, n; tokens and positions made safe to index with (padding nodes: token 0 at position P).
__global__ void round_meta_kernel(const int32_t* slots, const int32_t* lengths,
                                  const int64_t* tokens, const int64_t* positions, int n_req,
                                  int n, int max_slots, int max_seq, int V, int32_t* meta,
                                  int64_t* tok_out, int64_t* pos_out) {
  const int T = n_req * n, t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= T) return;
  int s = slots[t / n];
  if (s < 0 || s > max_slots) s = max_slots;  // never index outside the cache
  int P = lengths[s];
  P = P < 0 ? 0 : (P > max_seq - n ? max_seq - n : P);  // the caller keeps P + n <= max_seq
  meta[t] = s;
  meta[T + t] = P;
  meta[2 * T + t] = t % n;
  meta[3 * T + t] = n;
  const int64_t tok = tokens[t], pos = positions[t];
  tok_out[t] = tok >= 0 && tok < V ? tok : 0;
  pos_out[t] = pos >= 0 && pos < max_seq ? pos : int64_t(P);
}

// out [T] = the first index of each row's maximum of logits [T, V] (np.argmax's choice), or -1
// where the node is padding (token < 0); one warp per row.
__global__ void argmax_kernel(const float* logits, const int64_t* tokens, int T, int V,
                              int64_t* out) {
  const long warp = (long(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (warp >= T) return;
  const float* row = logits + size_t(warp) * V;
  float best = -INFINITY;
  int bi = V;
  for (int k = lane; k < V; k += kWarp) {
    const float v = row[k];
    if (v > best || (v == best && k < bi)) { best = v; bi = k; }
  }
  for (int off = 16; off; off >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
    if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
  }
  if (lane == 0) out[warp] = tokens[warp] < 0 ? -1 : (bi < V ? bi : 0);
}

// Accepted rows of request b (grid: n_req * n blocks x layers): k-th accepted node's cache row
// P + accept_index[b, k] is read into tmp (gather), then written to row P + k (scatter).
__global__ void accepted_rows_kernel(float* const* caches, const int32_t* slots,
                                     const int32_t* lengths, const int32_t* acc_index,
                                     const int32_t* acc_len, int n_req, int n, int max_slots,
                                     int max_seq, int KD, float* tmp, int scatter) {
  const int b = blockIdx.x / n, k = blockIdx.x % n, l = blockIdx.y;
  const int s = slots[b];
  if (s < 0 || s >= max_slots || k >= acc_len[b]) return;
  const int src = acc_index[size_t(b) * n + k], P = lengths[s];
  if (src < 0 || src >= n || P + n > max_seq) return;
  float* cache = caches[l] + size_t(s) * max_seq * KD;
  float* t = tmp + ((size_t(l) * n_req + b) * n + k) * KD;
  if (!scatter) {
    for (int i = threadIdx.x; i < KD; i += blockDim.x) t[i] = cache[size_t(P + src) * KD + i];
  } else {
    for (int i = threadIdx.x; i < KD; i += blockDim.x) cache[size_t(P + k) * KD + i] = t[i];
  }
}

__global__ void lengths_add_kernel(int32_t* lengths, const int32_t* slots, const int32_t* acc_len,
                                   int n_req, int n, int max_slots) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= n_req) return;
  const int s = slots[b];
  if (s < 0 || s >= max_slots) return;
  const int len = acc_len[b];
  lengths[s] += len < 0 ? 0 : (len > n ? n : len);
}

unsigned blocks_for_warps(long warps) { return unsigned((warps * kWarp + kBlock - 1) / kBlock); }
unsigned blocks_for(long n) { return unsigned((n + kBlock - 1) / kBlock); }

}  // namespace
}  // namespace engine
}  // namespace kdt
