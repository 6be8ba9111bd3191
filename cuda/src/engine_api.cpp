// engine_api.cpp: the engine's C entry points (kdtree.h, "engine"): argument checks, then the
// CPU backend (model_cpu.cpp) or the CUDA backend (model_cuda.cu).
#include <algorithm>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "common.h"
#include "engine.h"

struct kdt_engine {
  kdt::engine::Engine impl;
};

namespace kdt {
namespace engine {

Engine::~Engine() {
#if defined(KDT_WITH_CUDA)
  if (cuda) cuda_free(*this);
#endif
}

}  // namespace engine
}  // namespace kdt

using kdt::engine::AcceptBatch;
using kdt::engine::Batch;
using kdt::engine::Engine;
using kdt::engine::RoundBatch;

namespace {

// Host-path calls read the slots' lengths on the host: refresh them after device-path rounds.
kdt_status host_lengths(Engine& e) {
#if defined(KDT_WITH_CUDA)
  if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::lengths_to_host(e);
#endif
  (void)e;
  return KDT_OK;
}

}  // namespace

extern "C" {

kdt_status kdt_engine_create(kdt_backend backend, const char* weights_dir, int32_t max_slots,
                             int32_t max_seq, kdt_engine** out) {
  const char* fn = "kdt_engine_create";
  KDT_CHECK_PTR(out, fn);
  *out = nullptr;
  KDT_CHECK_PTR(weights_dir, fn);
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend %d is neither KDT_BACKEND_CPU (0) nor KDT_BACKEND_CUDA (1)", int(backend));
  KDT_CHECK_ARG(max_slots >= 1 && max_slots <= 4096, fn, "max_slots %d is outside [1, 4096]",
                int(max_slots));
  KDT_CHECK_ARG(max_seq >= 2 && max_seq <= (1 << 20), fn, "max_seq %d is outside [2, 2^20]",
                int(max_seq));
#if !defined(KDT_WITH_CUDA)
  if (backend == KDT_BACKEND_CUDA) return kdt::cuda_unsupported(fn);
#endif
  kdt_engine* h = nullptr;
  try {
    h = new kdt_engine();
    Engine& e = h->impl;
    e.backend = backend;
    e.max_slots = max_slots;
    e.max_seq = max_seq;
    kdt_status st = kdt::model::load_model(weights_dir, max_seq, &e.model);
    if (st != KDT_OK) {
      delete h;
      return st;
    }
    e.seq_len.assign(size_t(max_slots) + 1, 0);  // + the device path's scratch slot
    if (backend == KDT_BACKEND_CPU) {
      const size_t per_layer = size_t(max_slots + 1) * max_seq * e.model.cfg.kv_dim();
      e.kv.assign(e.model.cfg.layers, std::vector<float>(per_layer, 0.f));
      e.pool.reset(new kdt::engine::ThreadPool(kdt::engine::ThreadPool::default_threads()));
    }
#if defined(KDT_WITH_CUDA)
    if (backend == KDT_BACKEND_CUDA) {
      st = kdt::engine::cuda_init(e);
      if (st != KDT_OK) {
        delete h;
        return st;
      }
    }
#endif
  } catch (const std::bad_alloc&) {
    delete h;
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn,
                          "out of host memory (max_slots %d x max_seq %d KV cache)",
                          int(max_slots), int(max_seq));
  }
  *out = h;
  return KDT_OK;
}

void kdt_engine_destroy(kdt_engine* engine) { delete engine; }

kdt_status kdt_engine_dim(const kdt_engine* engine, const char* name, int64_t* value) {
  const char* fn = "kdt_engine_dim";
  KDT_CHECK_PTR(engine, fn);
  KDT_CHECK_PTR(name, fn);
  KDT_CHECK_PTR(value, fn);
  const Engine& e = engine->impl;
  const auto& c = e.model.cfg;
  const std::string n = name;
  if (n == "vocab_size") *value = c.vocab;
  else if (n == "hidden_size") *value = c.hidden;
  else if (n == "num_hidden_layers") *value = c.layers;
  else if (n == "kv_dim") *value = c.kv_dim();
  else if (n == "max_slots") *value = e.max_slots;
  else if (n == "max_seq") *value = e.max_seq;
  else if (n == "backend") *value = e.backend;
  else
    return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                          "name '%s' is not one of vocab_size, hidden_size, num_hidden_layers, "
                          "kv_dim, max_slots, max_seq, backend", name);
  return KDT_OK;
}

kdt_status kdt_engine_seq_len(kdt_engine* engine, int32_t slot, int32_t* len) {
  const char* fn = "kdt_engine_seq_len";
  KDT_CHECK_PTR(engine, fn);
  KDT_CHECK_PTR(len, fn);
  KDT_CHECK_ARG(slot >= 0 && slot < engine->impl.max_slots, fn, "slot %d is outside [0, %d)",
                int(slot), engine->impl.max_slots);
  kdt_status st = host_lengths(engine->impl);
  if (st != KDT_OK) return st;
  *len = engine->impl.seq_len[slot];
  return KDT_OK;
}

kdt_status kdt_engine_reset_slot(kdt_engine* engine, int32_t slot) {
  const char* fn = "kdt_engine_reset_slot";
  KDT_CHECK_PTR(engine, fn);
  KDT_CHECK_ARG(slot >= 0 && slot < engine->impl.max_slots, fn, "slot %d is outside [0, %d)",
                int(slot), engine->impl.max_slots);
  Engine& e = engine->impl;
  kdt_status st = host_lengths(e);
  if (st != KDT_OK) return st;
  e.seq_len[slot] = 0;
#if defined(KDT_WITH_CUDA)
  if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::length_to_device(e, slot);
#endif
  return KDT_OK;
}

kdt_status kdt_engine_forward(kdt_engine* engine, int32_t n_req, const int32_t* slots,
                              const int32_t* q_indptr, const int64_t* tokens,
                              const int64_t* positions, const uint32_t* visibility,
                              int32_t vis_words, int32_t n_capture, const int32_t* capture_layers,
                              float* logits, float* hidden) {
  const char* fn = "kdt_engine_forward";
  KDT_CHECK_PTR(engine, fn);
  Engine& e = engine->impl;
  const auto& c = e.model.cfg;
  KDT_CHECK_ARG(n_req >= 1 && n_req <= e.max_slots, fn, "n_req %d is outside [1, max_slots %d]",
                int(n_req), e.max_slots);
  KDT_CHECK_PTR(slots, fn);
  KDT_CHECK_PTR(q_indptr, fn);
  KDT_CHECK_PTR(tokens, fn);
  KDT_CHECK_PTR(positions, fn);
  KDT_CHECK_PTR(visibility, fn);
  KDT_CHECK_ARG(n_capture >= 0, fn, "n_capture %d is negative", int(n_capture));
  KDT_CHECK_ARG(n_capture == 0 || (capture_layers && hidden), fn,
                "n_capture %d needs capture_layers and hidden", int(n_capture));
  for (int i = 0; i < n_capture; ++i)
    KDT_CHECK_ARG(capture_layers[i] >= 0 && capture_layers[i] <= c.layers + 1, fn,
                  "capture_layers[%d] = %d is outside [0, num_hidden_layers + 1 = %d]", i,
                  int(capture_layers[i]), c.layers + 1);
  KDT_CHECK_ARG(q_indptr[0] == 0, fn, "q_indptr[0] = %d, expected 0", int(q_indptr[0]));
  kdt_status lst = host_lengths(e);
  if (lst != KDT_OK) return lst;
  std::vector<int32_t> prefix(n_req);
  std::vector<char> seen(e.max_slots, 0);
  int max_tree = 0;
  for (int r = 0; r < n_req; ++r) {
    const int s = slots[r];
    KDT_CHECK_ARG(s >= 0 && s < e.max_slots, fn, "slots[%d] = %d is outside [0, %d)", r, s,
                  e.max_slots);
    KDT_CHECK_ARG(!seen[s], fn, "slots[%d] = %d appears twice in one batch", r, s);
    seen[s] = 1;
    const int n_b = q_indptr[r + 1] - q_indptr[r];
    KDT_CHECK_ARG(n_b >= 1, fn, "request %d has %d tokens (q_indptr[%d] = %d, q_indptr[%d] = %d)",
                  r, n_b, r, int(q_indptr[r]), r + 1, int(q_indptr[r + 1]));
    prefix[r] = e.seq_len[s];
    KDT_CHECK_ARG(prefix[r] + n_b <= e.max_seq, fn,
                  "request %d (slot %d): %d committed + %d new rows exceed max_seq %d", r, s,
                  prefix[r], n_b, e.max_seq);
    max_tree = std::max(max_tree, n_b);
  }
  const int total = q_indptr[n_req];
  KDT_CHECK_ARG(vis_words >= (max_tree + 31) / 32, fn,
                "vis_words %d < ceil(largest request %d / 32)", int(vis_words), max_tree);
  for (int r = 0; r < n_req; ++r) {
    const int n_b = q_indptr[r + 1] - q_indptr[r];
    for (int i = 0; i < n_b; ++i) {
      const int t = q_indptr[r] + i;
      KDT_CHECK_ARG(tokens[t] >= 0 && tokens[t] < c.vocab, fn,
                    "tokens[%d] = %lld is outside [0, vocab_size %d)", t, (long long)tokens[t],
                    c.vocab);
      KDT_CHECK_ARG(positions[t] >= 0 && positions[t] < e.max_seq, fn,
                    "positions[%d] = %lld is outside [0, max_seq %d)", t, (long long)positions[t],
                    e.max_seq);
      const uint32_t* row = visibility + size_t(t) * vis_words;
      KDT_CHECK_ARG((row[i >> 5] >> (i & 31)) & 1u, fn,
                    "visibility row %d (request %d, node %d) does not see itself", t, r, i);
      for (int j = n_b; j < 32 * vis_words; ++j)
        KDT_CHECK_ARG(!((row[j >> 5] >> (j & 31)) & 1u), fn,
                      "visibility row %d sets bit %d beyond its request's %d nodes", t, j, n_b);
    }
  }
  Batch b;
  b.n_req = n_req;
  b.slots = slots;
  b.q_indptr = q_indptr;
  b.prefix = prefix.data();
  b.total = total;
  b.tokens = tokens;
  b.positions = positions;
  b.visibility = visibility;
  b.vis_words = vis_words;
  b.max_tree = max_tree;
  b.n_capture = n_capture;
  b.capture = capture_layers;
  b.logits = logits;
  b.hidden = hidden;
  try {
#if defined(KDT_WITH_CUDA)
    if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::forward_cuda(e, b);
#endif
    return kdt::engine::forward_cpu(e, b);
  } catch (const std::bad_alloc&) {
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn, "out of host memory for %d tokens", total);
  }
}

kdt_status kdt_engine_commit(kdt_engine* engine, int32_t slot, int32_t n_keep,
                             const int32_t* keep) {
  const char* fn = "kdt_engine_commit";
  KDT_CHECK_PTR(engine, fn);
  Engine& e = engine->impl;
  KDT_CHECK_ARG(slot >= 0 && slot < e.max_slots, fn, "slot %d is outside [0, %d)", int(slot),
                e.max_slots);
  kdt_status lst = host_lengths(e);
  if (lst != KDT_OK) return lst;
  const int P = e.seq_len[slot];
  KDT_CHECK_ARG(n_keep >= 0 && P + n_keep <= e.max_seq, fn,
                "n_keep %d is negative or overflows max_seq %d (slot %d holds %d rows)",
                int(n_keep), e.max_seq, int(slot), P);
  KDT_CHECK_ARG(n_keep == 0 || keep, fn, "keep is NULL with n_keep %d", int(n_keep));
  for (int k = 0; k < n_keep; ++k)
    KDT_CHECK_ARG(keep[k] >= 0 && P + keep[k] < e.max_seq, fn,
                  "keep[%d] = %d is outside [0, %d) (rows after the %d committed ones)", k,
                  int(keep[k]), e.max_seq - P, P);
  try {
#if defined(KDT_WITH_CUDA)
    if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::commit_cuda(e, slot, n_keep, keep);
#endif
    return kdt::engine::commit_cpu(e, slot, n_keep, keep);
  } catch (const std::bad_alloc&) {
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn, "out of host memory");
  }
}

kdt_status kdt_engine_lengths(kdt_engine* engine, int32_t** lengths) {
  const char* fn = "kdt_engine_lengths";
  KDT_CHECK_PTR(engine, fn);
  KDT_CHECK_PTR(lengths, fn);
  Engine& e = engine->impl;
#if defined(KDT_WITH_CUDA)
  if (e.backend == KDT_BACKEND_CUDA) {
    *lengths = kdt::engine::cuda_lengths(e);
    return KDT_OK;
  }
#endif
  *lengths = e.seq_len.data();
  return KDT_OK;
}

// The device path's shape checks (values live on the device: the kernels clamp every index).
static kdt_status check_round_shape(const Engine& e, const char* fn, int32_t n_req, int32_t n,
                                    const int32_t* slots) {
  KDT_CHECK_ARG(n_req >= 1 && n_req <= 4096, fn, "n_req %d is outside [1, 4096]", int(n_req));
  KDT_CHECK_ARG(n >= 1 && n <= e.max_seq && n <= 4096, fn,
                "n %d is outside [1, min(max_seq %d, 4096)]", int(n), e.max_seq);
  KDT_CHECK_PTR(slots, fn);
  return KDT_OK;
}

kdt_status kdt_engine_verify(kdt_engine* engine, void* stream, int32_t n_req, int32_t n,
                             const int32_t* slots, const int64_t* tokens,
                             const int64_t* positions, const uint32_t* visibility,
                             int32_t vis_words, int64_t* argmax, float* hidden, float* logits) {
  const char* fn = "kdt_engine_verify";
  KDT_CHECK_PTR(engine, fn);
  Engine& e = engine->impl;
  kdt_status st = check_round_shape(e, fn, n_req, n, slots);
  if (st != KDT_OK) return st;
  KDT_CHECK_PTR(tokens, fn);
  KDT_CHECK_PTR(positions, fn);
  KDT_CHECK_PTR(visibility, fn);
  KDT_CHECK_PTR(argmax, fn);
  KDT_CHECK_ARG(vis_words >= (n + 31) / 32, fn, "vis_words %d < ceil(n %d / 32)", int(vis_words),
                int(n));
  RoundBatch b;
  b.stream = stream;
  b.n_req = n_req;
  b.n = n;
  b.slots = slots;
  b.tokens = tokens;
  b.positions = positions;
  b.visibility = visibility;
  b.vis_words = vis_words;
  b.argmax = argmax;
  b.hidden = hidden;
  b.logits = logits;
  try {
#if defined(KDT_WITH_CUDA)
    if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::verify_cuda(e, b);
#endif
    return kdt::engine::verify_cpu(e, b);
  } catch (const std::bad_alloc&) {
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn, "out of host memory for %d x %d nodes",
                          int(n_req), int(n));
  }
}

kdt_status kdt_engine_commit_accepted(kdt_engine* engine, void* stream, int32_t n_req, int32_t n,
                                      const int32_t* slots, const int32_t* accept_index,
                                      const int32_t* accept_len) {
  const char* fn = "kdt_engine_commit_accepted";
  KDT_CHECK_PTR(engine, fn);
  Engine& e = engine->impl;
  kdt_status st = check_round_shape(e, fn, n_req, n, slots);
  if (st != KDT_OK) return st;
  KDT_CHECK_PTR(accept_index, fn);
  KDT_CHECK_PTR(accept_len, fn);
  AcceptBatch a;
  a.stream = stream;
  a.n_req = n_req;
  a.n = n;
  a.slots = slots;
  a.accept_index = accept_index;
  a.accept_len = accept_len;
  try {
#if defined(KDT_WITH_CUDA)
    if (e.backend == KDT_BACKEND_CUDA) return kdt::engine::commit_accepted_cuda(e, a);
#endif
    return kdt::engine::commit_accepted_cpu(e, a);
  } catch (const std::bad_alloc&) {
    return kdt::set_error(KDT_ERR_OUT_OF_MEMORY, fn, "out of host memory");
  }
}

}  // extern "C"
