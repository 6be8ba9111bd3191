// tree_accept_cpu.cpp: the kdt_tree_accept entry point (validation, dispatch) and its CPU
// backend. The walk lives in tree_accept_core.h, shared with the CUDA kernel (tree_accept.cu).
#include "common.h"
#include "tree_accept_core.h"
#include "tree_kernels.h"

namespace kdt {

kdt_status tree_accept_cpu(const TreeAcceptArgs& a) {
  for (int b = 0; b < a.bs; ++b) {
    const size_t o = (size_t)b * a.n;
    int32_t* idx = a.accept_index + o;
    for (int i = 0; i < a.n; ++i) idx[i] = -1;
    const int nn = a.num_nodes ? a.num_nodes[b] : a.n;
    const tree::AcceptResult r =
        tree::accept_one(a.n, nn, a.tokens + o, a.first_child + o, a.next_sibling + o,
                         a.target_argmax + o, idx);
    a.accept_len[b] = r.len;
    a.bonus[b] = r.bonus;
    a.status[b] = r.status;
  }
  return KDT_OK;
}

}  // namespace kdt

extern "C" kdt_status kdt_tree_accept(kdt_backend backend, void* stream, int32_t bs, int32_t n,
                                      const int64_t* tokens, const int64_t* first_child,
                                      const int64_t* next_sibling, const int32_t* num_nodes,
                                      const int64_t* target_argmax, int32_t* accept_index,
                                      int32_t* accept_len, int64_t* bonus, int32_t* status) {
  static const char* fn = "kdt_tree_accept";
  kdt::clear_error();
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend=%d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", (int)backend);
  KDT_CHECK_ARG(bs >= 0, fn, "bs=%d must be >= 0", bs);
  KDT_CHECK_ARG(n >= 1, fn, "n=%d must be >= 1 (the root slot)", n);
  if (bs == 0) return KDT_OK;
  KDT_CHECK_PTR(tokens, fn);
  KDT_CHECK_PTR(first_child, fn);
  KDT_CHECK_PTR(next_sibling, fn);
  KDT_CHECK_PTR(target_argmax, fn);
  KDT_CHECK_PTR(accept_index, fn);
  KDT_CHECK_PTR(accept_len, fn);
  KDT_CHECK_PTR(bonus, fn);
  KDT_CHECK_PTR(status, fn);
  const kdt::TreeAcceptArgs args{bs,        n,           tokens,     first_child, next_sibling,
                                 num_nodes, target_argmax, accept_index, accept_len, bonus,
                                 status};
  if (backend == KDT_BACKEND_CPU) return kdt::tree_accept_cpu(args);
#if defined(KDT_WITH_CUDA)
  return kdt::tree_accept_cuda(args, stream);
#else
  (void)stream;
  return kdt::cuda_unsupported(fn);
#endif
}
