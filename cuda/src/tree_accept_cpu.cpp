// tree_accept_cpu.cpp: the kdt_tree_accept entry point (validation, dispatch) and its CPU
// backend. The walk lives in tree_accept_core.h, shared with the CUDA kernel (tree_accept.cu).
// KDT_TREE_ACCEPT (read per call): "walk" or unset (the CPU default) is that walk; "parallel"
// runs the CUDA kernel's phases (tree_accept_parallel.h) thread by thread instead, for the n the
// kernel takes (n <= tree::apar::kMaxN; larger n walk, as on CUDA), so that they are tested
// without a GPU; "parallel-strict" fails with KDT_ERR_INTERNAL where the phases would fall back
// to the reference walk (tests use it to prove the parallel path ran).
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "tree_accept_core.h"
#include "tree_accept_parallel.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

enum class Algo { kWalk, kParallel, kStrict };

Algo algo_from_env() {
  const char* v = std::getenv("KDT_TREE_ACCEPT");
  if (v && std::strcmp(v, "parallel") == 0) return Algo::kParallel;
  if (v && std::strcmp(v, "parallel-strict") == 0) return Algo::kStrict;
  return Algo::kWalk;
}

// The block of the parallel accept, emulated: each phase for threads 0..T-1 in turn (a block
// barrier between phases, as on CUDA). The barrier-free pointer jumping runs in rounds of one
// step per thread, in ascending then descending thread order, so that threads read each
// other's jumps part-way as they do on the GPU.
struct ParallelBlock {
  std::vector<int64_t> sm;
  std::vector<tree::apar::Node> v;

  // Returns false where the request is irregular (the kernel falls back to the walk).
  bool run(const tree::apar::Request& q, tree::AcceptResult* r) {
    namespace ap = tree::apar;
    const int T = ap::threads_for(q.n);
    sm.assign((ap::shared_bytes(q.n) + 7) / 8, 0);
    v.resize((size_t)T);
    const ap::Shared s = ap::shared_at(sm.data(), q.n);
    for (int i = 0; i < T; ++i) v[i] = ap::phase_load(q, s, i);
    for (int i = 0; i < T; ++i) ap::phase_scatter(q, s, v[i], i);
    if (any_bad()) return false;
    for (int round = 0, busy = 1; busy; ++round) {
      busy = 0;
      for (int k = 0; k < T; ++k) {
        const int i = round % 2 ? T - 1 - k : k;
        if (v[i].done) continue;
        if (ap::parent_step(s, v[i], i, q.n)) ap::match(s, v[i], i);
        busy = 1;
      }
    }
    if (any_bad()) return false;
    *r = ap::phase_walk(s, q.n, q.accept_index);
    return true;
  }

  bool any_bad() const {
    for (const tree::apar::Node& x : v)
      if (x.bad) return true;
    return false;
  }
};

}  // namespace

kdt_status tree_accept_cpu(const TreeAcceptArgs& a) {
  static const char* fn = "kdt_tree_accept";
  const Algo algo = a.n <= tree::apar::kMaxN ? algo_from_env() : Algo::kWalk;
  ParallelBlock blk;
  for (int b = 0; b < a.bs; ++b) {
    const size_t o = (size_t)b * a.n;
    int32_t* idx = a.accept_index + o;
    for (int i = 0; i < a.n; ++i) idx[i] = -1;
    const int nn = a.num_nodes ? a.num_nodes[b] : a.n;
    const tree::apar::Request q{a.tokens + o,        a.first_child + o, a.next_sibling + o,
                                a.target_argmax + o, idx,               a.n, nn};
    tree::AcceptResult r;
    if (algo == Algo::kWalk || !blk.run(q, &r)) {
      if (algo == Algo::kStrict)
        return set_error(KDT_ERR_INTERNAL, fn,
                         "request %d: the parallel accept found the tree irregular; "
                         "KDT_TREE_ACCEPT=parallel-strict refuses the walk fallback", b);
      r = tree::apar::fallback(q);
    }
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
