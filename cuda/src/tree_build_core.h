// tree_build_core.h: the DDTree best-first build (DDTREE.md section 2) as __host__ __device__
// code shared by the CPU backend (tree_build_cpu.cpp) and the serial CUDA kernel
// (tree_build_serial.cu), so that both run the very same float64 operations in the very same
// order.
//
// One request at a time. The caller provides scratch for n = budget + 1 slots:
//   heap_score [n] double, heap_cand [n] uint32   the frontier (a binary heap, best on top)
//   node_score [n] double, node_cand [n] uint32   emitted nodes in pop order (slot 0 = root)
//   first_child [n] int16, next_sibling [n] int16 SGLang-style child lists (prepend rule)
//   node_key [n] uint64                           each node's rank-path prefix key (below)
// The frontier never holds more than budget + 1 entries: pop k (1-based) leaves at most k
// entries before its (at most two) pushes, and the loop stops after `budget` pops.
//
// A candidate is the rank path path(parent) + (rank) at depth `depth`; it is packed in 32 bits
// as parent (11 bits, < 1025) | rank (10 bits, < 1024) | depth (6 bits, <= 32).
#pragma once

#include <stdint.h>

#include "kdtree/hd.h"

namespace kdt {
namespace tree {

constexpr int kMaxBudget = 1024;
constexpr int kMaxDepth = 32;

KDT_HD uint32_t pack(uint32_t parent, uint32_t rank, uint32_t depth) {
  return (parent << 16) | (rank << 6) | depth;
}
KDT_HD int cand_parent(uint32_t c) { return (int)(c >> 16); }
KDT_HD int cand_rank(uint32_t c) { return (int)((c >> 6) & 0x3FFu); }
KDT_HD int cand_depth(uint32_t c) { return (int)(c & 0x3Fu); }

// Rank-path prefix keys make most tie-breaks O(1): the ranks at depths 1..key_depth are packed
// from the top bit down, key_bits each (key_bits = ceil(log2 K), so every rank fits), and
// missing depths read as 0. For two distinct paths whose keys differ, the key order IS the
// lexicographic order: at the first differing depth either both ranks exist (the smaller wins)
// or the shorter path has ended there (a padded 0 against a rank > 0: the prefix wins, as it
// must). Equal keys with both depths <= key_depth mean one path is a prefix of the other: the
// shallower wins. Only deeper equal-key pairs walk the parents (compare_paths).
struct Scratch {
  double* heap_score;
  uint32_t* heap_cand;
  double* node_score;
  uint32_t* node_cand;
  int16_t* first_child;
  int16_t* next_sibling;
  uint64_t* node_key;
  int key_bits, key_depth;
};

// Sets the key layout for a [L, K] request (see Scratch).
KDT_HD void set_key_layout(Scratch& s, int L, int K) {
  int bits = 1;
  while ((1 << bits) < K) ++bits;
  s.key_bits = bits;
  s.key_depth = 64 / bits < L ? 64 / bits : L;
}

KDT_HD uint64_t cand_key(uint32_t c, const Scratch& s) {
  const int d = cand_depth(c);
  uint64_t k = s.node_key[cand_parent(c)];
  if (d <= s.key_depth) k |= (uint64_t)cand_rank(c) << (64 - s.key_bits * d);
  return k;
}

// Lexicographic comparison of two distinct candidates' rank paths: < 0 when a sorts first
// (a proper prefix sorts first). Walks emitted nodes' parents: O(L) per call; it only runs
// on exact float64 score ties, which are common (bf16 logits give equal log-probs). Inlined
// like the rest: out of line (__noinline__) on CUDA, with the parallel build's zero_score, the
// one-warp kernels' code shrank (S = 32: 259 KB -> 83 KB) but the parallel kernel's registers
// rose from 80 to 128, and the H200 measured 1.03-1.06x at budgets 15 to 255 (bench.tree_ab).
// Its loops and zero_score's kept rolled instead (unroll 1): the parallel kernel's code 151 ->
// 123 KB, the one-warp kernel's (S = 32) 259 -> 112 KB, but the parallel build took the same
// time (0.99-1.02x at budgets 63 to 1023: its instruction fetch is not what it waits on) and
// the one-warp build 1.02-1.065x (a pop's tie walks).
KDT_HD int compare_paths(uint32_t a, uint32_t b, const uint32_t* node_cand) {
  const int da = cand_depth(a), db = cand_depth(b);
  // (parent, rank) name the path element at the current depth of each walk.
  int pa = cand_parent(a), ra = cand_rank(a), pb = cand_parent(b), rb = cand_rank(b);
  int d = da;
  for (; d > db; --d) { const uint32_t c = node_cand[pa]; pa = cand_parent(c); ra = cand_rank(c); }
  for (int e = db; e > da; --e) { const uint32_t c = node_cand[pb]; pb = cand_parent(c); rb = cand_rank(c); }
  if (pa == pb && ra == rb) return da < db ? -1 : (da > db ? 1 : 0);  // one is a prefix
  // Same depth, different elements: climb until both hang under one node. Depth-1 elements
  // all hang under the root (parent 0), so this ends after at most L steps.
  while (pa != pb) {
    const uint32_t ca = node_cand[pa], cb = node_cand[pb];
    pa = cand_parent(ca); ra = cand_rank(ca);
    pb = cand_parent(cb); rb = cand_rank(cb);
  }
  return ra < rb ? -1 : 1;
}

// The rank-path order of two distinct candidates (< 0: a first), O(1) unless their keys agree
// below key_depth.
KDT_HD int compare_cands(uint32_t a, uint32_t b, const Scratch& s) {
  const uint64_t ka = cand_key(a, s), kb = cand_key(b, s);
  if (ka != kb) return ka < kb ? -1 : 1;
  const int da = cand_depth(a), db = cand_depth(b);
  if (da <= s.key_depth && db <= s.key_depth) return da < db ? -1 : (da > db ? 1 : 0);
  return compare_paths(a, b, s.node_cand);
}

// True when heap entry i is popped before entry j: score descending, then rank path ascending.
KDT_HD bool heap_before(const Scratch& s, int i, int j) {
  const double si = s.heap_score[i], sj = s.heap_score[j];
  if (si != sj) return si > sj;
  return compare_cands(s.heap_cand[i], s.heap_cand[j], s) < 0;
}

KDT_HD void heap_swap(const Scratch& s, int i, int j) {
  const double ts = s.heap_score[i]; s.heap_score[i] = s.heap_score[j]; s.heap_score[j] = ts;
  const uint32_t tc = s.heap_cand[i]; s.heap_cand[i] = s.heap_cand[j]; s.heap_cand[j] = tc;
}

KDT_HD void heap_push(const Scratch& s, int& size, double score, uint32_t cand) {
  int i = size++;
  s.heap_score[i] = score;
  s.heap_cand[i] = cand;
  while (i > 0) {
    const int p = (i - 1) / 2;
    if (!heap_before(s, i, p)) break;
    heap_swap(s, i, p);
    i = p;
  }
}

// Moves the best entry to index `size - 1` (after --size) and restores the heap above it.
KDT_HD void heap_pop(const Scratch& s, int& size) {
  --size;
  heap_swap(s, 0, size);
  int i = 0;
  for (;;) {
    const int l = 2 * i + 1, r = l + 1;
    int best = i;
    if (l < size && heap_before(s, l, best)) best = l;
    if (r < size && heap_before(s, r, best)) best = r;
    if (best == i) break;
    heap_swap(s, i, best);
    i = best;
  }
}

// Runs the best-first build for one request. lp is [L, K] float32 (rows sorted descending).
// Fills node_cand / node_score for slots 0..count and the child lists; returns count + 1 (the
// number of slots used, root included). Slot 0: node_cand = 0, node_score = 0.0.
// The caller sets the key layout first (set_key_layout).
KDT_HD int build_one(const float* lp, int L, int K, int budget, const Scratch& s) {
  s.node_cand[0] = 0;
  s.node_key[0] = 0;
  s.node_score[0] = 0.0;
  s.first_child[0] = -1;
  s.next_sibling[0] = -1;
  int size = 0;
  heap_push(s, size, (double)lp[0], pack(0, 0, 1));
  int count = 0;
  while (size > 0 && count < budget) {
    heap_pop(s, size);
    const double score = s.heap_score[size];
    const uint32_t cand = s.heap_cand[size];
    const int parent = cand_parent(cand), rank = cand_rank(cand), depth = cand_depth(cand);
    const int i = ++count;
    s.node_cand[i] = cand;
    s.node_key[i] = cand_key(cand, s);
    s.node_score[i] = score;
    s.first_child[i] = -1;
    s.next_sibling[i] = s.first_child[parent];  // prepend: lists run in descending index
    s.first_child[parent] = (int16_t)i;
    const float* row = lp + (size_t)(depth - 1) * K;
    if (rank + 1 < K) {
      // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2)
      const double sib = (score - (double)row[rank]) + (double)row[rank + 1];
      heap_push(s, size, sib, pack(parent, rank + 1, depth));
    }
    if (depth < L) {
      heap_push(s, size, score + (double)lp[(size_t)depth * K], pack(i, 0, depth + 1));
    }
  }
  return count + 1;
}

}  // namespace tree
}  // namespace kdt
