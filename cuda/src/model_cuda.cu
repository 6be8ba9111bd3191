// model_cuda.cu: the FP32 forward pass of the target model on the CUDA backend.
//
// Simple kernels, one concept each (model_cuda_kernels.cuh: a warp per output dot product, a
// block per row norm, a block per (token, head) attention). Determinism (engine.h): every
// reduction has a fixed shape that depends only on the reduced length - warp dot products
// reduce lane-strided partial sums with a fixed butterfly, block reductions use a fixed block
// size - and attention indexes a query's keys by their rank among its visible keys (prefix
// rows, then visible tree rows), which is the same for a tree node and for the same token
// decoded autoregressively.
// Two paths. The host path (kdt_engine_forward / _commit) takes host pointers, copies in and out
// on the engine's own stream and synchronises before returning. The device path
// (kdt_engine_verify / _commit_accepted) takes device pointers and the caller's stream, reads
// the slots' lengths from the device, and neither synchronises nor allocates once its scratch
// is reserved, so that a CUDA graph can capture a whole decode round.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <vector>

#include "common.h"
#include "engine.h"
#include "model_cuda_kernels.cuh"

namespace kdt {
namespace engine {

using model::Config;
using model::HostModel;

// Device copies of a layer's weights (same fields as model::LayerWeights).
struct DevLayer {
  const float *in_norm, *post_norm, *q_a, *q_a_norm, *q_b, *q_proj, *kv_a, *kv_a_norm, *kv_b,
      *o_proj, *gate, *up, *down, *router, *router_bias;
  bool moe;
  const float** e_gate;  // device arrays of E device pointers
  const float** e_up;
  const float** e_down;
};

// A device buffer that grows on demand (contents not preserved). With `retired`, the old
// buffer is kept alive there instead of freed: a captured CUDA graph may still point at it.
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  cudaError_t reserve(size_t n, std::vector<void*>* retired = nullptr) {
    if (n <= bytes) return cudaSuccess;
    if (p) {
      if (retired) retired->push_back(p);
      else cudaFree(p);
    }
    p = nullptr;
    bytes = 0;
    cudaError_t e = cudaMalloc(&p, n);
    if (e == cudaSuccess) bytes = n;
    return e;
  }
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// Per-forward scratch. The host path and the device path have one each, so that a prefill
// never moves a buffer that a captured round points at; the device path's never frees one.
struct Scratch {
  DevBuf x, h, qa, q, kva, q_lat, q_pe, o_lat, o, scores, tree_list, act, act2, ye, ys, rlogits,
      ridx, rw, logits, hidden, tokens, positions, vis, meta, keep, tmp;
  bool keep_old = false;       // the device path's: retire, never free
  std::vector<void*> retired;
  void free_all() {
    for (DevBuf* b : {&x, &h, &qa, &q, &kva, &q_lat, &q_pe, &o_lat, &o, &scores, &tree_list,
                      &act, &act2, &ye, &ys, &rlogits, &ridx, &rw, &logits, &hidden, &tokens,
                      &positions, &vis, &meta, &keep, &tmp})
      if (b->p) cudaFree(b->p);
    for (void* p : retired) cudaFree(p);
    retired.clear();
  }
};

struct CudaState {
  cudaStream_t stream = nullptr;
  std::vector<void*> owned;  // every cudaMalloc of weights, tables, caches, pointer arrays
  std::map<const float*, const float*> dev_of;  // host tensor data -> device copy
  std::vector<DevLayer> layers;
  const float *embed = nullptr, *final_norm = nullptr, *lm_head = nullptr, *cos_t = nullptr,
              *sin_t = nullptr;
  std::vector<float*> kv;  // per layer [max_slots + 1, max_seq, KD]
  float** kv_ptrs = nullptr;  // device copy of kv
  int32_t* lengths = nullptr;  // [max_slots + 1] the slots' committed lengths (device path's)
  Scratch host, round;         // host path's, device path's (round.keep_old)
};

namespace {

const char* kFwd = "kdt_engine_forward";

kdt_status upload(CudaState& s, const void* host, size_t bytes, void** dev, const char* fn) {
  KDT_CUDA_CHECK(cudaMalloc(dev, bytes), fn);
  s.owned.push_back(*dev);
  count_sync();
  KDT_CUDA_CHECK(cudaMemcpy(*dev, host, bytes, cudaMemcpyHostToDevice), fn);
  return KDT_OK;
}

}  // namespace

kdt_status cuda_init(Engine& e) {
  const char* fn = "kdt_engine_create";
  const HostModel& m = e.model;
  const Config& c = m.cfg;
  if (c.n_routed > 256 || c.n_group > 64)
    return set_error(KDT_ERR_UNSUPPORTED, fn, "%s: n_routed_experts %d > 256 or n_group %d > 64 "
                     "is not supported by the CUDA router", m.dir.c_str(), c.n_routed, c.n_group);
  if (!c.sigmoid_router)
    return set_error(KDT_ERR_UNSUPPORTED, fn, "%s: scoring_func softmax is CPU-only", m.dir.c_str());
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    cudaGetLastError();
    return set_error(KDT_ERR_CUDA, fn, "no CUDA device is visible");
  }
  e.cuda = new CudaState();
  CudaState& s = *e.cuda;
  KDT_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), fn);
  for (const auto& kv : m.tensors) {
    void* d = nullptr;
    kdt_status st = upload(s, kv.second.data.data(), kv.second.data.size() * sizeof(float), &d, fn);
    if (st != KDT_OK) return st;
    s.dev_of[kv.second.data.data()] = static_cast<const float*>(d);
  }
  auto dev = [&](const float* hp) -> const float* {
    if (!hp) return nullptr;
    auto it = s.dev_of.find(hp);
    return it == s.dev_of.end() ? nullptr : it->second;
  };
  s.embed = dev(m.embed);
  s.final_norm = dev(m.final_norm);
  s.lm_head = dev(m.lm_head);
  void* d = nullptr;
  kdt_status st = upload(s, m.cos_table.data(), m.cos_table.size() * sizeof(float), &d, fn);
  if (st != KDT_OK) return st;
  s.cos_t = static_cast<const float*>(d);
  st = upload(s, m.sin_table.data(), m.sin_table.size() * sizeof(float), &d, fn);
  if (st != KDT_OK) return st;
  s.sin_t = static_cast<const float*>(d);
  for (const auto& w : m.layer) {
    DevLayer L{};
    L.in_norm = dev(w.in_norm); L.post_norm = dev(w.post_norm);
    L.q_a = dev(w.q_a); L.q_a_norm = dev(w.q_a_norm); L.q_b = dev(w.q_b); L.q_proj = dev(w.q_proj);
    L.kv_a = dev(w.kv_a); L.kv_a_norm = dev(w.kv_a_norm); L.kv_b = dev(w.kv_b);
    L.o_proj = dev(w.o_proj); L.gate = dev(w.gate); L.up = dev(w.up); L.down = dev(w.down);
    L.router = dev(w.router); L.router_bias = dev(w.router_bias);
    L.moe = w.moe;
    if (w.moe) {
      std::vector<const float*> g, u, dn;
      for (size_t x = 0; x < w.e_gate.size(); ++x) {
        g.push_back(dev(w.e_gate[x])); u.push_back(dev(w.e_up[x])); dn.push_back(dev(w.e_down[x]));
      }
      const size_t bytes = g.size() * sizeof(float*);
      if ((st = upload(s, g.data(), bytes, &d, fn)) != KDT_OK) return st;
      L.e_gate = static_cast<const float**>(d);
      if ((st = upload(s, u.data(), bytes, &d, fn)) != KDT_OK) return st;
      L.e_up = static_cast<const float**>(d);
      if ((st = upload(s, dn.data(), bytes, &d, fn)) != KDT_OK) return st;
      L.e_down = static_cast<const float**>(d);
    }
    s.layers.push_back(L);
  }
  const size_t per_layer = size_t(e.max_slots + 1) * e.max_seq * c.kv_dim() * sizeof(float);
  for (int l = 0; l < c.layers; ++l) {
    void* p = nullptr;
    if (cudaMalloc(&p, per_layer) != cudaSuccess) {
      cudaGetLastError();
      return set_error(KDT_ERR_OUT_OF_MEMORY, fn, "cannot allocate the KV cache: %d layers x "
                       "%zu bytes (max_slots %d x max_seq %d)", c.layers, per_layer, e.max_slots,
                       e.max_seq);
    }
    s.owned.push_back(p);
    KDT_CUDA_CHECK(cudaMemset(p, 0, per_layer), fn);
    s.kv.push_back(static_cast<float*>(p));
  }
  if ((st = upload(s, s.kv.data(), s.kv.size() * sizeof(float*), &d, fn)) != KDT_OK) return st;
  s.kv_ptrs = static_cast<float**>(d);
  if ((st = upload(s, e.seq_len.data(), e.seq_len.size() * sizeof(int32_t), &d, fn)) != KDT_OK)
    return st;
  s.lengths = static_cast<int32_t*>(d);
  s.round.keep_old = true;
  return KDT_OK;
}

void cuda_free(Engine& e) {
  CudaState* s = e.cuda;
  if (!s) return;
  count_sync();
  if (s->stream) cudaStreamSynchronize(s->stream);
  for (void* p : s->owned) cudaFree(p);
  s->host.free_all();
  s->round.free_all();
  if (s->stream) cudaStreamDestroy(s->stream);
  delete s;
  e.cuda = nullptr;
}

namespace {

// Scratch for T tokens (vis_words words of visibility per token, n_capture hidden states).
kdt_status reserve_scratch(Engine& e, Scratch& s, int T, int vis_words, int n_capture,
                           const char* fn) {
  const HostModel& m = e.model;
  const Config& c = m.cfg;
  const int D = c.hidden, H = c.heads, C = c.kv_lora, R = c.rope, Dv = c.v_head, QH = c.q_head(),
            KD = c.kv_dim(), K = c.top_k;
  const size_t f = sizeof(float);
  const int ffn_w = std::max({c.inter, m.shared_inter, 1});
  const int moe_w = std::max(K * c.moe_inter, 1);
  struct { DevBuf* buf; size_t bytes; } need[] = {
      {&s.x, size_t(T) * D * f}, {&s.h, size_t(T) * D * f},
      {&s.qa, size_t(T) * std::max(c.q_lora, 1) * f}, {&s.q, size_t(T) * H * QH * f},
      {&s.kva, size_t(T) * KD * f}, {&s.q_lat, size_t(T) * H * C * f},
      {&s.q_pe, size_t(T) * H * R * f}, {&s.o_lat, size_t(T) * H * C * f},
      {&s.o, size_t(T) * H * Dv * f}, {&s.scores, size_t(T) * H * e.max_seq * f},
      {&s.tree_list, size_t(T) * H * e.max_seq * sizeof(int)},
      {&s.act, size_t(T) * std::max(ffn_w, moe_w) * f}, {&s.act2, size_t(T) * ffn_w * f},
      {&s.ye, size_t(T) * std::max(K, 1) * D * f}, {&s.ys, size_t(T) * D * f},
      {&s.rlogits, size_t(T) * std::max(c.n_routed, 1) * f},
      {&s.ridx, size_t(T) * std::max(K, 1) * sizeof(int)}, {&s.rw, size_t(T) * std::max(K, 1) * f},
      {&s.logits, size_t(T) * c.vocab * f},
      {&s.hidden, size_t(T) * std::max(n_capture, 1) * D * f},
      {&s.tokens, size_t(T) * 8}, {&s.positions, size_t(T) * 8},
      {&s.vis, size_t(T) * std::max(vis_words, 1) * 4}, {&s.meta, size_t(T) * 4 * 4}};
  for (auto& n : need) {
    if (n.buf->bytes >= n.bytes) continue;
    cudaError_t err = n.buf->reserve(n.bytes, s.keep_old ? &s.retired : nullptr);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return set_error(KDT_ERR_OUT_OF_MEMORY, fn, "cannot allocate %zu bytes of scratch for %d "
                       "tokens: %s", n.bytes, T, cudaGetErrorString(err));
    }
  }
  return KDT_OK;
}

bool scratch_fits(const Engine& e, const Scratch& s, int T, int vis_words) {
  const Config& c = e.model.cfg;
  return s.logits.bytes >= size_t(T) * c.vocab * sizeof(float) &&
         s.scores.bytes >= size_t(T) * c.heads * e.max_seq * sizeof(float) &&
         s.x.bytes >= size_t(T) * c.hidden * sizeof(float) && s.meta.bytes >= size_t(T) * 16 &&
         s.vis.bytes >= size_t(T) * std::max(vis_words, 1) * 4 && s.tokens.bytes >= size_t(T) * 8;
}

// The layers, final norm and LM head over T tokens whose ids and metadata are on the device.
// capture (host array, n_capture entries) picks the hidden states written to hidden
// [T, n_capture, D]; logits [T, V] is written when non-null.
void run_layers(Engine& e, Scratch& s, int T, const TokenMeta& tm, const int64_t* tokens,
                int n_capture, const int32_t* capture_layers, float* hidden, float* logits,
                cudaStream_t st) {
  const HostModel& m = e.model;
  const Config& c = m.cfg;
  CudaState& cs = *e.cuda;
  const int D = c.hidden, H = c.heads, C = c.kv_lora, R = c.rope, N = c.nope, Dv = c.v_head,
            QH = c.q_head(), KD = c.kv_dim(), K = c.top_k;
  const float eps = float(c.rms_eps);
  float *x = s.x.as<float>(), *h = s.h.as<float>();
  auto linear = [&](const float* W, const float* in, float* out, int in_dim, int out_dim, int acc) {
    // A weight row read once per tile of tokens pays only for large batches (H200, tiny
    // model: 15% faster at 512 tokens, 20% slower at 16, where one warp per output keeps more
    // warps in flight).
    if (T >= kTiledFromTokens)
      linear_tiled_kernel<<<blocks_for_warps(long((T + kTile - 1) / kTile) * out_dim), kBlock, 0,
                            st>>>(W, in, out, T, in_dim, out_dim, acc);
    else
      linear_kernel<<<blocks_for_warps(long(T) * out_dim), kBlock, 0, st>>>(W, in, out, T, in_dim,
                                                                            out_dim, acc);
  };
  auto capture = [&](int k) {
    for (int ci = 0; ci < n_capture; ++ci)
      if (capture_layers[ci] == k)
        capture_kernel<<<blocks_for(long(T) * D), kBlock, 0, st>>>(x, hidden, T, D, n_capture, ci);
  };

  embed_kernel<<<T, 128, 0, st>>>(cs.embed, tokens, x, T, D);
  capture(0);
  for (int l = 0; l < c.layers; ++l) {
    const DevLayer& w = cs.layers[l];
    rmsnorm_kernel<<<T, kNormThreads, 0, st>>>(x, D, w.in_norm, h, D, D, eps);
    if (c.q_lora > 0) {
      linear(w.q_a, h, s.qa.as<float>(), D, c.q_lora, 0);
      rmsnorm_kernel<<<T, kNormThreads, 0, st>>>(s.qa.as<float>(), c.q_lora, w.q_a_norm,
                                                 s.qa.as<float>(), c.q_lora, c.q_lora, eps);
      linear(w.q_b, s.qa.as<float>(), s.q.as<float>(), c.q_lora, H * QH, 0);
    } else {
      linear(w.q_proj, h, s.q.as<float>(), D, H * QH, 0);
    }
    linear(w.kv_a, h, s.kva.as<float>(), D, KD, 0);
    kv_store_kernel<<<T, kNormThreads, 0, st>>>(s.kva.as<float>(), w.kv_a_norm, eps, C, R, tm,
                                                e.max_seq, cs.cos_t, cs.sin_t, cs.kv[l]);
    q_absorb_kernel<<<T * H, 128, 0, st>>>(s.q.as<float>(), w.kv_b, T, H, N, R, Dv, C, tm,
                                           cs.cos_t, cs.sin_t, s.q_lat.as<float>(), s.q_pe.as<float>());
    attention_kernel<<<T * H, kAttnThreads, 0, st>>>(s.q_lat.as<float>(), s.q_pe.as<float>(),
                                                     cs.kv[l], H, C, R, tm, e.max_seq,
                                                     float(c.softmax_scale), s.scores.as<float>(),
                                                     s.tree_list.as<int>(), s.o_lat.as<float>());
    uv_kernel<<<blocks_for_warps(long(T) * H * Dv), kBlock, 0, st>>>(w.kv_b, s.o_lat.as<float>(),
                                                                     s.o.as<float>(), T, H, N, Dv, C);
    linear(w.o_proj, s.o.as<float>(), x, H * Dv, D, 1);  // x += o_proj(o)

    rmsnorm_kernel<<<T, kNormThreads, 0, st>>>(x, D, w.post_norm, h, D, D, eps);
    const float* shared = nullptr;
    if (w.gate) {  // dense FFN, or the shared experts of an MoE layer
      const int F = w.moe ? m.shared_inter : c.inter;
      linear(w.gate, h, s.act.as<float>(), D, F, 0);
      linear(w.up, h, s.act2.as<float>(), D, F, 0);
      swiglu_act_kernel<<<blocks_for(long(T) * F), kBlock, 0, st>>>(
          s.act.as<float>(), s.act2.as<float>(), s.act.as<float>(), long(T) * F);
      if (!w.moe) {
        linear(w.down, s.act.as<float>(), x, F, D, 1);
      } else {
        linear(w.down, s.act.as<float>(), s.ys.as<float>(), F, D, 0);
        shared = s.ys.as<float>();
      }
    }
    if (w.moe) {
      linear(w.router, h, s.rlogits.as<float>(), D, c.n_routed, 0);
      route_kernel<<<blocks_for(T), kBlock, 0, st>>>(s.rlogits.as<float>(), w.router_bias, T,
                                                     c.n_routed, c.n_group, c.topk_group, K,
                                                     c.norm_topk ? 1 : 0, float(c.routed_scale),
                                                     s.ridx.as<int>(), s.rw.as<float>());
      moe_up_kernel<<<blocks_for_warps(long(T) * K * c.moe_inter), kBlock, 0, st>>>(
          w.e_gate, w.e_up, s.ridx.as<int>(), h, s.act.as<float>(), T, K, D, c.moe_inter);
      moe_down_kernel<<<blocks_for_warps(long(T) * K * D), kBlock, 0, st>>>(
          w.e_down, s.ridx.as<int>(), s.act.as<float>(), s.ye.as<float>(), T, K, D, c.moe_inter);
      moe_combine_kernel<<<blocks_for(long(T) * D), kBlock, 0, st>>>(
          s.ye.as<float>(), s.rw.as<float>(), shared, x, T, K, D);
    }
    capture(l + 1);
  }
  rmsnorm_kernel<<<T, kNormThreads, 0, st>>>(x, D, cs.final_norm, x, D, D, eps);
  capture(c.layers + 1);
  if (logits) linear(cs.lm_head, x, logits, D, c.vocab, 0);
}

}  // namespace

kdt_status forward_cuda(Engine& e, const Batch& b) {
  const char* fn = kFwd;
  CudaState& cs = *e.cuda;
  Scratch& s = cs.host;
  const Config& c = e.model.cfg;
  const int T = b.total, D = c.hidden;
  cudaStream_t st = cs.stream;
  const size_t f = sizeof(float);

  // Host-side per-token metadata: slot, prefix, node, n_b (int32 each, packed in one buffer).
  std::vector<int32_t> meta(size_t(4) * T);
  for (int r = 0; r < b.n_req; ++r)
    for (int t = b.q_indptr[r]; t < b.q_indptr[r + 1]; ++t) {
      meta[t] = b.slots[r];
      meta[T + t] = b.prefix[r];
      meta[2 * T + t] = t - b.q_indptr[r];
      meta[3 * T + t] = b.q_indptr[r + 1] - b.q_indptr[r];
    }
  kdt_status rs = reserve_scratch(e, s, T, b.vis_words, b.n_capture, fn);
  if (rs != KDT_OK) return rs;
  KDT_CUDA_CHECK(cudaMemcpyAsync(s.tokens.p, b.tokens, size_t(T) * 8, cudaMemcpyHostToDevice, st), fn);
  KDT_CUDA_CHECK(cudaMemcpyAsync(s.positions.p, b.positions, size_t(T) * 8, cudaMemcpyHostToDevice, st), fn);
  KDT_CUDA_CHECK(cudaMemcpyAsync(s.vis.p, b.visibility, size_t(T) * b.vis_words * 4, cudaMemcpyHostToDevice, st), fn);
  KDT_CUDA_CHECK(cudaMemcpyAsync(s.meta.p, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, st), fn);
  const int32_t* md = s.meta.as<int32_t>();
  TokenMeta tm{md, md + T, md + 2 * T, md + 3 * T, s.positions.as<int64_t>(),
               s.vis.as<uint32_t>(), b.vis_words};
  run_layers(e, s, T, tm, s.tokens.as<int64_t>(), b.n_capture, b.capture, s.hidden.as<float>(),
             b.logits ? s.logits.as<float>() : nullptr, st);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  if (b.logits)
    KDT_CUDA_CHECK(cudaMemcpyAsync(b.logits, s.logits.p, size_t(T) * c.vocab * f,
                                   cudaMemcpyDeviceToHost, st), fn);
  if (b.hidden && b.n_capture > 0)
    KDT_CUDA_CHECK(cudaMemcpyAsync(b.hidden, s.hidden.p, size_t(T) * b.n_capture * D * f,
                                   cudaMemcpyDeviceToHost, st), fn);
  count_sync();
  KDT_CUDA_CHECK(cudaStreamSynchronize(st), fn);
  return KDT_OK;
}

kdt_status verify_cuda(Engine& e, const RoundBatch& b) {
  const char* fn = "kdt_engine_verify";
  CudaState& cs = *e.cuda;
  Scratch& s = cs.round;
  const Config& c = e.model.cfg;
  const int T = b.n_req * b.n;
  cudaStream_t st = static_cast<cudaStream_t>(b.stream);
  if (!scratch_fits(e, s, T, b.vis_words)) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    KDT_CUDA_CHECK(cudaStreamIsCapturing(st, &cap), fn);
    if (cap != cudaStreamCaptureStatusNone)
      return set_error(KDT_ERR_INVALID_ARGUMENT, fn, "%d tokens need more scratch than was "
                       "reserved, inside a CUDA graph capture: call it once outside the capture "
                       "with the same shapes first", T);
    kdt_status rs = reserve_scratch(e, s, T, b.vis_words, 1, fn);
    if (rs != KDT_OK) return rs;
  }
  round_meta_kernel<<<blocks_for(T), kBlock, 0, st>>>(
      b.slots, cs.lengths, b.tokens, b.positions, b.n_req, b.n, e.max_slots, e.max_seq, c.vocab,
      s.meta.as<int32_t>(), s.tokens.as<int64_t>(), s.positions.as<int64_t>());
  const int32_t* md = s.meta.as<int32_t>();
  TokenMeta tm{md, md + T, md + 2 * T, md + 3 * T, s.positions.as<int64_t>(), b.visibility,
               b.vis_words};
  const int32_t final_norm = c.layers + 1;
  float* logits = b.logits ? b.logits : s.logits.as<float>();
  run_layers(e, s, T, tm, s.tokens.as<int64_t>(), b.hidden ? 1 : 0, &final_norm, b.hidden,
             logits, st);
  argmax_kernel<<<blocks_for_warps(T), kBlock, 0, st>>>(logits, b.tokens, T, c.vocab, b.argmax);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

kdt_status commit_accepted_cuda(Engine& e, const AcceptBatch& a) {
  const char* fn = "kdt_engine_commit_accepted";
  CudaState& cs = *e.cuda;
  Scratch& s = cs.round;
  const int KD = e.model.cfg.kv_dim(), layers = e.model.cfg.layers;
  cudaStream_t st = static_cast<cudaStream_t>(a.stream);
  const size_t need = size_t(layers) * a.n_req * a.n * KD * sizeof(float);
  if (s.tmp.bytes < need) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    KDT_CUDA_CHECK(cudaStreamIsCapturing(st, &cap), fn);
    if (cap != cudaStreamCaptureStatusNone)
      return set_error(KDT_ERR_INVALID_ARGUMENT, fn, "scratch for %d x %d rows was not reserved "
                       "before a CUDA graph capture: call it once outside the capture first",
                       a.n_req, a.n);
    if (s.tmp.reserve(need, &s.retired) != cudaSuccess) {
      cudaGetLastError();
      return set_error(KDT_ERR_OUT_OF_MEMORY, fn, "cannot allocate %zu bytes of scratch", need);
    }
  }
  dim3 grid(a.n_req * a.n, layers);
  // Two launches: every accepted row is read (into tmp) before any is written.
  accepted_rows_kernel<<<grid, 128, 0, st>>>(cs.kv_ptrs, a.slots, cs.lengths, a.accept_index,
                                             a.accept_len, a.n_req, a.n, e.max_slots, e.max_seq,
                                             KD, s.tmp.as<float>(), 0);
  accepted_rows_kernel<<<grid, 128, 0, st>>>(cs.kv_ptrs, a.slots, cs.lengths, a.accept_index,
                                             a.accept_len, a.n_req, a.n, e.max_slots, e.max_seq,
                                             KD, s.tmp.as<float>(), 1);
  lengths_add_kernel<<<blocks_for(a.n_req), kBlock, 0, st>>>(cs.lengths, a.slots, a.accept_len,
                                                             a.n_req, a.n, e.max_slots);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  e.host_lengths_stale = true;
  return KDT_OK;
}

int32_t* cuda_lengths(Engine& e) { return e.cuda->lengths; }

kdt_status lengths_to_host(Engine& e) {
  if (!e.host_lengths_stale) return KDT_OK;
  // The device path ran on the caller's stream: wait for all of it, then read the lengths.
  count_sync();
  KDT_CUDA_CHECK(cudaDeviceSynchronize(), "kdt_engine (lengths)");
  KDT_CUDA_CHECK(cudaMemcpy(e.seq_len.data(), e.cuda->lengths, e.seq_len.size() * sizeof(int32_t),
                            cudaMemcpyDeviceToHost), "kdt_engine (lengths)");
  e.host_lengths_stale = false;
  return KDT_OK;
}

kdt_status length_to_device(Engine& e, int slot) {
  count_sync();
  KDT_CUDA_CHECK(cudaMemcpy(e.cuda->lengths + slot, &e.seq_len[slot], sizeof(int32_t),
                            cudaMemcpyHostToDevice), "kdt_engine (lengths)");
  return KDT_OK;
}

kdt_status commit_cuda(Engine& e, int slot, int n_keep, const int32_t* keep) {
  const char* fn = "kdt_engine_commit";
  CudaState& cs = *e.cuda;
  Scratch& s = cs.host;
  const int KD = e.model.cfg.kv_dim(), layers = e.model.cfg.layers, P = e.seq_len[slot];
  if (n_keep > 0) {
    if (s.keep.reserve(size_t(n_keep) * 4) != cudaSuccess ||
        s.tmp.reserve(size_t(layers) * n_keep * KD * sizeof(float)) != cudaSuccess) {
      cudaGetLastError();
      return set_error(KDT_ERR_OUT_OF_MEMORY, fn, "cannot allocate compaction scratch");
    }
    KDT_CUDA_CHECK(cudaMemcpyAsync(s.keep.p, keep, size_t(n_keep) * 4, cudaMemcpyHostToDevice,
                                   cs.stream), fn);
    const size_t row0 = size_t(slot) * e.max_seq + P;
    dim3 grid(n_keep, layers);
    // Two launches: every kept row is read (into tmp) before any is written.
    gather_rows_kernel<<<grid, 128, 0, cs.stream>>>(cs.kv_ptrs, s.keep.as<int32_t>(),
                                                    s.tmp.as<float>(), row0, n_keep, KD);
    scatter_rows_kernel<<<grid, 128, 0, cs.stream>>>(cs.kv_ptrs, s.tmp.as<float>(), row0, n_keep, KD);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
    count_sync();
    KDT_CUDA_CHECK(cudaStreamSynchronize(cs.stream), fn);
  }
  e.seq_len[slot] = P + n_keep;
  return length_to_device(e, slot);
}

}  // namespace engine
}  // namespace kdt
