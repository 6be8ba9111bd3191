// tree_accept_core.h: the bounded greedy accept walk (DDTREE.md section 4) for one request,
// shared by the CPU backend (tree_accept_cpu.cpp) and the CUDA kernel (tree_accept.cu).
//
// Arrays are one request's rows of length n. The walk never reads outside [0, n) and takes at
// most n accept steps and n links per child scan, so a malformed tree cannot hang it.
// Status (kdt_accept_status): 1 a link outside [1, num_nodes) (or num_nodes outside [1, n]),
// 2 a child scan or the walk exceeded n steps, 3 two children of one node carry the matched
// token. The first defect met wins; the nodes accepted before it stay accepted.
#pragma once

#include <stdint.h>

#include "kdtree/kdtree.h"
#include "tree_build_core.h"  // KDT_HD

namespace kdt {
namespace tree {

struct AcceptResult {
  int32_t len;
  int32_t status;
  int64_t bonus;
};

// accept_index [n] receives the accepted node indices (root first); the caller fills the rest
// with -1. Each child list is scanned to its end so that a duplicate match is always seen.
// Link is int64_t (the caller's arrays) or int32_t (the CUDA kernel's shared-memory copy, where
// link_narrow has mapped every out-of-range value to one that fails the same test).
template <class Link>
KDT_HD AcceptResult accept_one(int n, int num_nodes, const int64_t* tokens,
                               const Link* first_child, const Link* next_sibling,
                               const int64_t* target_argmax, int32_t* accept_index) {
  AcceptResult r{1, KDT_ACCEPT_OK, target_argmax[0]};
  accept_index[0] = 0;
  if (num_nodes < 1 || num_nodes > n) {
    r.status = KDT_ACCEPT_OUT_OF_RANGE;
    return r;
  }
  int64_t cur = 0;
  for (;;) {
    const int64_t want = target_argmax[cur];
    int64_t match = -1;
    int64_t c = (int64_t)first_child[cur];
    for (int steps = 0; c != -1; ++steps) {
      if (c < 1 || c >= num_nodes) { r.status = KDT_ACCEPT_OUT_OF_RANGE; break; }
      if (steps >= n) { r.status = KDT_ACCEPT_CYCLE; break; }
      if (tokens[c] == want) {
        if (match != -1) { r.status = KDT_ACCEPT_DUPLICATE; break; }
        match = c;
      }
      c = (int64_t)next_sibling[c];
    }
    if (r.status != KDT_ACCEPT_OK || match == -1) break;
    if (r.len >= n) { r.status = KDT_ACCEPT_CYCLE; break; }
    accept_index[r.len++] = (int32_t)match;
    cur = match;
  }
  r.bonus = target_argmax[cur];
  return r;
}

// A link as int32 for a tree of n slots: -1 stays -1 (end of list), [0, n) stays, anything
// below -1 becomes -2 and anything >= n becomes n, so that accept_one's test
// (c < 1 || c >= num_nodes, with num_nodes <= n) gives the same answer as on the original.
KDT_HD int32_t link_narrow(int64_t v, int n) {
  return v < -1 ? -2 : (v >= n ? n : (int32_t)v);
}

}  // namespace tree
}  // namespace kdt
