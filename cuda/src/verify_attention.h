// verify_attention.h: internals of kdt_verify_attention shared by the entry point
// (verify_attention_api.cpp), the CPU backend (verify_attention_cpu.cpp) and the CUDA backend
// (verify_attention.cu). Not part of the ABI.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kdtree/kdtree.h"

namespace kdt {

// Arguments of one call, already validated by the entry point (shapes as in kdtree.h).
struct VerifyAttentionArgs {
  kdt_dtype dtype;
  int32_t bs, num_heads, d_latent, d_rope, total_q, total_kv, max_tree, max_kv;
  const int32_t* q_indptr;   // [bs + 1]
  const int32_t* kv_indptr;  // [bs + 1]
  const void* q_lat;         // [total_q, H, d_latent]
  const void* q_pe;          // [total_q, H, d_rope]
  const void* kv_cache;      // [total_kv, d_latent + d_rope]
  const uint32_t* visibility;  // [total_q, vis_words]
  int32_t vis_words;
  float softmax_scale;
  float* out;  // [total_q, H, d_latent]
  float* lse;  // [total_q, H]
};

// Launch geometry of the CUDA backend, a pure function of the sizes so that the workspace
// query and the call agree without touching the device (and without the dtype, which the
// workspace query does not take).
//   rows of request b = n_b * H (query-head pairs, row = node * H + head);
//   prefix rows [0, P_b) split into `splits` chunks of `chunk` rows (a multiple of kKvTile).
// The SIMT kernels tile rows by kRowsPerBlock, the tensor-core prefix kernel by kRowsPerBlockTc;
// the split count is chosen for the coarser (tensor-core) tiling, so both get enough blocks.
struct VerifyAttentionPlan {
  static constexpr int kRowsPerBlock = 16;    // SIMT: 8 warps x 2 rows (verify_attention.cu)
  static constexpr int kRowsPerBlockTc = 64;  // tensor cores: 4 row groups x 16 rows
  static constexpr int kKvTile = 32;          // cache rows per shared-memory tile (SIMT)
  static constexpr int kTargetBlocks = 264;   // ~2 waves of an H200's 132 SMs
  static constexpr int kMinChunk = 256;       // below this the partial-state traffic dominates
  int64_t row_tiles = 0;     // ceil(max_tree * H / kRowsPerBlock)
  int64_t row_tiles_tc = 0;  // ceil(max_tree * H / kRowsPerBlockTc)
  int64_t splits = 0;        // prefix chunks per request (0 when max_kv == 0)
  int64_t chunk = 0;         // prefix rows per chunk

  static VerifyAttentionPlan make(int32_t bs, int32_t num_heads, int32_t max_tree,
                                  int32_t max_kv) {
    VerifyAttentionPlan p;
    const int64_t rows = int64_t(max_tree) * num_heads;
    p.row_tiles = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    p.row_tiles_tc = (rows + kRowsPerBlockTc - 1) / kRowsPerBlockTc;
    if (max_kv <= 0 || bs <= 0 || rows <= 0) return p;
    int64_t base = p.row_tiles_tc * bs;
    int64_t want = (kTargetBlocks + base - 1) / base;  // splits wanted for occupancy
    int64_t max_splits = (int64_t(max_kv) + kMinChunk - 1) / kMinChunk;
    if (want > max_splits) want = max_splits;
    if (want < 1) want = 1;
    int64_t chunk = (max_kv + want - 1) / want;
    chunk = (chunk + kKvTile - 1) / kKvTile * kKvTile;
    p.chunk = chunk;
    p.splits = (max_kv + chunk - 1) / chunk;
    return p;
  }
  // Partial states: o [splits, total_q * H, d_latent] then lse [splits, total_q * H], float32.
  size_t workspace_bytes(int32_t total_q, int32_t num_heads, int32_t d_latent) const {
    size_t rows = size_t(total_q) * size_t(num_heads) * size_t(splits);
    return rows * (size_t(d_latent) + 1) * sizeof(float);
  }
};

kdt_status verify_attention_cpu(const VerifyAttentionArgs& a);
#if defined(KDT_WITH_CUDA)
kdt_status verify_attention_cuda(const VerifyAttentionArgs& a, void* stream, void* workspace,
                                 size_t workspace_bytes);
// The Hopper path (verify_attention_sm90a.cu): bf16, d_latent 512, d_rope 64; returns
// KDT_ERR_UNSUPPORTED (kdt_last_error says why) for other shapes, dtypes, devices and builds
// without sm_90a code, so that the caller can fall back. Same workspace as the plan above.
kdt_status verify_attention_sm90a(const VerifyAttentionArgs& a, void* stream, void* workspace,
                                  size_t workspace_bytes);
#endif

}  // namespace kdt
