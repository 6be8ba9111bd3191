// tree_accept_cpu.cpp: the kdt_tree_accept entry point (validation, dispatch) and its CPU
// backend. The walk lives in tree_accept_core.h, shared with the CUDA kernel (tree_accept.cu).
// KDT_TREE_ACCEPT=table (read per call) runs the CUDA kernel's match-table phases
// (tree_accept_table.h) lane by lane instead, so that they are tested without a GPU.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "tree_accept_core.h"
#include "tree_accept_table.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

// The match-table accept of one request, each phase for lanes 0..31 in turn (a warp barrier
// between phases, as on CUDA).
tree::AcceptResult table_one(const TreeAcceptArgs& a, int b, int32_t* idx) {
  const int n = a.n;
  const size_t o = (size_t)b * n;
  std::vector<int32_t> w((size_t)n * 7);
  int32_t* fc = w.data();
  int32_t* ns = fc + n;
  for (int i = 0; i < n; ++i) {
    fc[i] = tree::link_narrow(a.first_child[o + i], n);
    ns[i] = tree::link_narrow(a.next_sibling[o + i], n);
  }
  int irregular = 0;
  const tree::acc::Table t{a.tokens + o, a.target_argmax + o, fc, ns, ns + n, ns + 2 * n,
                           ns + 3 * n, ns + 4 * n, ns + 5 * n, &irregular, n,
                           a.num_nodes ? a.num_nodes[b] : n};
  for (int l = 0; l < 32; ++l) tree::acc::phase_clear(t, l);
  for (int l = 0; l < 32; ++l) tree::acc::phase_scatter(t, l);
  if (!irregular) {
    for (int r = 0; r < tree::acc::jump_rounds(n); ++r) {
      bool any = false;
      for (int l = 0; l < 32; ++l) any = tree::acc::phase_jump(t, l) || any;
      if (!any) break;
    }
    if (!irregular)
      for (int l = 0; l < 32; ++l) tree::acc::phase_match(t, l);
  }
  return tree::acc::phase_walk(t, idx);
}

bool table_from_env() {
  const char* v = std::getenv("KDT_TREE_ACCEPT");
  return v && std::strcmp(v, "table") == 0;
}

}  // namespace

kdt_status tree_accept_cpu(const TreeAcceptArgs& a) {
  const bool table = table_from_env();
  for (int b = 0; b < a.bs; ++b) {
    const size_t o = (size_t)b * a.n;
    int32_t* idx = a.accept_index + o;
    for (int i = 0; i < a.n; ++i) idx[i] = -1;
    const int nn = a.num_nodes ? a.num_nodes[b] : a.n;
    const tree::AcceptResult r =
        table ? table_one(a, b, idx)
              : tree::accept_one(a.n, nn, a.tokens + o, a.first_child + o, a.next_sibling + o,
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
