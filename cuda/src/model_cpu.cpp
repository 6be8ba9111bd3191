// model_cpu.cpp: the FP32 forward pass of the DeepSeek-V3-style target on the CPU backend.
//
// Straight loops over the shapes in model.h. Every reduction (dot products, norms, softmax
// sums) runs in an order fixed by the reduced length alone, so a token's result does not depend
// on the batch it is in (engine.h, "Determinism").
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "common.h"
#include "engine.h"
#include "model_route_core.h"

namespace kdt {
namespace engine {
namespace {

using model::Config;
using model::HostModel;
using model::LayerWeights;

// Dot product in 8 interleaved partial sums combined in a fixed tree: vectorisable without
// -ffast-math and deterministic for a given n.
inline float dot(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  float tail = 0.f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// y [T, out] = x [T, in] @ W^T, W [out, in] (torch Linear layout). Output rows are split in
// blocks over the pool's threads when the product is large enough to pay for it.
void linear(ThreadPool* pool, const float* W, const float* x, float* y, int T, int in, int out) {
  constexpr int kRows = 16;
  auto rows = [&](int blk) {
    const int o1 = std::min(out, (blk + 1) * kRows);
    for (int o = blk * kRows; o < o1; ++o) {
      const float* w = W + size_t(o) * in;
      for (int t = 0; t < T; ++t) y[size_t(t) * out + o] = dot(w, x + size_t(t) * in, in);
    }
  };
  const int blocks = (out + kRows - 1) / kRows;
  if (pool && double(T) * out * in >= 65536.0) {
    pool->run(blocks, rows);
  } else {
    for (int blk = 0; blk < blocks; ++blk) rows(blk);
  }
}

// Runs fn(t) for t in [0, T): on the pool when there are several tokens.
void per_token(ThreadPool* pool, int T, const std::function<void(int)>& fn) {
  if (pool && T > 1) {
    pool->run(T, fn);
  } else {
    for (int t = 0; t < T; ++t) fn(t);
  }
}

// y [n] = x / sqrt(mean(x^2) + eps) * w; y may alias x.
void rmsnorm(const float* x, const float* w, float eps, int n, float* y) {
  float r = 1.0f / std::sqrt(dot(x, x, n) / float(n) + eps);
  for (int i = 0; i < n; ++i) y[i] = w[i] * (x[i] * r);
}

// Rotary embedding of one head's rope part x [R] at table row `pos`: interleaved pairs
// (x[2i], x[2i+1]) rotated by angle i, result kept interleaved (docs/MODEL.md; the cache
// stores k_pe in this layout).
void rope(const float* x, const HostModel& m, int64_t pos, float* out) {
  const int half = m.cfg.rope / 2;
  const float* c = m.cos_table.data() + size_t(pos) * half;
  const float* s = m.sin_table.data() + size_t(pos) * half;
  for (int i = 0; i < half; ++i) {
    float a = x[2 * i], b = x[2 * i + 1];
    out[2 * i] = a * c[i] - b * s[i];
    out[2 * i + 1] = a * s[i] + b * c[i];
  }
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Routed-expert choice for one token (DeepSeek-V3 noaux_tc): logits [E] -> idx [k], weight [k].
// Ties go to the lower expert index (deterministic).
void route(const Config& c, const float* logits, const float* bias, int* idx, float* weight) {
  const int E = c.n_routed, G = c.n_group, per = E / G;
  std::vector<float> score(E), choice(E);
  if (c.sigmoid_router) {
    for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    float m = *std::max_element(logits, logits + E), s = 0.f;
    for (int e = 0; e < E; ++e) s += (score[e] = std::exp(logits[e] - m));
    for (int e = 0; e < E; ++e) score[e] /= s;
  }
  for (int e = 0; e < E; ++e) choice[e] = score[e] + (bias ? bias[e] : 0.f);
  std::vector<char> allowed(E, 1);
  if (G > 1) {
    // Keep the topk_group best groups by group_score (model_route_core.h).
    std::vector<float> gscore(G);
    for (int g = 0; g < G; ++g) gscore[g] = model::group_score(choice.data() + g * per, per);
    std::vector<char> gkeep(G, 0);
    for (int r = 0; r < c.topk_group; ++r) {
      int best = -1;
      for (int g = 0; g < G; ++g)
        if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
      gkeep[best] = 1;
    }
    for (int e = 0; e < E; ++e) allowed[e] = gkeep[e / per];
  }
  std::vector<char> taken(E, 0);
  float wsum = 0.f;
  for (int r = 0; r < c.top_k; ++r) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (allowed[e] && !taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    taken[best] = 1;
    idx[r] = best;
    weight[r] = score[best];
    wsum += score[best];
  }
  for (int r = 0; r < c.top_k; ++r) {
    if (c.top_k > 1 && c.norm_topk) weight[r] /= (wsum + 1e-20f);
    weight[r] *= float(c.routed_scale);
  }
}

// SwiGLU FFN of one token: y [D] = down(silu(gate x) * up x), weights [F,D] [F,D] [D,F].
void swiglu(const float* gate, const float* up, const float* down, const float* x, int D, int F,
            float* act, float* y) {
  for (int i = 0; i < F; ++i) {
    const float g = dot(gate + size_t(i) * D, x, D), u = dot(up + size_t(i) * D, x, D);
    act[i] = silu(g) * u;
  }
  for (int o = 0; o < D; ++o) y[o] = dot(down + size_t(o) * F, act, F);
}

}  // namespace

kdt_status forward_cpu(Engine& e, const Batch& b) {
  const HostModel& m = e.model;
  const Config& c = m.cfg;
  const int T = b.total, D = c.hidden, H = c.heads, C = c.kv_lora, R = c.rope, N = c.nope,
            Dv = c.v_head, QH = c.q_head(), KD = c.kv_dim();
  const float eps = float(c.rms_eps), scale = float(c.softmax_scale);

  std::vector<float> x(size_t(T) * D), h(size_t(T) * D), q(size_t(T) * H * QH),
      qa(size_t(T) * std::max(c.q_lora, 1)), kva(size_t(T) * KD), o(size_t(T) * H * Dv),
      y(size_t(T) * D);
  ThreadPool* pool = e.pool.get();
  std::vector<int> req_of(T);
  for (int r = 0; r < b.n_req; ++r)
    for (int t = b.q_indptr[r]; t < b.q_indptr[r + 1]; ++t) req_of[t] = r;

  for (int t = 0; t < T; ++t)
    std::memcpy(&x[size_t(t) * D], m.embed + size_t(b.tokens[t]) * D, sizeof(float) * D);
  auto capture = [&](int k) {
    if (!b.hidden) return;
    for (int ci = 0; ci < b.n_capture; ++ci)
      if (b.capture[ci] == k)
        for (int t = 0; t < T; ++t)
          std::memcpy(b.hidden + (size_t(t) * b.n_capture + ci) * D, &x[size_t(t) * D],
                      sizeof(float) * D);
  };
  capture(0);

  for (int l = 0; l < c.layers; ++l) {
    const LayerWeights& w = m.layer[l];
    float* cache = e.kv[l].data();
    for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], w.in_norm, eps, D, &h[size_t(t) * D]);

    // Queries [T, H, N+R] and the joint latent projection [T, C+R].
    if (c.q_lora > 0) {
      linear(pool, w.q_a, h.data(), qa.data(), T, D, c.q_lora);
      for (int t = 0; t < T; ++t)
        rmsnorm(&qa[size_t(t) * c.q_lora], w.q_a_norm, eps, c.q_lora, &qa[size_t(t) * c.q_lora]);
      linear(pool, w.q_b, qa.data(), q.data(), T, c.q_lora, H * QH);
    } else {
      linear(pool, w.q_proj, h.data(), q.data(), T, D, H * QH);
    }
    linear(pool, w.kv_a, h.data(), kva.data(), T, D, KD);

    // Cache rows of this batch: c_kv = norm(latent), k_pe = rope(rope part), at P_b + node.
    for (int t = 0; t < T; ++t) {
      const int r = req_of[t], node = t - b.q_indptr[r];
      float* row = cache + (size_t(b.slots[r]) * e.max_seq + b.prefix[r] + node) * KD;
      rmsnorm(&kva[size_t(t) * KD], w.kv_a_norm, eps, C, row);
      rope(&kva[size_t(t) * KD + C], m, b.positions[t], row + C);
    }

    // Absorbed attention per (token, head) over the latent cache (all cache rows of the batch
    // are written above, before any token attends).
    per_token(pool, T, [&](int t) {
      thread_local std::vector<float> q_lat, q_pe, o_lat, scores, prob;
      thread_local std::vector<const float*> keys;
      q_lat.resize(C);
      q_pe.resize(R);
      o_lat.resize(C);
      scores.resize(e.max_seq);
      prob.resize(e.max_seq);
      keys.resize(e.max_seq);
      const int r = req_of[t], node0 = b.q_indptr[r], n_b = b.q_indptr[r + 1] - node0;
      const float* base = cache + size_t(b.slots[r]) * e.max_seq * KD;
      const uint32_t* vis = b.visibility + size_t(t) * b.vis_words;
      // Visible keys in position order: the committed prefix, then visible tree rows by index.
      int nk = 0;
      for (int j = 0; j < b.prefix[r]; ++j) keys[nk++] = base + size_t(j) * KD;
      for (int j = 0; j < n_b; ++j)
        if ((vis[j >> 5] >> (j & 31)) & 1u) keys[nk++] = base + size_t(b.prefix[r] + j) * KD;

      for (int hd = 0; hd < H; ++hd) {
        const float* qh = &q[(size_t(t) * H + hd) * QH];
        const float* kvb = w.kv_b + size_t(hd) * (N + Dv) * C;  // W_UK [N, C] then W_UV [Dv, C]
        // q_lat [C] = q_nope [N] @ W_UK [N, C], accumulated over n in order.
        std::fill(q_lat.begin(), q_lat.end(), 0.f);
        for (int n = 0; n < N; ++n) {
          const float qn = qh[n];
          const float* wk = kvb + size_t(n) * C;
          for (int cc = 0; cc < C; ++cc) q_lat[cc] += qn * wk[cc];
        }
        rope(qh + N, m, b.positions[t], q_pe.data());
        float mx = -INFINITY;
        for (int k = 0; k < nk; ++k) {
          scores[k] = (dot(q_lat.data(), keys[k], C) + dot(q_pe.data(), keys[k] + C, R)) * scale;
          mx = std::max(mx, scores[k]);
        }
        float sum = 0.f;
        for (int k = 0; k < nk; ++k) sum += (prob[k] = std::exp(scores[k] - mx));
        std::fill(o_lat.begin(), o_lat.end(), 0.f);
        for (int k = 0; k < nk; ++k) {
          const float p = prob[k];
          for (int cc = 0; cc < C; ++cc) o_lat[cc] += p * keys[k][cc];
        }
        for (int cc = 0; cc < C; ++cc) o_lat[cc] /= sum;
        // o [Dv] = W_UV [Dv, C] @ o_lat.
        for (int v = 0; v < Dv; ++v)
          o[(size_t(t) * H + hd) * Dv + v] = dot(kvb + size_t(N + v) * C, o_lat.data(), C);
      }
    });
    linear(pool, w.o_proj, o.data(), y.data(), T, H * Dv, D);
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];

    // FFN: dense SwiGLU, or routed experts (top-k order) plus the shared experts.
    for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], w.post_norm, eps, D, &h[size_t(t) * D]);
    if (!w.moe) {
      per_token(pool, T, [&](int t) {
        thread_local std::vector<float> act;
        act.resize(c.inter);
        swiglu(w.gate, w.up, w.down, &h[size_t(t) * D], D, c.inter, act.data(), &y[size_t(t) * D]);
      });
    } else {
      per_token(pool, T, [&](int t) {
        thread_local std::vector<float> logits, act, ye, weight;
        thread_local std::vector<int> idx;
        logits.resize(c.n_routed);
        act.resize(std::max(c.moe_inter, m.shared_inter));
        ye.resize(D);
        weight.resize(c.top_k);
        idx.resize(c.top_k);
        const float* ht = &h[size_t(t) * D];
        float* yt = &y[size_t(t) * D];
        for (int ex = 0; ex < c.n_routed; ++ex) logits[ex] = dot(w.router + size_t(ex) * D, ht, D);
        route(c, logits.data(), w.router_bias, idx.data(), weight.data());
        std::fill(yt, yt + D, 0.f);
        for (int k = 0; k < c.top_k; ++k) {
          const int ex = idx[k];
          swiglu(w.e_gate[ex], w.e_up[ex], w.e_down[ex], ht, D, c.moe_inter, act.data(), ye.data());
          for (int d = 0; d < D; ++d) yt[d] += weight[k] * ye[d];
        }
        if (w.gate) {
          swiglu(w.gate, w.up, w.down, ht, D, m.shared_inter, act.data(), ye.data());
          for (int d = 0; d < D; ++d) yt[d] += ye[d];
        }
      });
    }
    for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
    capture(l + 1);
  }

  // Final norm (its output is capture index layers + 1: what the drafters read) and LM head.
  for (int t = 0; t < T; ++t) rmsnorm(&x[size_t(t) * D], m.final_norm, eps, D, &x[size_t(t) * D]);
  capture(c.layers + 1);
  if (b.logits) linear(pool, m.lm_head, x.data(), b.logits, T, D, c.vocab);
  return KDT_OK;
}

kdt_status commit_cpu(Engine& e, int slot, int n_keep, const int32_t* keep) {
  const int KD = e.model.cfg.kv_dim(), P = e.seq_len[slot];
  std::vector<float> tmp(size_t(n_keep) * KD);
  for (auto& layer : e.kv) {
    float* base = layer.data() + (size_t(slot) * e.max_seq + P) * KD;
    // Read every kept row before writing any: destination k may be another kept row's source.
    for (int k = 0; k < n_keep; ++k)
      std::memcpy(&tmp[size_t(k) * KD], base + size_t(keep[k]) * KD, sizeof(float) * KD);
    std::memcpy(base, tmp.data(), sizeof(float) * KD * n_keep);
  }
  e.seq_len[slot] = P + n_keep;
  return KDT_OK;
}

}  // namespace engine
}  // namespace kdt
