// verify_attention_api.cpp: the C entry points of the tree-verify attention; argument checks
// in one place (sizes, then pointers, then the CUDA limits), then dispatch to the backend.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "verify_attention.h"

namespace {

constexpr const char* kFn = "kdt_verify_attention";

// The CPU backend reads the index pointers on the host, so it can check them against the
// contract (the CUDA backend cannot without a sync; its kernels guard instead).
kdt_status check_indptrs_host(const kdt::VerifyAttentionArgs& a) {
  if (a.q_indptr[0] != 0 || a.kv_indptr[0] != 0)
    return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                          "q_indptr[0] = %d and kv_indptr[0] = %d must both be 0",
                          a.q_indptr[0], a.kv_indptr[0]);
  for (int32_t b = 0; b < a.bs; ++b) {
    int64_t n = int64_t(a.q_indptr[b + 1]) - a.q_indptr[b];
    int64_t kv = int64_t(a.kv_indptr[b + 1]) - a.kv_indptr[b];
    if (n < 0 || kv < 0)
      return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                            "request %d: q_indptr or kv_indptr decreases (n = %lld, kv_len = %lld)",
                            b, (long long)n, (long long)kv);
    if (n > a.max_tree)
      return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                            "request %d: tree size %lld exceeds max_tree = %d", b, (long long)n,
                            a.max_tree);
    if (kv < n)
      return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                            "request %d: kv_len %lld is smaller than its tree size %lld (the "
                            "last n_b cache rows are the tree)",
                            b, (long long)kv, (long long)n);
    if (kv > a.max_kv)
      return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                            "request %d: kv_len %lld exceeds max_kv = %d", b, (long long)kv,
                            a.max_kv);
  }
  if (a.q_indptr[a.bs] != a.total_q)
    return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn, "q_indptr[bs] = %d but total_q = %d",
                          a.q_indptr[a.bs], a.total_q);
  if (a.kv_indptr[a.bs] != a.total_kv)
    return kdt::set_error(KDT_ERR_INVALID_ARGUMENT, kFn, "kv_indptr[bs] = %d but total_kv = %d",
                          a.kv_indptr[a.bs], a.total_kv);
  return KDT_OK;
}

}  // namespace

namespace kdt {

kdt_status verify_path_from_env(VerifyPath* path) {
  const char* v = std::getenv("KDT_VERIFY_PATH");
  *path = VerifyPath::kAuto;
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return KDT_OK;
  static const struct { const char* name; VerifyPath path; } kNames[] = {
      {"cpu", VerifyPath::kCpu}, {"simt", VerifyPath::kSimt}, {"mma", VerifyPath::kMma},
      {"sm90a", VerifyPath::kSm90a}};
  for (const auto& n : kNames)
    if (std::strcmp(v, n.name) == 0) {
      *path = n.path;
      return KDT_OK;
    }
  return set_error(KDT_ERR_INVALID_ARGUMENT, kFn,
                   "KDT_VERIFY_PATH = '%s' is not one of auto, simt, mma, sm90a, cpu", v);
}

}  // namespace kdt

extern "C" {

size_t kdt_verify_attention_workspace_size(kdt_backend backend, int32_t bs, int32_t num_heads,
                                           int32_t d_latent, int32_t total_q, int32_t max_tree,
                                           int32_t max_kv) {
  if (backend != KDT_BACKEND_CUDA || bs <= 0 || num_heads <= 0 || d_latent <= 0 ||
      total_q <= 0 || max_tree <= 0 || max_kv <= 0)
    return 0;
  auto plan = kdt::VerifyAttentionPlan::make(bs, num_heads, max_tree, max_kv);
  return plan.workspace_bytes(total_q, num_heads, d_latent);
}

kdt_status kdt_verify_attention(kdt_backend backend, void* stream, kdt_dtype dtype, int32_t bs,
                                int32_t num_heads, int32_t d_latent, int32_t d_rope,
                                int32_t total_q, int32_t total_kv, int32_t max_tree,
                                int32_t max_kv, const int32_t* q_indptr,
                                const int32_t* kv_indptr, const void* q_lat, const void* q_pe,
                                const void* kv_cache, const uint32_t* visibility,
                                int32_t vis_words, float softmax_scale, float* out, float* lse,
                                void* workspace, size_t workspace_bytes) {
  kdt::clear_error();
  // ---- enums and sizes
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, kFn,
                "backend = %d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", int(backend));
  KDT_CHECK_ARG(dtype == KDT_DTYPE_F32 || dtype == KDT_DTYPE_BF16, kFn,
                "dtype = %d is not KDT_DTYPE_F32 (0) or KDT_DTYPE_BF16 (1)", int(dtype));
  KDT_CHECK_ARG(bs >= 0, kFn, "bs = %d must be >= 0", bs);
  if (bs == 0) return KDT_OK;
  KDT_CHECK_ARG(num_heads >= 1, kFn, "num_heads = %d must be >= 1", num_heads);
  KDT_CHECK_ARG(d_latent >= 1, kFn, "d_latent = %d must be >= 1", d_latent);
  KDT_CHECK_ARG(d_rope >= 0, kFn, "d_rope = %d must be >= 0", d_rope);
  KDT_CHECK_ARG(total_q >= 0, kFn, "total_q = %d must be >= 0", total_q);
  KDT_CHECK_ARG(total_kv >= total_q, kFn,
                "total_kv = %d must be >= total_q = %d (every tree node has a cache row)",
                total_kv, total_q);
  KDT_CHECK_ARG(max_tree >= 1, kFn, "max_tree = %d must be >= 1", max_tree);
  KDT_CHECK_ARG(max_kv >= 0, kFn, "max_kv = %d must be >= 0", max_kv);
  int64_t need_words = (int64_t(max_tree) + 31) / 32;
  KDT_CHECK_ARG(vis_words >= need_words, kFn,
                "vis_words = %d is below ceil(max_tree / 32) = %lld (max_tree = %d)", vis_words,
                (long long)need_words, max_tree);
  KDT_CHECK_ARG(std::isfinite(softmax_scale), kFn, "softmax_scale = %g is not finite",
                double(softmax_scale));
  // ---- pointers
  KDT_CHECK_PTR(q_indptr, kFn);
  KDT_CHECK_PTR(kv_indptr, kFn);
  if (total_q > 0) {
    KDT_CHECK_PTR(q_lat, kFn);
    KDT_CHECK_ARG(q_pe != nullptr || d_rope == 0, kFn, "q_pe is NULL but d_rope = %d", d_rope);
    KDT_CHECK_PTR(kv_cache, kFn);
    KDT_CHECK_PTR(visibility, kFn);
    KDT_CHECK_PTR(out, kFn);
    KDT_CHECK_PTR(lse, kFn);
  }

  kdt::VerifyAttentionArgs a{dtype,     bs,        num_heads, d_latent,   d_rope,
                             total_q,   total_kv,  max_tree,  max_kv,     q_indptr,
                             kv_indptr, q_lat,     q_pe,      kv_cache,   visibility,
                             vis_words, softmax_scale, out,   lse};
  kdt::VerifyPath path = kdt::VerifyPath::kAuto;
  if (kdt_status st = kdt::verify_path_from_env(&path); st != KDT_OK) return st;
  if (backend == KDT_BACKEND_CPU) {
    KDT_CHECK_ARG(path == kdt::VerifyPath::kAuto || path == kdt::VerifyPath::kCpu, kFn,
                  "KDT_VERIFY_PATH forces a CUDA path (simt, mma or sm90a) but the backend is "
                  "KDT_BACKEND_CPU");
    kdt_status st = check_indptrs_host(a);
    if (st != KDT_OK) return st;
    if (total_q == 0) return KDT_OK;
    return kdt::verify_attention_cpu(a);
  }
#if defined(KDT_WITH_CUDA)
  KDT_CHECK_ARG(d_latent <= 512 && d_latent + d_rope <= 576, kFn,
                "the CUDA backend supports d_latent <= 512 and d_latent + d_rope <= 576 "
                "(got %d + %d)",
                d_latent, d_rope);
  size_t need = kdt_verify_attention_workspace_size(backend, bs, num_heads, d_latent, total_q,
                                                    max_tree, max_kv);
  KDT_CHECK_ARG(workspace_bytes >= need, kFn,
                "workspace_bytes = %zu is below kdt_verify_attention_workspace_size = %zu",
                workspace_bytes, need);
  KDT_CHECK_ARG(workspace != nullptr || need == 0, kFn, "workspace is NULL but %zu bytes are needed",
                need);
  if (total_q == 0) return KDT_OK;
  return kdt::verify_attention_cuda(a, path, stream, workspace, workspace_bytes);
#else
  (void)stream;
  (void)workspace;
  (void)workspace_bytes;
  return kdt::cuda_unsupported(kFn);
#endif
}

}  // extern "C"
