// tree_build_device.cuh: device code the CUDA tree builds share (tree_build_serial.cu,
// tree_build_parallel.cu, tree_build_warp.cu): the serial warp selection, which the parallel
// build also runs for a request it declines, the output writers, and the token ids' early copies.
// Included by each of those .cu files alone; in an unnamed namespace, as each file's own helpers
// are (one copy a translation unit, nothing exported).
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>

#include "tree_build_core.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr uint32_t kNone = 0xFFFFFFFFu;  // "no candidate" in the warp argmax
constexpr unsigned kFull = 0xFFFFFFFFu;

__device__ bool better(double sa, uint32_t ca, double sb, uint32_t cb, const tree::Scratch& s) {
  if (cb == kNone) return ca != kNone;
  if (ca == kNone) return false;
  if (sa != sb) return sa > sb;
  return tree::compare_cands(ca, cb, s) < 0;
}

// Warp-cooperative best-first selection for one request (called by all 32 lanes of a warp);
// returns the number of slots used (root included), as tree::build_one does.
__device__ int warp_build_one(const float* lp, int L, int K, int budget, const tree::Scratch& s) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    s.node_cand[0] = 0;
    s.node_key[0] = 0;
    s.node_score[0] = 0.0;
    s.first_child[0] = -1;
    s.next_sibling[0] = -1;
    s.heap_score[0] = (double)lp[0];
    s.heap_cand[0] = tree::pack(0, 0, 1);
  }
  int F = 1, count = 0;  // frontier size and nodes emitted: the same in every lane
  __syncwarp();
  while (F > 0 && count < budget) {
    double best_s = 0.0;
    uint32_t best_c = kNone;
    int best_i = -1;
    for (int i = lane; i < F; i += 32) {
      const double sc = s.heap_score[i];
      const uint32_t c = s.heap_cand[i];
      if (better(sc, c, best_s, best_c, s)) { best_s = sc; best_c = c; best_i = i; }
    }
    // Butterfly: both partners keep the better of the two, so every lane ends with the argmax
    // (the order is strict: distinct candidates have distinct rank paths).
    for (int off = 16; off > 0; off >>= 1) {
      const double os = __shfl_xor_sync(kFull, best_s, off);
      const uint32_t oc = __shfl_xor_sync(kFull, best_c, off);
      const int oi = __shfl_xor_sync(kFull, best_i, off);
      if (better(os, oc, best_s, best_c, s)) { best_s = os; best_c = oc; best_i = oi; }
    }
    const int parent = tree::cand_parent(best_c), rank = tree::cand_rank(best_c);
    const int depth = tree::cand_depth(best_c);
    const int i = ++count;
    const bool sib = rank + 1 < K, child = depth < L;
    __syncwarp();  // every lane is done reading the frontier before lane 0 rewrites it
    if (lane == 0) {
      s.node_cand[i] = best_c;
      s.node_key[i] = tree::cand_key(best_c, s);
      s.node_score[i] = best_s;
      s.first_child[i] = -1;
      s.next_sibling[i] = s.first_child[parent];  // prepend: lists run in descending index
      s.first_child[parent] = (int16_t)i;
      int f = F - 1;  // remove the winner: the last entry takes its slot
      s.heap_score[best_i] = s.heap_score[f];
      s.heap_cand[best_i] = s.heap_cand[f];
      const float* row = lp + (size_t)(depth - 1) * K;
      if (sib) {
        // (score - lp[d-1][r]) + lp[d-1][r+1], left to right in float64 (DDTREE.md section 2)
        s.heap_score[f] = (best_s - (double)row[rank]) + (double)row[rank + 1];
        s.heap_cand[f++] = tree::pack(parent, rank + 1, depth);
      }
      if (child) {
        s.heap_score[f] = best_s + (double)lp[(size_t)depth * K];
        s.heap_cand[f++] = tree::pack(i, 0, depth + 1);
      }
    }
    F = F - 1 + (sib ? 1 : 0) + (child ? 1 : 0);
    __syncwarp();  // lane 0's writes are visible before the next scan
  }
  return count + 1;
}


// Visibility rows first, first + stride, ...: one ancestor walk per row (descending indices)
// emits the row's words from the last down (the warp writer: a lane per row).
__device__ void write_visibility_rows(uint32_t* vis, int n, int W, int used,
                                      const uint32_t* node_cand, int first, int stride) {
  KDT_NO_UNROLL
  for (int i = first; i < n; i += stride) {
    uint32_t* row = vis + (size_t)i * W;
    int cw = W - 1;
    uint32_t word = 0;
    if (i < used) {
      int x = i;
      for (;;) {
        const int xw = x >> 5;
        while (cw > xw) { row[cw--] = word; word = 0; }
        word |= 1u << (x & 31);
        if (x == 0) break;
        x = tree::cand_parent(node_cand[x]);
      }
    }
    while (cw >= 0) { row[cw--] = word; word = 0; }
  }
}

// Zeroes p[0, count) with the whole block: 16-byte stores between a scalar head and tail.
__device__ void block_zero(uint32_t* p, int count) {
  const int head = min(count, (int)((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / 4);
  const int body = (count - head) / 4;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  for (int k = threadIdx.x; k < body; k += blockDim.x) v[k] = make_uint4(0u, 0u, 0u, 0u);
  const int t = threadIdx.x;
  if (t < head) p[t] = 0u;
  const int tail = head + 4 * body;
  if (t < count - tail) p[tail + t] = 0u;
}

// The block writer: every word zeroed (block_zero), a block barrier (it orders the block's
// global writes), then each row's walk ORs nothing but stores only its nonzero words (at most
// depth + 1 of them). mark(id): a profiling probe.
template <class Mark>
__device__ void block_write_visibility(uint32_t* vis, int n, int W, int used,
                                       const uint32_t* node_cand, int first, Mark mark) {
  block_zero(vis, n * W);
  __syncthreads();
  mark(97);
  for (int i = first; i < used; i += blockDim.x) {
    uint32_t* row = vis + (size_t)i * W;
    int cw = i >> 5;
    uint32_t word = 0;
    int x = i;
    for (;;) {
      const int xw = x >> 5;
      if (xw != cw) { row[cw] = word; word = 0; cw = xw; }
      word |= 1u << (x & 31);
      if (x == 0) break;
      x = tree::cand_parent(node_cand[x]);
    }
    row[cw] = word;
  }
}

// The whole block writes one request's outputs from the node arrays (node order, slot 0 the
// root): slots, links, visibility words. root and seq_len: the request's (loaded early by the
// caller). mark(id): a profiling probe. (The parallel build writing every slot but
// first_child, and rows of up to two words walked through the pool, in its nodes phase
// instead, first_child alone after it: at bs 64, budget 63 the nodes phase took 1641 cycles
// against 568 and what followed it 682 against 1623, so budget 63 took 1.00-1.02x and budgets
// 127-1023 0.98-1.035x (H200, bench.tree_ab); the kernel's registers rose from 80 to 84-96,
// two blocks of 256 threads a multiprocessor instead of three, and bs 1024, budget 63 took
// 1.23-1.25x (capped at 80 with __maxnreg__, 1.01-1.13x everywhere). Not kept.)
template <class Mark>
__device__ void write_outputs(const TreeBuildArgs& a, int b, int n, int W, int used,
                              const uint32_t* node_cand, const double* node_score,
                              const int16_t* fc, const int16_t* ns, const int64_t* ids,
                              int64_t root, int64_t seq_len, Mark mark) {
  const size_t o = (size_t)b * n;
  const int q = blockDim.x / 4;  // a quarter of the block's threads: whole warps (T >= 128)
  if (n <= q) {
    // Each quarter writes one part of every slot (tokens and parents; depths and positions;
    // links and scores; the visibility rows, at most two words here, and num_nodes), so that a
    // slot's stores spread over four quarters' warps rather than queue in one. H200,
    // bench.tree_ab against the first n threads writing every part, kernel alone, seeds 15 and
    // 5, two runs (3 and 4 rounds): budgets 47 and 63 at bs 16-256 0.992-0.996x (bs 64, budget
    // 63: 11.66 -> 11.56 us and 10.50 -> 10.47), bs 1 0.998-1.004x, bs 1024 0.997-0.998x (budget
    // 63), bs 64 at budget 33 0.998-0.999x; budgets <= 31 (the warp build) are untouched. The
    // profile's slots phase was ~0.8k of the slowest block's 17.9k cycles at bs 64, budget 63:
    // this takes a small part of it.
    const int t = threadIdx.x;
    const int g = (t >= q) + (t >= 2 * q) + (t >= 3 * q), i = t - g * q;  // t / q, t < 4 q
    if (g < 3) {
      if (i < n)
        write_tree_slot(a, o, i, used, root, seq_len, node_cand, node_score, fc, ns, ids,
                        g == 0 ? kSlotTokens : g == 1 ? kSlotPlace : kSlotLinks | kSlotScore);
    } else {
      write_visibility_rows(a.visibility + o * W, n, W, used, node_cand, i, q);
      if (i == 0) a.num_nodes[b] = used;
    }
    mark(96);
    return;
  }
  KDT_NO_UNROLL
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    write_tree_slot(a, o, i, used, root, seq_len, node_cand, node_score, fc, ns, ids);
  mark(96);
  // The rows start half the block's warps away from the slots, so that up to n = T / 2 the
  // slots and the rows are written by different warps at the same time, not one after the other
  // by the first n threads (H200, bench.tree_ab against rows from thread 0, kernel alone, seeds
  // 15 and 5: budget 63 0.978-0.989x at bs 1-1024, budget 33 0.984-0.985x at bs 64; budgets
  // 127-1023, whose rows take more than two words and follow a barrier, 1.000-1.004x). Rows of
  // at most two words: each thread writes its rows whole (zeros included), with no zeroing pass
  // and no barrier; wider rows zero the block first (block_write_visibility).
  const int half = threadIdx.x + (blockDim.x >> 6) * 32;  // < 2 blockDim.x
  const int first = half >= (int)blockDim.x ? half - (int)blockDim.x : half;
  if (W <= 2)
    write_visibility_rows(a.visibility + o * W, n, W, used, node_cand, first, blockDim.x);
  else
    block_write_visibility(a.visibility + o * W, n, W, used, node_cand, first, mark);
  if (threadIdx.x == 0) a.num_nodes[b] = used;
}

// Asks L1 for the 128-byte lines of [p, p + bytes) (no registers, no wait): the output pass's
// token-id gather then finds them there instead of in L2.
__device__ void warp_prefetch_l1(const void* p, size_t bytes, int lane) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)127;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t q = first + 128 * (uintptr_t)lane; q < end; q += 128 * 32)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(q));
}

// Starts copying src[0, count) (global int64) into dst (shared) with cp.async, a lane's share
// at a time: no registers held, nothing waited for here (ids_wait, then a barrier, before
// another thread reads them). The token-id gather of the outputs then reads shared memory
// rather than waiting on a global load after the build (the warp build, kWarpIdsBytes).
__device__ void ids_copy_async(int64_t* dst, const int64_t* src, int count, int first,
                               int stride) {
  for (int i = first; i < count; i += stride) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst + i);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void ids_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

}  // namespace
}  // namespace kdt
