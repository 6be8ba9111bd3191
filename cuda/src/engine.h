// engine.h: internal state of the native engine behind the opaque kdt_engine handle.
//
// The engine owns the model weights (host FP32, plus a device copy for CUDA), one latent KV
// cache per layer laid out [max_slots + 1, max_seq, C + R], and the committed length of each
// slot. Slot max_slots is the scratch slot of the round's device path: the padding rows of a
// batch bucket run there; its length stays 0 and nothing is committed to it.
// A forward pass writes the KV rows of its tokens right after the slot's committed rows
// (P .. P + n - 1) without committing them; kdt_engine_commit keeps a chosen subset in order.
//
// Determinism (the reason DDTree output equals AR output bit for bit in FP32): every per-token
// quantity is computed by a reduction whose order depends only on that token's own data, never
// on how many tokens share the batch, and attention visits a query's visible keys in position
// order (prefix rows, then visible tree rows by index, which along a tree path is position
// order), so a tree node and the same token decoded autoregressively see identical arithmetic.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine_pool.h"
#include "model.h"

namespace kdt {
namespace engine {

// One forward batch, host pointers (validated by the API before a backend sees it).
struct Batch {
  int n_req = 0;               // requests in the batch
  const int32_t* slots;        // [n_req] slot of each request (distinct)
  const int32_t* q_indptr;     // [n_req + 1] request b owns tokens q_indptr[b] .. q_indptr[b+1]
  const int32_t* prefix;       // [n_req] committed length P_b of each request's slot
  int total = 0;               // q_indptr[n_req]
  const int64_t* tokens;       // [total]
  const int64_t* positions;    // [total] absolute positions (rope)
  const uint32_t* visibility;  // [total, vis_words] bit j of row i: node j (same request) visible
  int vis_words = 0;
  int max_tree = 0;            // max over requests of n_b
  int n_capture = 0;           // hidden states to return per token
  const int32_t* capture;      // [n_capture] k = residual after k layers (0 = embeddings,
                               // layers + 1 = the final norm's output)
  float* logits;               // [total, V] or null
  float* hidden;               // [total, n_capture, D] or null
};

// One decode round's target pass on the device path (kdt_engine_verify): n_req requests of n
// tree nodes each, buffers where the backend computes (CUDA: device memory), no host sync.
struct RoundBatch {
  void* stream = nullptr;        // CUDA stream (null: the legacy default stream)
  int n_req = 0, n = 0;          // requests, nodes per request (trees padded to n)
  const int32_t* slots;          // [n_req]; max_slots = the scratch slot (padding rows)
  const int64_t* tokens;         // [n_req, n]; -1 past a tree's num_nodes (padding nodes)
  const int64_t* positions;      // [n_req, n]
  const uint32_t* visibility;    // [n_req, n, vis_words]
  int vis_words = 0;
  int64_t* argmax;               // [n_req, n] out: first maximal logit; -1 for padding nodes
  float* hidden;                 // [n_req, n, D] out: the final norm's output, or null
  float* logits;                 // [n_req * n, V] out, or null (then kept in scratch)
};

// The accepted paths of a round (kdt_engine_commit_accepted).
struct AcceptBatch {
  void* stream = nullptr;
  int n_req = 0, n = 0;
  const int32_t* slots;          // [n_req]; the scratch slot's rows are skipped
  const int32_t* accept_index;   // [n_req, n] accepted node indices, ascending, root first
  const int32_t* accept_len;     // [n_req]
};

struct CudaState;  // model_cuda.cu (CUDA builds only)

struct Engine {
  kdt_backend backend = KDT_BACKEND_CPU;
  model::HostModel model;
  int max_slots = 0, max_seq = 0;
  // [max_slots + 1] committed rows per slot. CUDA: the device copy (CudaState::lengths) is the
  // one the device path updates; this host copy is refreshed from it (lengths_to_host) before a
  // host-path call when the device path has run since.
  std::vector<int32_t> seq_len;
  bool host_lengths_stale = false;
  std::vector<std::vector<float>> kv;       // CPU: per layer [max_slots + 1, max_seq, C + R]
  std::unique_ptr<ThreadPool> pool;         // CPU: the parallel loops' threads
  CudaState* cuda = nullptr;
  ~Engine();
};

// CPU backend (model_cpu.cpp; the device path in round_cpu.cpp).
kdt_status forward_cpu(Engine& e, const Batch& b);
kdt_status commit_cpu(Engine& e, int slot, int n_keep, const int32_t* keep);
kdt_status verify_cpu(Engine& e, const RoundBatch& b);
kdt_status commit_accepted_cpu(Engine& e, const AcceptBatch& a);

#if defined(KDT_WITH_CUDA)
// CUDA backend (model_cuda.cu): upload weights, run, compact, free.
kdt_status cuda_init(Engine& e);
void cuda_free(Engine& e);
kdt_status forward_cuda(Engine& e, const Batch& b);
kdt_status commit_cuda(Engine& e, int slot, int n_keep, const int32_t* keep);
kdt_status verify_cuda(Engine& e, const RoundBatch& b);
kdt_status commit_accepted_cuda(Engine& e, const AcceptBatch& a);
int32_t* cuda_lengths(Engine& e);                  // the device copy of seq_len
kdt_status lengths_to_host(Engine& e);             // device -> host when stale (synchronises)
kdt_status length_to_device(Engine& e, int slot);  // host -> device for one slot
#endif

}  // namespace engine
}  // namespace kdt
