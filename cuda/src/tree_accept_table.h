// tree_accept_table.h: the greedy accept (DDTREE.md section 4) by one warp through a match table
// instead of sibling-list scans, as __host__ __device__ phases: the CUDA kernel (tree_accept.cu)
// runs each phase on 32 lanes with a warp barrier between phases; the CPU backend
// (tree_accept_cpu.cpp, KDT_TREE_ACCEPT=table) runs the lanes of a phase one after another.
//
// For a tree whose links are well formed the walk's result depends only on, for each node p, the
// children c of p with tokens[c] == target_argmax[p]: none (stop), one (accept it, go on), two or
// more (status 3, stop). The phases find every node's parent without walking a list:
//   1. scatter: for each node i < num_nodes, its first child f gets pfc[f] = i and its next
//      sibling s gets up[s] = i (the sibling before s); in-degrees are counted, and a link out of
//      [1, num_nodes) (other than -1) marks the tree "irregular";
//   2. pointer jumping on up (up[c] = c at a list head) until no value changes (or log2 n + 1
//      rounds): up[c] is then the head of c's sibling list, and pfc[head] its parent;
//   3. each node c whose token matches its parent's target counts into cnt[parent] and writes
//      mt[parent] = c;
//   4. lane 0 follows mt from the root while cnt is 1.
// Regular means: every link of a node < num_nodes is -1 or in [1, num_nodes), and every node has
// in-degree <= 1. Then the nodes reachable from the root form a tree (a reachable cycle would
// need a node of in-degree 2, or the root, whose in-degree is 0 since 0 is not a valid link), so
// the reference walk meets no out-of-range link, no overlong scan and no overlong walk: its only
// possible defect is the duplicate, which cnt shows. Nodes off the root's tree may sit on cycles
// and get a meaningless parent, but that parent is then off the tree too (a path p -> head -> c
// leads from it to c), so it never enters the walk. An irregular tree (or num_nodes outside
// [1, n]) runs the reference walk (tree_accept_core.h) instead: statuses are exactly the
// reference's in every case.
#pragma once

#include <stdint.h>

#include "kdtree/kdtree.h"
#include "tree_accept_core.h"

namespace kdt {
namespace tree {
namespace acc {

KDT_HD int atomic_add(int* p, int v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, v);
#else
  const int o = *p;
  *p += v;
  return o;
#endif
}

// One request's working arrays (n entries each; shared memory on CUDA) and its scalars.
struct Table {
  const int64_t* tokens;
  const int64_t* want;   // target_argmax
  const int32_t* fc;     // links (narrowed: tree::link_narrow)
  const int32_t* ns;
  int32_t* pfc;          // the parent of a list head (-1: none)
  int32_t* up;           // the previous sibling, then the list head
  int32_t* deg;          // in-degree
  int32_t* cnt;          // matching children
  int32_t* mt;           // a matching child
  int* irregular;        // set by phase_scatter / phase_degrees
  int n, nn;             // slots, num_nodes
};

// Phase 0: clear (lane l of 32 takes every 32nd entry).
KDT_HD void phase_clear(const Table& t, int l) {
  for (int i = l; i < t.n; i += 32) {
    t.pfc[i] = -1;
    t.up[i] = i;
    t.deg[i] = 0;
    t.cnt[i] = 0;
  }
  if (l == 0) *t.irregular = t.nn < 1 || t.nn > t.n;
}

// Phase 1: scatter the links of nodes < num_nodes.
KDT_HD void phase_scatter(const Table& t, int l) {
  if (*t.irregular) return;
  for (int i = l; i < t.nn; i += 32) {
    const int f = t.fc[i], s = t.ns[i];
    if (f != -1) {
      if (f < 1 || f >= t.nn) *t.irregular = 1;
      else { atomic_add(&t.deg[f], 1); t.pfc[f] = i; }
    }
    if (s != -1) {
      if (s < 1 || s >= t.nn) *t.irregular = 1;
      else { atomic_add(&t.deg[s], 1); t.up[s] = i; }
    }
  }
}

// Phase 2 (repeated): one pointer-jumping round; also flags in-degrees above 1. Returns whether
// this lane changed a value.
KDT_HD bool phase_jump(const Table& t, int l) {
  bool changed = false;
  for (int c = l; c < t.nn; c += 32) {
    if (t.deg[c] > 1) *t.irregular = 1;
    const int u = t.up[c], uu = t.up[u];
    if (uu != u) { t.up[c] = uu; changed = true; }
  }
  return changed;
}

// Phase 3: the match counts.
KDT_HD void phase_match(const Table& t, int l) {
  for (int c = l + (l == 0 ? 32 : 0); c < t.nn; c += 32) {
    const int p = t.pfc[t.up[c]];
    if (p >= 0 && t.tokens[c] == t.want[p]) {
      atomic_add(&t.cnt[p], 1);
      t.mt[p] = c;
    }
  }
}

// Phase 4 (one lane): the walk over the table; accept_index[n] is already all -1. For an
// irregular tree, the reference walk over the same (narrowed) arrays.
KDT_HD AcceptResult phase_walk(const Table& t, int32_t* accept_index) {
  if (*t.irregular) return accept_one(t.n, t.nn, t.tokens, t.fc, t.ns, t.want, accept_index);
  AcceptResult r{1, KDT_ACCEPT_OK, 0};
  accept_index[0] = 0;
  int cur = 0;
  for (;;) {
    const int k = t.cnt[cur];
    if (k == 0) break;
    if (k > 1) { r.status = KDT_ACCEPT_DUPLICATE; break; }
    if (r.len >= t.n) { r.status = KDT_ACCEPT_CYCLE; break; }
    cur = t.mt[cur];
    accept_index[r.len++] = cur;
  }
  r.bonus = t.want[cur];
  return r;
}

// Rounds of phase_jump that suffice for any list of < n nodes.
KDT_HD int jump_rounds(int n) {
  int r = 1;
  while ((1 << r) < n) ++r;
  return r + 1;
}

}  // namespace acc
}  // namespace tree
}  // namespace kdt
