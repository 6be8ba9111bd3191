// round_finish_cpu.cpp: the kdt_round_finish entry point (validation, dispatch) and its CPU
// backend; the per-request logic is round_finish_core.h, shared with round_finish.cu.
#include <cstring>

#include "common.h"
#include "round_finish_core.h"

namespace kdt {

#if defined(KDT_WITH_CUDA)
kdt_status round_finish_cuda(const round::FinishArgs& a, void* stream);  // round_finish.cu
#endif

namespace {

kdt_status round_finish_cpu(const round::FinishArgs& a) {
  for (int b = 0; b < a.bs; ++b) {
    for (int k = 0; k < a.n; ++k) {
      const long long dst = round::ctx_row(a, b, k);
      if (dst < 0) continue;
      const int node = a.accept_index[size_t(b) * a.n + k];
      std::memcpy(a.hidden_ctx + size_t(dst) * a.D, a.hidden + (size_t(b) * a.n + node) * a.D,
                  sizeof(float) * a.D);
    }
    if (round::real_slot(a, b)) a.next_root[a.rows[b]] = a.bonus[b];
    for (int j = 0; j < a.n + 2; ++j) a.result[size_t(b) * (a.n + 2) + j] = round::result_at(a, b, j);
  }
  return KDT_OK;
}

}  // namespace
}  // namespace kdt

extern "C" kdt_status kdt_round_finish(kdt_backend backend, void* stream, int32_t bs, int32_t n,
                                       int32_t D, int32_t max_seq, int32_t scratch_slot,
                                       const int64_t* rows, const int64_t* prefix,
                                       const int64_t* tokens, const int32_t* num_nodes,
                                       const int32_t* accept_index, const int32_t* accept_len,
                                       const int64_t* bonus, const float* hidden,
                                       float* hidden_ctx, int64_t* next_root, int32_t* result) {
  static const char* fn = "kdt_round_finish";
  kdt::clear_error();
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend=%d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", (int)backend);
  KDT_CHECK_ARG(bs >= 0 && n >= 1 && D >= 1 && max_seq >= 1 && scratch_slot >= 0, fn,
                "bs=%d n=%d D=%d max_seq=%d scratch_slot=%d: need bs >= 0, the others >= 1 "
                "(scratch_slot >= 0)", bs, n, D, max_seq, scratch_slot);
  if (bs == 0) return KDT_OK;
  for (const void* p : {(const void*)rows, (const void*)prefix, (const void*)tokens,
                        (const void*)accept_index, (const void*)accept_len, (const void*)bonus,
                        (const void*)hidden, (const void*)hidden_ctx, (const void*)next_root,
                        (const void*)result})
    KDT_CHECK_ARG(p != nullptr, fn, "a buffer other than num_nodes is NULL");
  const kdt::round::FinishArgs a{bs,     n,         D,            max_seq,    scratch_slot,
                                 rows,   prefix,    tokens,       num_nodes,  accept_index,
                                 accept_len, bonus, hidden,       hidden_ctx, next_root,
                                 result};
  if (backend == KDT_BACKEND_CPU) return kdt::round_finish_cpu(a);
#if defined(KDT_WITH_CUDA)
  return kdt::round_finish_cuda(a, stream);
#else
  (void)stream;
  return kdt::cuda_unsupported(fn);
#endif
}
