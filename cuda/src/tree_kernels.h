// tree_kernels.h: internal argument bundles of the two tree kernels and their backends.
// The entry points (kdt_tree_build, kdt_tree_accept) validate, then call one of these.
#pragma once

#include <stdint.h>

#include "kdtree/hd.h"
#include "kdtree/kdtree.h"
#include "tree_build_core.h"

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

// The outputs of a slot, in parts (write_tree_slot's parts: a mask).
enum : unsigned {
  kSlotTokens = 1,  // tokens, parents
  kSlotPlace = 2,   // depths, positions
  kSlotLinks = 4,   // first_child, next_sibling
  kSlotScore = 8,   // scores
  kSlotAll = 15
};

// Slot i of request row o = b * n from the node arrays (node order, slot 0 the root): every
// output but visibility and num_nodes (parts: those of kSlot*); slots >= used get -1 (and score
// 0). The CPU backend and the CUDA writers (block and warp) all write slots through this.
KDT_HD void write_tree_slot(const TreeBuildArgs& a, size_t o, int i, int used, int64_t root,
                            int64_t seq_len, const uint32_t* node_cand, const double* node_score,
                            const int16_t* fc, const int16_t* ns, const int64_t* ids,
                            unsigned parts = kSlotAll) {
  const bool tok = parts & kSlotTokens, place = parts & kSlotPlace, links = parts & kSlotLinks;
  const bool score = (parts & kSlotScore) && a.scores;
  if (i >= used) {
    if (tok) { a.tokens[o + i] = -1; a.parents[o + i] = -1; }
    if (place) { a.depths[o + i] = -1; a.positions[o + i] = -1; }
    if (links) { a.first_child[o + i] = -1; a.next_sibling[o + i] = -1; }
    if (score) a.scores[o + i] = 0.0;
    return;
  }
  const uint32_t c = node_cand[i];
  const int d = tree::cand_depth(c);
  if (tok) {
    a.tokens[o + i] = i == 0 ? root : ids[(size_t)(d - 1) * a.K + tree::cand_rank(c)];
    a.parents[o + i] = i == 0 ? -1 : tree::cand_parent(c);
  }
  if (place) {
    a.depths[o + i] = d;
    a.positions[o + i] = seq_len + d;
  }
  if (links) {
    a.first_child[o + i] = fc[i];
    a.next_sibling[o + i] = ns[i];
  }
  if (score) a.scores[o + i] = node_score[i];
}

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
// The three CUDA builds tree_build_cuda picks from (tree_build.cu). The parallel build sets
// *launched to false, launching nothing, for a budget whose layout fits no shared memory.
kdt_status tree_build_warp_cuda(const TreeBuildArgs& a, void* stream);
kdt_status tree_build_parallel_cuda(const TreeBuildArgs& a, void* stream, bool* launched);
kdt_status tree_build_serial_cuda(const TreeBuildArgs& a, void* stream);
kdt_status tree_accept_cuda(const TreeAcceptArgs& a, void* stream);
#endif

}  // namespace kdt
