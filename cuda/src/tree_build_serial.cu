// tree_build_serial.cu: the serial CUDA tree build (KDT_TREE_BUILD=serial, and the parallel
// build's fallback where no shared-memory layout fits): one block of 128 threads per request,
// the selection serial.
//
// Two serial selection variants, both reproducing the CPU order exactly (same float64 scores,
// same strict total order: score descending, then rank path ascending):
//   warp (default; warp_build_one, tree_build_device.cuh): warp 0 keeps the frontier as an
//     unordered array; each pop is a warp-wide argmax (each lane scans every 32nd entry, then a
//     5-step butterfly shuffle), so a pop costs about F/32 + 5 comparisons of latency instead
//     of a serial heap sift.
//   heap: thread 0 runs the binary heap of tree_build_core.h, the CPU backend's exact code.
// KDT_TREE_BUILD_VARIANT=heap|warp (read once, on the host) picks one for benchmarks and
// cross-checks; both are validated by the native tests.
//
// Shared memory per block, n = budget + 1 (<= 1025): 2 x n doubles (frontier and node scores),
// n uint64 (rank-path keys), 2 x n uint32 (packed candidates), 2 x n int16 (child lists)
// = 36 n bytes <= 36.9 KB (under the 48 KB that needs no opt-in, on sm_90 and sm_120).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "common.h"
#include "pdl.cuh"
#include "tree_build_core.h"
#include "tree_build_device.cuh"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr int kThreads = 128;

size_t smem_bytes(int n) {
  return (size_t)n * (2 * sizeof(double) + sizeof(uint64_t) + 2 * sizeof(uint32_t) +
                     2 * sizeof(int16_t));
}

template <bool kWarp>
__global__ void __launch_bounds__(kThreads) tree_build_kernel(TreeBuildArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  extern __shared__ double smem[];
  const int n = a.budget + 1, W = (n + 31) / 32;
  const int b = blockIdx.x;
  tree::Scratch s;
  s.heap_score = smem;
  s.node_score = smem + n;
  s.node_key = reinterpret_cast<uint64_t*>(smem + 2 * n);
  s.heap_cand = reinterpret_cast<uint32_t*>(smem + 3 * n);
  s.node_cand = s.heap_cand + n;
  s.first_child = reinterpret_cast<int16_t*>(s.node_cand + n);
  s.next_sibling = s.first_child + n;
  tree::set_key_layout(s, a.L, a.K);
  __shared__ int used;

  const size_t lk = (size_t)a.L * a.K;
  const float* lp = a.top_logp + b * lk;
  const int64_t* ids = a.top_ids + b * lk;
  if (kWarp) {
    if (threadIdx.x < 32) {
      const int u = warp_build_one(lp, a.L, a.K, a.budget, s);
      if (threadIdx.x == 0) used = u;
    }
  } else if (threadIdx.x == 0) {
    used = tree::build_one(lp, a.L, a.K, a.budget, s);
  }
  __syncthreads();

  write_outputs(a, b, n, W, used, s.node_cand, s.node_score, s.first_child, s.next_sibling, ids,
                a.root_ids[b], a.seq_lens[b], [](int) {});
}

// KDT_TREE_BUILD_VARIANT, read once: true for the warp variant (the default).
bool use_warp_variant() {
  static const bool warp = [] {
    const char* v = std::getenv("KDT_TREE_BUILD_VARIANT");
    return !(v && std::strcmp(v, "heap") == 0);
  }();
  return warp;
}

}  // namespace

kdt_status tree_build_serial_cuda(const TreeBuildArgs& a, void* stream) {
  static const char* fn = "kdt_tree_build";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const size_t smem = smem_bytes(a.budget + 1);
  if (use_warp_variant())
    launch_pdl(tree_build_kernel<true>, a.bs, kThreads, smem, st, a);
  else
    launch_pdl(tree_build_kernel<false>, a.bs, kThreads, smem, st, a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
