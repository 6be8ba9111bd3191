// oracle_cpu.cpp: the kdt_oracle_draft entry point (validation, dispatch) and its CPU backend.
// The per-row arithmetic lives in oracle_core.h, shared with the CUDA kernel (oracle.cu).
#include <algorithm>
#include <functional>
#include <vector>

#include "common.h"
#include "oracle_core.h"

namespace kdt {

#if defined(KDT_WITH_CUDA)
kdt_status oracle_draft_cuda(const oracle::Args& a, void* stream);  // oracle.cu
#endif

namespace {

kdt_status oracle_draft_cpu(const oracle::Args& a) {
  std::vector<double> rest(a.K > 1 ? a.K - 1 : 1);
  for (int b = 0; b < a.bs; ++b)
    for (int d = 1; d <= a.L; ++d) {
      const oracle::Row r = oracle::row_setup(a, b, d);
      const size_t o = (size_t(b) * a.L + (d - 1)) * a.K;
      for (int j = 0; j < a.K; ++j) a.top_ids[o + j] = oracle::token_at(a, r, j);
      for (int j = 1; j < a.K; ++j) rest[j - 1] = oracle::rest_at(a, r, j);
      std::sort(rest.begin(), rest.begin() + (a.K - 1), std::greater<double>());
      a.top_logp[o] = float(a.log_p0);
      for (int j = 1; j < a.K; ++j) a.top_logp[o + j] = float(std::min(rest[j - 1], a.log_p0));
    }
  return KDT_OK;
}

}  // namespace
}  // namespace kdt

extern "C" kdt_status kdt_oracle_draft(kdt_backend backend, void* stream, int32_t bs, int32_t L,
                                       int32_t K, int32_t V, double quality, double q_mid,
                                       double log_p0, double rest_c, double spread,
                                       const int64_t* table, int32_t table_rows, int32_t cols,
                                       const int64_t* seeds, const int64_t* rows,
                                       const int64_t* lengths, float* top_logp,
                                       int64_t* top_ids) {
  static const char* fn = "kdt_oracle_draft";
  kdt::clear_error();
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend=%d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", (int)backend);
  KDT_CHECK_ARG(bs >= 0, fn, "bs=%d must be >= 0", bs);
  KDT_CHECK_ARG(L >= 1 && L <= 64, fn, "L=%d is outside [1, 64]", L);
  KDT_CHECK_ARG(V >= 2, fn, "V=%d must be >= 2", V);
  KDT_CHECK_ARG(K >= 1 && K <= V && K <= 1024, fn, "K=%d is outside [1, min(V=%d, 1024)]", K, V);
  KDT_CHECK_ARG(table_rows >= 1 && cols >= 1, fn, "table [%d, %d] is empty", table_rows, cols);
  KDT_CHECK_ARG(quality >= 0.0 && quality <= 1.0, fn, "quality=%g is outside [0, 1]", quality);
  if (bs == 0) return KDT_OK;
  KDT_CHECK_PTR(table, fn);
  KDT_CHECK_PTR(seeds, fn);
  KDT_CHECK_PTR(rows, fn);
  KDT_CHECK_PTR(lengths, fn);
  KDT_CHECK_PTR(top_logp, fn);
  KDT_CHECK_PTR(top_ids, fn);
  const kdt::oracle::Args a{bs,      L,          K,      V,    quality, q_mid, log_p0,
                            rest_c,  spread,     table,  table_rows, cols, seeds, rows,
                            lengths, top_logp,   top_ids};
  if (backend == KDT_BACKEND_CPU) return kdt::oracle_draft_cpu(a);
#if defined(KDT_WITH_CUDA)
  return kdt::oracle_draft_cuda(a, stream);
#else
  (void)stream;
  return kdt::cuda_unsupported(fn);
#endif
}
