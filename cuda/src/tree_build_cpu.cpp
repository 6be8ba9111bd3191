// tree_build_cpu.cpp: the kdt_tree_build entry point (validation, dispatch) and its CPU backend.
// The algorithm lives in tree_build_core.h, shared with the CUDA kernel (tree_build.cu).
#include <cstring>
#include <vector>

#include "common.h"
#include "tree_build_core.h"
#include "tree_kernels.h"

namespace kdt {

kdt_status tree_build_cpu(const TreeBuildArgs& a) {
  const int n = a.budget + 1, W = (n + 31) / 32;
  std::vector<double> heap_score(n), node_score(n);
  std::vector<uint32_t> heap_cand(n), node_cand(n);
  std::vector<int16_t> first_child(n), next_sibling(n);
  std::vector<uint64_t> node_key(n);
  tree::Scratch s{heap_score.data(), heap_cand.data(),    node_score.data(), node_cand.data(),
                  first_child.data(), next_sibling.data(), node_key.data(),   0, 0};
  tree::set_key_layout(s, a.L, a.K);
  for (int b = 0; b < a.bs; ++b) {
    const size_t lk = (size_t)a.L * a.K;
    const float* lp = a.top_logp + b * lk;
    const int64_t* ids = a.top_ids + b * lk;
    const int used = tree::build_one(lp, a.L, a.K, a.budget, s);
    const size_t o = (size_t)b * n;
    for (int i = 0; i < n; ++i) {
      if (i >= used) {
        a.tokens[o + i] = -1; a.parents[o + i] = -1; a.depths[o + i] = -1;
        a.positions[o + i] = -1; a.first_child[o + i] = -1; a.next_sibling[o + i] = -1;
        if (a.scores) a.scores[o + i] = 0.0;
        continue;
      }
      const uint32_t c = node_cand[i];
      const int d = tree::cand_depth(c);
      a.tokens[o + i] = i == 0 ? a.root_ids[b] : ids[(size_t)(d - 1) * a.K + tree::cand_rank(c)];
      a.parents[o + i] = i == 0 ? -1 : tree::cand_parent(c);
      a.depths[o + i] = d;
      a.positions[o + i] = a.seq_lens[b] + d;
      a.first_child[o + i] = first_child[i];
      a.next_sibling[o + i] = next_sibling[i];
      if (a.scores) a.scores[o + i] = node_score[i];
    }
    // Row i = its parent's row plus bit i (parents come first): one row copy per node. The
    // CUDA kernel computes the same words independently per thread (tree::visibility_word).
    uint32_t* vis = a.visibility + (size_t)b * n * W;
    std::memset(vis, 0, sizeof(uint32_t) * (size_t)n * W);
    vis[0] = 1u;
    for (int i = 1; i < used; ++i) {
      const int p = tree::cand_parent(node_cand[i]);
      std::memcpy(vis + (size_t)i * W, vis + (size_t)p * W, sizeof(uint32_t) * (size_t)(p / 32 + 1));
      vis[(size_t)i * W + i / 32] |= 1u << (i % 32);
    }
    a.num_nodes[b] = used;
  }
  return KDT_OK;
}

}  // namespace kdt

extern "C" kdt_status kdt_tree_build(kdt_backend backend, void* stream, int32_t bs, int32_t L,
                                     int32_t K, int32_t budget, const float* top_logp,
                                     const int64_t* top_ids, const int64_t* root_ids,
                                     const int64_t* seq_lens, int64_t* tokens, int32_t* parents,
                                     int32_t* depths, int64_t* positions, int64_t* first_child,
                                     int64_t* next_sibling, uint32_t* visibility,
                                     int32_t* num_nodes, double* scores) {
  static const char* fn = "kdt_tree_build";
  kdt::clear_error();
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend=%d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", (int)backend);
  KDT_CHECK_ARG(bs >= 0, fn, "bs=%d must be >= 0", bs);
  KDT_CHECK_ARG(budget >= 1 && budget <= kdt::tree::kMaxBudget, fn,
                "budget=%d must be in [1, %d]", budget, kdt::tree::kMaxBudget);
  KDT_CHECK_ARG(L >= 1 && L <= kdt::tree::kMaxDepth, fn, "L=%d must be in [1, %d]", L,
                kdt::tree::kMaxDepth);
  KDT_CHECK_ARG(K >= 1 && K <= budget, fn, "K=%d must be in [1, budget=%d]", K, budget);
  if (bs == 0) return KDT_OK;
  KDT_CHECK_PTR(top_logp, fn);
  KDT_CHECK_PTR(top_ids, fn);
  KDT_CHECK_PTR(root_ids, fn);
  KDT_CHECK_PTR(seq_lens, fn);
  KDT_CHECK_PTR(tokens, fn);
  KDT_CHECK_PTR(parents, fn);
  KDT_CHECK_PTR(depths, fn);
  KDT_CHECK_PTR(positions, fn);
  KDT_CHECK_PTR(first_child, fn);
  KDT_CHECK_PTR(next_sibling, fn);
  KDT_CHECK_PTR(visibility, fn);
  KDT_CHECK_PTR(num_nodes, fn);
  const kdt::TreeBuildArgs args{bs,       L,         K,          budget,      top_logp,
                                top_ids,  root_ids,  seq_lens,   tokens,      parents,
                                depths,   positions, first_child, next_sibling, visibility,
                                num_nodes, scores};
  if (backend == KDT_BACKEND_CPU) return kdt::tree_build_cpu(args);
#if defined(KDT_WITH_CUDA)
  return kdt::tree_build_cuda(args, stream);
#else
  (void)stream;
  return kdt::cuda_unsupported(fn);
#endif
}
