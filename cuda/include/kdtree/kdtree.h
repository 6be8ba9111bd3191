/*
 * kdtree.h: the plain C ABI of libkdtree (DDTree kernels and the native engine).
 *
 * Conventions (ARCHITECTURE.md, "The engine's native boundary"):
 *   - No C++ types cross this boundary: raw pointers, fixed-width integers, enums.
 *   - Every entry point takes a backend; CUDA entry points also take a stream (cudaStream_t
 *     passed as void*; NULL is the legacy default stream). With KDT_BACKEND_CUDA every array
 *     pointer is a device pointer, with KDT_BACKEND_CPU a host pointer.
 *   - Every entry point returns a kdt_status. On error, kdt_last_error() returns a message for
 *     the calling thread naming the function, the argument and the problem. Nothing aborts.
 *   - CUDA entry points never synchronise the host and are safe under CUDA graph capture;
 *     a launch failure is reported by the returned status (cudaGetLastError after the launch).
 *   - Shapes are given as [dim0, dim1, ...], row-major, densely packed.
 *
 * Kernel semantics: ../shared/DDTREE.md (sections 2-6). n = budget + 1 slots per request.
 */
#ifndef KDTREE_KDTREE_H
#define KDTREE_KDTREE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KDT_API __attribute__((visibility("default")))
#else
#define KDT_API
#endif

typedef enum kdt_status {
  KDT_OK = 0,
  KDT_ERR_INVALID_ARGUMENT = 1, /* a size, a pointer or a value out of its contract */
  KDT_ERR_UNSUPPORTED = 2,      /* e.g. the CUDA backend in a CPU-only build */
  KDT_ERR_CUDA = 3,             /* a CUDA runtime error (launch, allocation, ...) */
  KDT_ERR_IO = 4,               /* a file could not be opened or read */
  KDT_ERR_FORMAT = 5,           /* a file is not a valid safetensors / KDTR / weights file */
  KDT_ERR_OUT_OF_MEMORY = 6,
  KDT_ERR_INTERNAL = 7          /* a bug: please report it with kdt_last_error() */
} kdt_status;

typedef enum kdt_backend { KDT_BACKEND_CPU = 0, KDT_BACKEND_CUDA = 1 } kdt_backend;

typedef enum kdt_dtype { KDT_DTYPE_F32 = 0, KDT_DTYPE_BF16 = 1 } kdt_dtype;

/* Per-request status of the accept walk (DDTREE.md section 4). The first defect met wins. */
typedef enum kdt_accept_status {
  KDT_ACCEPT_OK = 0,
  KDT_ACCEPT_OUT_OF_RANGE = 1, /* a link (first_child / next_sibling) outside [1, num_nodes) */
  KDT_ACCEPT_CYCLE = 2,        /* a child scan or the walk exceeded n steps */
  KDT_ACCEPT_DUPLICATE = 3     /* two children of one node carry the matched token */
} kdt_accept_status;

/* ---------------------------------------------------------------- library ------------- */

/* The message of the calling thread's last error ("" if none). Valid until the next call. */
KDT_API const char* kdt_last_error(void);
/* Library version, e.g. "0.1.0". */
KDT_API const char* kdt_version(void);
/* 1 if this build contains the CUDA backend, else 0. */
KDT_API int kdt_has_cuda(void);
/* How many times the library has waited for the device so far (stream / device synchronise,
 * blocking copies): tests count a decode round's synchronisations with it. */
KDT_API uint64_t kdt_sync_count(void);
/* Number of visible CUDA devices (0 when none or a CPU-only build). Never fails. */
KDT_API int kdt_cuda_device_count(void);

/* Device-memory helpers (CUDA builds; KDT_ERR_UNSUPPORTED in a CPU-only build) so that test
 * programs and Python can drive the CUDA backend without linking cudart. These synchronise:
 * they are for tests and tools, not for the decode loop. Freeing or allocating 0 bytes / NULL
 * is a no-op (kdt_device_alloc then stores NULL). */
KDT_API kdt_status kdt_device_alloc(void** ptr, size_t bytes);
KDT_API kdt_status kdt_device_free(void* ptr);
KDT_API kdt_status kdt_memcpy_htod(void* dst_device, const void* src_host, size_t bytes);
KDT_API kdt_status kdt_memcpy_dtoh(void* dst_host, const void* src_device, size_t bytes);
KDT_API kdt_status kdt_device_synchronize(void);

/* ---------------------------------------------------------------- tree build ---------- */
/*
 * Best-first DDTree build (DDTREE.md sections 2-3), batched over bs requests.
 *   top_logp      [bs, L, K] float32, each row sorted descending (ties allowed)
 *   top_ids       [bs, L, K] int64
 *   root_ids      [bs]       int64   slot 0 token
 *   seq_lens      [bs]       int64   committed prefix length (positions = seq_lens + depths)
 * Outputs (n = budget + 1, W = ceil(n / 32)); unused slots hold -1 (links, tokens, parents,
 * depths, positions) and zero bits:
 *   tokens [bs, n] int64, parents [bs, n] int32, depths [bs, n] int32,
 *   positions [bs, n] int64, first_child [bs, n] int64, next_sibling [bs, n] int64,
 *   visibility [bs, n, W] uint32, num_nodes [bs] int32,
 *   scores [bs, n] float64 (may be NULL; 0.0 at the root, unused slots 0.0).
 * Limits: 1 <= budget <= 1024, 1 <= L <= 32, 1 <= K <= budget, bs >= 1 (bs == 0 is a no-op).
 */
KDT_API kdt_status kdt_tree_build(kdt_backend backend, void* stream, int32_t bs, int32_t L,
                                  int32_t K, int32_t budget, const float* top_logp,
                                  const int64_t* top_ids, const int64_t* root_ids,
                                  const int64_t* seq_lens, int64_t* tokens, int32_t* parents,
                                  int32_t* depths, int64_t* positions, int64_t* first_child,
                                  int64_t* next_sibling, uint32_t* visibility,
                                  int32_t* num_nodes, double* scores);

/* ---------------------------------------------------------------- tree accept --------- */
/*
 * Greedy accept walk (DDTREE.md section 4), bounded on malformed trees.
 *   tokens, first_child, next_sibling [bs, n] int64; num_nodes [bs] int32 (may be NULL: n);
 *   target_argmax [bs, n] int64.
 * Outputs: accept_index [bs, n] int32 (root first, then -1), accept_len [bs] int32 (>= 1),
 *   bonus [bs] int64 (target_argmax at the last accepted node), status [bs] int32
 *   (kdt_accept_status). A malformed tree is not an error of the call: its request gets a
 *   nonzero status and the nodes accepted before the defect.
 */
KDT_API kdt_status kdt_tree_accept(kdt_backend backend, void* stream, int32_t bs, int32_t n,
                                   const int64_t* tokens, const int64_t* first_child,
                                   const int64_t* next_sibling, const int32_t* num_nodes,
                                   const int64_t* target_argmax, int32_t* accept_index,
                                   int32_t* accept_len, int64_t* bonus, int32_t* status);

/* ---------------------------------------------------------------- verify attention ---- */
/*
 * Absorbed-MLA tree-verify attention (DDTREE.md section 6) over a ragged batch.
 * Request b owns query rows q_indptr[b] .. q_indptr[b+1] (its n_b tree nodes, node i at row
 * q_indptr[b] + i) and cache rows kv_indptr[b] .. kv_indptr[b+1]; the last n_b of those cache
 * rows are its tree nodes (node i at row kv_indptr[b+1] - n_b + i), the rows before them its
 * committed prefix (P_b = kv_len_b - n_b >= 0). Query i sees every prefix row and the tree rows
 * j whose visibility bit is set (bit j % 32 of visibility[row_i * vis_words + j / 32]).
 *   q_lat     [total_q, H, d_latent]        dtype (float32 or bfloat16)
 *   q_pe      [total_q, H, d_rope]          dtype
 *   kv_cache  [total_kv, d_latent + d_rope] dtype: c_kv (d_latent) then k_pe (d_rope) per row
 *   q_indptr, kv_indptr [bs + 1] int32 (device pointers for CUDA; not read on the host)
 *   visibility [total_q, vis_words] uint32, vis_words >= ceil(max_tree / 32)
 *   out [total_q, H, d_latent] float32 (softmax-weighted sum of c_kv), lse [total_q, H] float32
 *   (natural log of the sum of exp(score)); scores are (q_lat . c_kv + q_pe . k_pe) * scale.
 *   max_tree >= every n_b (sizes the grid without reading device memory), max_kv >= every
 *   kv_len_b. A query that sees no row at all (no prefix, no visibility bit) gets out = 0 and
 *   lse = -inf. bfloat16 arrays are raw uint16 bits.
 * The workspace holds the split-prefix partial states (CUDA); query its size with
 * kdt_verify_attention_workspace_size (0 for the CPU backend; workspace may be NULL then).
 * CPU backend: the index pointers are checked on the host (errors name the request).
 * CUDA backend: d_latent <= 512 and d_latent + d_rope <= 576; two kernels on `stream`, no host
 * sync, graph-capturable; index pointers that break the contract cannot be reported without a
 * sync, so that request's rows are written as NaN (where addressable) instead.
 */
KDT_API size_t kdt_verify_attention_workspace_size(kdt_backend backend, int32_t bs,
                                                   int32_t num_heads, int32_t d_latent,
                                                   int32_t total_q, int32_t max_tree,
                                                   int32_t max_kv);
KDT_API kdt_status kdt_verify_attention(kdt_backend backend, void* stream, kdt_dtype dtype,
                                        int32_t bs, int32_t num_heads, int32_t d_latent,
                                        int32_t d_rope, int32_t total_q, int32_t total_kv,
                                        int32_t max_tree, int32_t max_kv,
                                        const int32_t* q_indptr, const int32_t* kv_indptr,
                                        const void* q_lat, const void* q_pe,
                                        const void* kv_cache, const uint32_t* visibility,
                                        int32_t vis_words, float softmax_scale, float* out,
                                        float* lse, void* workspace, size_t workspace_bytes);

/* ---------------------------------------------------------------- engine -------------- */
/* (section owned by the native engine: declarations and their shape comments go here) */
/* ---- the noisy ORACLE drafter (benchmarks) ---------------------------------------------------
 * kdt_oracle_draft: the batched noisy ORACLE of engine/drafters/oracle.py (OracleDrafter, whose
 * torch draft_batch is the reference; this kernel matches it bit for bit). For request b (slot
 * rows[b], committed length P = lengths[b]) and depth d in 1..L, the true token is
 * table[slot, min(P + d, cols - 1)] (table int64 [table_rows, cols]); a 32-bit hash of
 * (seeds[slot], P, d) puts it at rank 0 with probability `quality`, at a rank in [1, K) below
 * q_mid = q + (1 - q) q, else outside the top K; the other ranks hold distinct wrong tokens.
 * top_logp float32 [bs, L, K]: log_p0 at rank 0, then rest_c + spread * z_j sorted descending
 * and clamped to log_p0 (z_j a centred Irwin-Hall(4) draw of variance 1); top_ids int64
 * [bs, L, K]. 1 <= L <= 64, 1 <= K <= min(V, 1024). CUDA: asynchronous on `stream`, no sync. */
KDT_API kdt_status kdt_oracle_draft(kdt_backend backend, void* stream, int32_t bs, int32_t L,
                                    int32_t K, int32_t V, double quality, double q_mid,
                                    double log_p0, double rest_c, double spread,
                                    const int64_t* table, int32_t table_rows, int32_t cols,
                                    const int64_t* seeds, const int64_t* rows,
                                    const int64_t* lengths, float* top_logp, int64_t* top_ids);

/*
 * The native engine: an FP32 DeepSeek-V3-style (MLA + MoE) target model with a latent KV cache
 * per request slot. Unlike the kernels above, every engine call takes HOST pointers for both
 * backends (the engine owns its device memory and copies in and out), and CUDA calls finish
 * before returning. Arithmetic per token does not depend on the batch it is in, so DDTree
 * verification and AR decoding (a one-node tree) produce bit-identical logits and KV rows.
 *
 * kdt_engine_create: loads weights_dir (config.json with DeepSeek-V3 keys + model.safetensors
 *   or its shards, DeepSeek-V3 tensor names); max_slots request slots of max_seq cache rows each
 *   (positions must be < max_seq). kdt_engine_destroy(NULL) is a no-op.
 * kdt_engine_dim: "vocab_size", "hidden_size", "num_hidden_layers", "kv_dim", "max_slots",
 *   "max_seq" or "backend".
 * kdt_engine_forward: one target pass over n_req requests (distinct slots). Request b (slot
 *   slots[b], committed length P_b) owns tokens q_indptr[b] .. q_indptr[b+1] (n_b >= 1, its
 *   tree nodes in order); node i's KV goes to cache row P_b + i (not committed), and node i
 *   attends to rows 0 .. P_b - 1 and to node j iff bit j % 32 of visibility[t * vis_words + j/32]
 *   (t = q_indptr[b] + i) is set; the self bit must be set.
 *     tokens, positions [total] int64; visibility [total, vis_words] uint32;
 *     capture_layers [n_capture] int32: k = residual stream after k layers (0 = embeddings,
 *       num_hidden_layers = before the final norm, num_hidden_layers + 1 = the final norm's
 *       output, which the LM head and the drafters read);
 *     logits [total, vocab] float32 (may be NULL); hidden [total, n_capture, hidden] float32.
 *   Prefill is a forward whose visibility is lower-triangular; an AR step a one-node tree.
 * kdt_engine_commit: keeps uncommitted rows P + keep[0..n_keep) as rows P .. P + n_keep - 1
 *   (all kept rows are read before any is written) and sets the slot's length to P + n_keep.
 * kdt_engine_reset_slot: sets a slot's committed length to 0 (release / reuse).
 *
 * The device path: one decode round without the host (docs/ENGINE.md, "The round"). Buffers
 * live where the backend computes (CUDA: device memory; CPU: host memory); on CUDA the calls
 * are asynchronous on `stream` (NULL: the legacy default stream), never synchronise, and never
 * allocate once they have run once with the same shapes, so a CUDA graph can capture them.
 * Values are not checked on the host (they are on the device): kernels clamp every index.
 * Trees are padded to n nodes (kdt_tree_build writes token -1 past num_nodes: such nodes run
 * on token 0 at position P and are never committed). Slot max_slots is the scratch slot: a
 * batch bucket's padding rows name it; its length stays 0 and nothing is committed to it.
 * kdt_engine_lengths: the committed length of every slot, int32 [max_slots + 1], where the
 *   backend keeps it (CUDA: device memory), valid while the engine lives. The device path
 *   updates it; host-path calls see the update (they copy it back, synchronising, first).
 * kdt_engine_verify: the target pass over n_req requests of n nodes: slots [n_req] int32,
 *   tokens and positions [n_req, n] int64, visibility [n_req, n, vis_words] uint32 (as
 *   kdt_tree_build writes them). Request b attends to its slot's committed rows
 *   0 .. P_b - 1 (P_b = lengths[slots[b]], P_b + n <= max_seq) and to its visible nodes; node
 *   i's KV goes to row P_b + i (not committed). Writes argmax [n_req, n] int64 (the first
 *   maximal logit, -1 for padding nodes), hidden [n_req, n, hidden] float32 (the final norm's
 *   output; may be NULL) and logits [n_req * n, vocab] float32 (may be NULL).
 * kdt_engine_commit_accepted: for every request b on a real slot, keeps rows
 *   P_b + accept_index[b, 0 .. accept_len[b]) as rows P_b .. in order and adds accept_len[b]
 *   to its length (accept_index int32 [n_req, n], accept_len int32 [n_req], as
 *   kdt_tree_accept writes them).
 */
typedef struct kdt_engine kdt_engine;

KDT_API kdt_status kdt_engine_create(kdt_backend backend, const char* weights_dir,
                                     int32_t max_slots, int32_t max_seq, kdt_engine** out);
KDT_API void kdt_engine_destroy(kdt_engine* engine);
KDT_API kdt_status kdt_engine_dim(const kdt_engine* engine, const char* name, int64_t* value);
KDT_API kdt_status kdt_engine_seq_len(kdt_engine* engine, int32_t slot, int32_t* len);
KDT_API kdt_status kdt_engine_reset_slot(kdt_engine* engine, int32_t slot);
KDT_API kdt_status kdt_engine_forward(kdt_engine* engine, int32_t n_req, const int32_t* slots,
                                      const int32_t* q_indptr, const int64_t* tokens,
                                      const int64_t* positions, const uint32_t* visibility,
                                      int32_t vis_words, int32_t n_capture,
                                      const int32_t* capture_layers, float* logits,
                                      float* hidden);
KDT_API kdt_status kdt_engine_commit(kdt_engine* engine, int32_t slot, int32_t n_keep,
                                     const int32_t* keep);
KDT_API kdt_status kdt_engine_lengths(kdt_engine* engine, int32_t** lengths);
KDT_API kdt_status kdt_engine_verify(kdt_engine* engine, void* stream, int32_t n_req, int32_t n,
                                     const int32_t* slots, const int64_t* tokens,
                                     const int64_t* positions, const uint32_t* visibility,
                                     int32_t vis_words, int64_t* argmax, float* hidden,
                                     float* logits);
/* kdt_round_finish: the end of a round, after kdt_engine_commit_accepted. For request b on a
 * real slot (rows[b] < scratch_slot) with a = accept_len[b] accepted nodes (root first):
 * hidden_ctx[rows[b] * max_seq + prefix[b] + k] = hidden[b, accept_index[b, k]] for k < a (the
 * drafters' context: final-norm hidden states of committed tokens), next_root[rows[b]] =
 * bonus[b]; for every request, result[b] = [a, num_nodes[b] (1 when num_nodes is NULL),
 * tokens[b, accept_index[b, 1 .. a)], bonus[b], 0...] (int32 [bs, n + 2]: what the host
 * copies home). rows, prefix int64 [bs]; tokens int64 [bs, n]; hidden float32 [bs, n, D];
 * hidden_ctx float32 [(scratch_slot + 1) * max_seq, D]; next_root int64 [scratch_slot + 1]. */
KDT_API kdt_status kdt_round_finish(kdt_backend backend, void* stream, int32_t bs, int32_t n,
                                    int32_t D, int32_t max_seq, int32_t scratch_slot,
                                    const int64_t* rows, const int64_t* prefix,
                                    const int64_t* tokens, const int32_t* num_nodes,
                                    const int32_t* accept_index, const int32_t* accept_len,
                                    const int64_t* bonus, const float* hidden, float* hidden_ctx,
                                    int64_t* next_root, int32_t* result);
KDT_API kdt_status kdt_engine_commit_accepted(kdt_engine* engine, void* stream, int32_t n_req,
                                              int32_t n, const int32_t* slots,
                                              const int32_t* accept_index,
                                              const int32_t* accept_len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KDTREE_KDTREE_H */
