// tree_build.cu: CUDA backend of kdt_tree_build. One block per request: thread 0 runs the
// best-first heap (tree_build_core.h, the same code as the CPU backend) in shared memory, then
// the whole block writes the outputs (slots, links, visibility words) in parallel.
// No host synchronisation and no allocation: safe under CUDA graph capture.
//
// Shared memory per block, n = budget + 1 (<= 1025): 2 x n doubles (heap and node scores),
// 2 x n uint32 (packed candidates), 2 x n int16 (child lists) = 28 n bytes <= 28.7 KB.
#include <cuda_runtime.h>

#include "common.h"
#include "tree_build_core.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr int kThreads = 128;

size_t smem_bytes(int n) { return (size_t)n * (2 * sizeof(double) + 2 * sizeof(uint32_t) + 2 * sizeof(int16_t)); }

__global__ void __launch_bounds__(kThreads) tree_build_kernel(TreeBuildArgs a) {
  extern __shared__ double smem[];
  const int n = a.budget + 1, W = (n + 31) / 32;
  const int b = blockIdx.x;
  tree::Scratch s;
  s.heap_score = smem;
  s.node_score = smem + n;
  s.heap_cand = reinterpret_cast<uint32_t*>(smem + 2 * n);
  s.node_cand = s.heap_cand + n;
  s.first_child = reinterpret_cast<int16_t*>(s.node_cand + n);
  s.next_sibling = s.first_child + n;
  __shared__ int used;

  const size_t lk = (size_t)a.L * a.K;
  const int64_t* ids = a.top_ids + b * lk;
  if (threadIdx.x == 0) used = tree::build_one(a.top_logp + b * lk, a.L, a.K, a.budget, s);
  __syncthreads();

  const size_t o = (size_t)b * n;
  const int64_t seq_len = a.seq_lens[b];
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (i >= used) {
      a.tokens[o + i] = -1; a.parents[o + i] = -1; a.depths[o + i] = -1;
      a.positions[o + i] = -1; a.first_child[o + i] = -1; a.next_sibling[o + i] = -1;
      if (a.scores) a.scores[o + i] = 0.0;
      continue;
    }
    const uint32_t c = s.node_cand[i];
    const int d = tree::cand_depth(c);
    a.tokens[o + i] = i == 0 ? a.root_ids[b] : ids[(size_t)(d - 1) * a.K + tree::cand_rank(c)];
    a.parents[o + i] = i == 0 ? -1 : tree::cand_parent(c);
    a.depths[o + i] = d;
    a.positions[o + i] = seq_len + d;
    a.first_child[o + i] = s.first_child[i];
    a.next_sibling[o + i] = s.next_sibling[i];
    if (a.scores) a.scores[o + i] = s.node_score[i];
  }
  // Visibility: one word per thread step, consecutive threads on consecutive words.
  uint32_t* vis = a.visibility + o * W;
  for (int k = threadIdx.x; k < n * W; k += blockDim.x) {
    const int i = k / W, w = k - i * W;
    vis[k] = i < used ? tree::visibility_word(i, w, s.node_cand) : 0u;
  }
  if (threadIdx.x == 0) a.num_nodes[b] = used;
}

}  // namespace

kdt_status tree_build_cuda(const TreeBuildArgs& a, void* stream) {
  static const char* fn = "kdt_tree_build";
  const size_t smem = smem_bytes(a.budget + 1);
  tree_build_kernel<<<a.bs, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
