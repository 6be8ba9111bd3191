// tree_accept_parallel.h: the greedy accept (DDTREE.md section 4) by one block per request, one
// thread per node, as __host__ __device__ phases: the CUDA kernel (tree_accept.cu) runs each
// phase on every thread with a block barrier between phases; the CPU backend
// (tree_accept_cpu.cpp, KDT_TREE_ACCEPT=parallel) runs the threads of a phase one after another.
//
// For a tree whose links are well formed the walk's result depends only on, for each node p, the
// children c of p with tokens[c] == target_argmax[p]: none (stop), one (accept it, go on), two or
// more (status 3, stop). Thread i owns node i; its four values (token, target, both links) are
// loaded once, all before any shared-memory store, and stay in registers. The phases:
//   load     the node's values; shared want[i], up[i] = i, pfc[i] = -1, mt[i] = -1; the
//            request's accept_index row gets 0 (i = 0) or -1 (thread 0 writes the path later);
//   scatter  (i < num_nodes) first child f: pfc[f] = i (the owner of the list f heads); next
//            sibling s: up[s] = i (the sibling before s), both by atomic exchange, so that a
//            second link into one node is seen; a link outside [1, num_nodes) (other than -1)
//            or to the node itself marks the request irregular;
//   parent   pointer jumping along up, without barriers, until up reaches a node that heads a
//            list: its pfc is the parent (first step also checks that no node is both a first
//            child and a next sibling); then the match: a node whose token equals its parent's
//            target writes mt[parent] = i by compare-and-swap, or -2 when one was there;
//   walk     (thread 0) from the root along mt: -1 stops, -2 is status 3.
// Regular means: every link of a node < num_nodes is -1 or in [1, num_nodes) and not the node
// itself, and every node has at most one incoming link. Then the nodes reachable from the root
// form a tree (a reachable cycle would need a node of in-degree 2, or the root, which no valid
// link names), each reachable sibling list is a simple path of fewer than n nodes, and the
// reference walk meets no out-of-range link, no overlong scan and no overlong walk: its only
// possible defect is the duplicate, which mt shows. Nodes off the root's tree may sit on sibling
// cycles: their jumping stops after n steps with no parent, and a node whose list head is owned
// by p lies on p's list, so a garbage parent is never a node of the walk. An irregular request
// (or num_nodes outside [1, n]) runs the reference walk (tree_accept_core.h) on the caller's
// arrays in the same launch: statuses are exactly the reference's in every case.
//
// The jumping needs no barrier: up[c] only ever moves from a node of c's list toward its head
// (a value read from another thread is the sibling before, or a node closer to the head), so
// each step advances at least one node whatever the interleaving, and a list of k nodes ends
// within k steps (about log2 k when the threads run side by side).
#pragma once

#include <stdint.h>

#include "kdtree/kdtree.h"
#include "tree_accept_core.h"

namespace kdt {
namespace tree {
namespace apar {

// One thread per node, one block per request: n <= kMaxN (larger trees take the walk kernel).
constexpr int kMaxN = 1024;

// Threads of the block for n slots: n rounded up to a whole warp.
KDT_HD int threads_for(int n) { return (n + 31) / 32 * 32; }

KDT_HD int32_t exchange(int32_t* p, int32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicExch(reinterpret_cast<int*>(p), v);
#else
  const int32_t o = *p;
  *p = v;
  return o;
#endif
}

KDT_HD int32_t compare_swap(int32_t* p, int32_t expect, int32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(reinterpret_cast<int*>(p), expect, v);
#else
  const int32_t o = *p;
  if (o == expect) *p = v;
  return o;
#endif
}

template <class T>
KDT_HD T load_ro(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// One request's rows (length n) in the caller's memory.
struct Request {
  const int64_t* tokens;
  const int64_t* first_child;
  const int64_t* next_sibling;
  const int64_t* want;  // target_argmax
  int32_t* accept_index;
  int n, nn;  // slots, num_nodes
};

// The block's shared arrays, n entries each.
struct Shared {
  int64_t* want;  // target_argmax
  int32_t* up;    // the sibling before (the node itself at a list head), then jumped
  int32_t* pfc;   // the node whose first child this node is (-1: none)
  int32_t* mt;    // the matching child (-1: none, -2: two or more)
};

// Bytes of shared memory for n slots, and the arrays carved from it (8-byte aligned base).
KDT_HD size_t shared_bytes(int n) { return (size_t)n * (sizeof(int64_t) + 3 * sizeof(int32_t)); }
KDT_HD Shared shared_at(int64_t* base, int n) {
  int32_t* w = reinterpret_cast<int32_t*>(base + n);
  return Shared{base, w, w + n, w + 2 * n};
}

// One thread's node, in registers.
struct Node {
  int64_t tok, want, fc, ns;
  int32_t jmp;     // pointer jumping: a node of this node's list, toward its head
  int32_t parent;  // -1: none (the root, a list nobody owns, a sibling cycle)
  int32_t steps;
  bool live;       // i < num_nodes, num_nodes valid
  bool done;       // parent known
  bool bad;        // this thread saw an irregularity
};

// Phase load (every thread of the block, i < threads_for(n)).
KDT_HD Node phase_load(const Request& q, const Shared& s, int i) {
  Node v{0, 0, -1, -1, i, -1, 0, false, true, false};
  const bool nn_ok = q.nn >= 1 && q.nn <= q.n;
  v.bad = !nn_ok;
  if (i >= q.n) return v;
  // Every load before any store: the four are in flight together.
  v.tok = load_ro(q.tokens + i);
  v.want = load_ro(q.want + i);
  v.fc = load_ro(q.first_child + i);
  v.ns = load_ro(q.next_sibling + i);
  s.up[i] = i;
  s.pfc[i] = -1;
  s.mt[i] = -1;
  q.accept_index[i] = i == 0 ? 0 : -1;
  s.want[i] = v.want;
  v.live = nn_ok && i < q.nn;
  v.done = !v.live;
  return v;
}

// Phase scatter (after a barrier: every slot is initialised).
KDT_HD void phase_scatter(const Request& q, const Shared& s, Node& v, int i) {
  if (!v.live) return;
  if (v.fc != -1) {
    if (v.fc < 1 || v.fc >= q.nn || v.fc == i) v.bad = true;
    else if (exchange(s.pfc + v.fc, i) != -1) v.bad = true;
  }
  if (v.ns != -1) {
    if (v.ns < 1 || v.ns >= q.nn || v.ns == i) v.bad = true;
    else if (exchange(s.up + v.ns, i) != (int32_t)v.ns) v.bad = true;
  }
}

// One step of phase parent (after a barrier: scatter is complete, pfc is final; up changes under
// the step, see the header). Returns v.done.
KDT_HD bool parent_step(const Shared& s, Node& v, int i, int n) {
  if (v.done) return true;
  volatile int32_t* up = s.up;
  const int32_t pa = s.pfc[v.jmp];
  const int32_t a = up[v.jmp];
  if (v.steps == 0 && pa != -1 && a != i) v.bad = true;  // a first child with a sibling before it
  if (pa != -1) {
    v.parent = pa;
    v.done = true;
  } else if (a == v.jmp || ++v.steps > n) {
    v.done = true;  // a list head nobody owns, or a sibling cycle: no parent
  } else {
    v.jmp = a;
    up[i] = a;
  }
  return v.done;
}

// The match of phase parent, once v.done.
KDT_HD void match(const Shared& s, const Node& v, int i) {
  if (v.parent < 0 || v.tok != s.want[v.parent]) return;
  if (compare_swap(s.mt + v.parent, -1, i) != -1) exchange(s.mt + v.parent, -2);
}

// Phase walk (thread 0, after a barrier; regular requests only): accept_index[0] is 0 and the
// rest -1 already.
KDT_HD AcceptResult phase_walk(const Shared& s, int n, int32_t* accept_index) {
  AcceptResult r{1, KDT_ACCEPT_OK, 0};
  int32_t cur = 0;
  for (;;) {
    const int32_t m = s.mt[cur];
    if (m == -1) break;
    if (m == -2) { r.status = KDT_ACCEPT_DUPLICATE; break; }
    if (r.len >= n) { r.status = KDT_ACCEPT_CYCLE; break; }
    accept_index[r.len++] = m;
    cur = m;
  }
  r.bonus = s.want[cur];
  return r;
}

// The reference walk on the caller's arrays, for an irregular request (thread 0).
KDT_HD AcceptResult fallback(const Request& q) {
  return accept_one(q.n, q.nn, q.tokens, q.first_child, q.next_sibling, q.want, q.accept_index);
}

}  // namespace apar
}  // namespace tree
}  // namespace kdt
