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
//   cache rows split into at most `splits` chunks of `chunk` rows (a multiple of kKvTile): the
//   SIMT path chunks the prefix [0, P_b) (its tree pass merges), the tensor-core paths (mma,
//   sm90a) the whole [0, kv_len_b) with the tree tail masked in the last chunk(s); both chunk
//   counts are <= splits because P_b < kv_len_b <= max_kv.
// The SIMT kernels tile rows by kRowsPerBlock, the tensor-core paths by kRowsPerBlockTc (the
// mma path uses 32 on parts with 99 KB of shared memory per block); the split count is chosen
// for the 64-row tiling, so every path gets enough blocks. With splits == 1 the tensor-core
// paths write out / lse directly and need no merge.
struct VerifyAttentionPlan {
  static constexpr int kRowsPerBlock = 16;    // SIMT: 8 warps x 2 rows (verify_attention.cu)
  static constexpr int kRowsPerBlockTc = 64;  // tensor cores: 4 row groups x 16 rows (mma, sm90a)
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

// Which implementation runs a call: KDT_VERIFY_PATH=auto|simt|mma|sm90a|cpu in the environment,
// read on every call (unset or empty: auto). auto picks the fastest path for the device and
// dtype (CUDA bf16 at 512 + 64: sm90a on sm_90 when built for it, else mma; otherwise simt);
// the others force one and fail with a clear error when it cannot take the call.
enum class VerifyPath { kAuto, kCpu, kSimt, kMma, kSm90a };
// Parses the variable; an unknown value is KDT_ERR_INVALID_ARGUMENT naming it.
kdt_status verify_path_from_env(VerifyPath* path);

kdt_status verify_attention_cpu(const VerifyAttentionArgs& a);
#if defined(KDT_WITH_CUDA)
kdt_status verify_attention_cuda(const VerifyAttentionArgs& a, VerifyPath path, void* stream,
                                 void* workspace, size_t workspace_bytes);
// The sm_90a wgmma kernel (verify_attention_sm90a.cu): bf16, d_latent 512, d_rope 64, the
// workspace of VerifyAttentionPlan (split-KV partial states merged by LSE). Returns
// KDT_ERR_UNSUPPORTED (with kdt_last_error saying why) when the device, the build or the call
// cannot run it; `auto` then falls back to the mma path.
kdt_status verify_attention_sm90a(const VerifyAttentionArgs& a, void* stream, void* workspace,
                                  size_t workspace_bytes);
#endif

}  // namespace kdt
