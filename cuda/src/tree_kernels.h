// tree_kernels.h: internal argument bundles of the two tree kernels and their backends.
// The entry points (kdt_tree_build, kdt_tree_accept) validate, then call one of these.
#pragma once

#include <stdint.h>

#include "kdtree/kdtree.h"

namespace kdt {

// Shapes as in kdtree.h (n = budget + 1, W = ceil(n / 32)); already validated.
struct TreeBuildArgs {
  int bs, L, K, budget;
  const float* top_logp;    // [bs, L, K]
  const int64_t* top_ids;   // [bs, L, K]
  const int64_t* root_ids;  // [bs]
  const int64_t* seq_lens;  // [bs]
  int64_t* tokens;          // [bs, n]
  int32_t* parents;         // [bs, n]
  int32_t* depths;          // [bs, n]
  int64_t* positions;       // [bs, n]
  int64_t* first_child;     // [bs, n]
  int64_t* next_sibling;    // [bs, n]
  uint32_t* visibility;     // [bs, n, W]
  int32_t* num_nodes;       // [bs]
  double* scores;           // [bs, n] or nullptr
};

struct TreeAcceptArgs {
  int bs, n;
  const int64_t* tokens;         // [bs, n]
  const int64_t* first_child;    // [bs, n]
  const int64_t* next_sibling;   // [bs, n]
  const int32_t* num_nodes;      // [bs] or nullptr (every request uses n)
  const int64_t* target_argmax;  // [bs, n]
  int32_t* accept_index;         // [bs, n]
  int32_t* accept_len;           // [bs]
  int64_t* bonus;                // [bs]
  int32_t* status;               // [bs]
};

kdt_status tree_build_cpu(const TreeBuildArgs& a);
kdt_status tree_accept_cpu(const TreeAcceptArgs& a);
#if defined(KDT_WITH_CUDA)
kdt_status tree_build_cuda(const TreeBuildArgs& a, void* stream);
kdt_status tree_accept_cuda(const TreeAcceptArgs& a, void* stream);
#endif

}  // namespace kdt
