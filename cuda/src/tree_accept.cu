// tree_accept.cu: CUDA backend of kdt_tree_accept. No host synchronisation: safe under graph
// capture. Status codes and bounds are exactly the CPU backend's on every input.
//
// KDT_TREE_ACCEPT (read per call):
//   "parallel" (the default; anything but "walk"): for n <= tree::apar::kMaxN, one block per
//     request and one thread per node runs the phases of tree_accept_parallel.h: each thread
//     loads its node's four values at once (one round of global loads per request), the links
//     are scattered into per-node owners, pointer jumping finds every node's parent, each node
//     matching its parent's target claims its parent's match slot, and thread 0 follows the
//     single matches from the root. A request with a malformed tree (an out-of-range or self
//     link, a node with two incoming links, num_nodes outside [1, n]) runs the reference walk
//     of tree_accept_core.h on the global arrays in the same launch. "parallel-strict" (tests)
//     writes status -1 there instead, so that a test proves the parallel path ran.
//   "walk": one warp per request copies the request into shared memory (links narrowed to
//     int32 by tree::link_narrow) and lane 0 runs the reference walk there; also the kernel for
//     n > kMaxN (n > kMaxSharedN: the walk on the global arrays).
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "common.h"
#include "pdl.cuh"
#include "tree_accept_core.h"
#include "tree_accept_parallel.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

template <bool kStrict>
__global__ void __launch_bounds__(tree::apar::kMaxN) tree_accept_parallel_kernel(TreeAcceptArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  namespace ap = tree::apar;
  extern __shared__ int64_t sm[];
  const int i = threadIdx.x;
  const int n = a.n;
  const long long b = blockIdx.x;
  const size_t o = (size_t)b * n;
  const int nn = a.num_nodes ? __ldg(a.num_nodes + b) : n;
  const ap::Request q{a.tokens + o, a.first_child + o, a.next_sibling + o, a.target_argmax + o,
                      a.accept_index + o, n, nn};
  const ap::Shared s = ap::shared_at(sm, n);
  ap::Node v = ap::phase_load(q, s, i);
  __syncthreads();
  ap::phase_scatter(q, s, v, i);
  bool irregular = __syncthreads_or(v.bad);
  if (!irregular) {
    while (!ap::parent_step(s, v, i, n)) {
    }
    ap::match(s, v, i);
    irregular = __syncthreads_or(v.bad);
  }
  if (i != 0) return;
  tree::AcceptResult r;
  if (!irregular) r = ap::phase_walk(s, n, q.accept_index);
  else if (kStrict) r = tree::AcceptResult{1, -1, 0};
  else r = ap::fallback(q);
  a.accept_len[b] = r.len;
  a.bonus[b] = r.bonus;
  a.status[b] = r.status;
}

enum class Algo { kParallel, kStrict, kWalk };

Algo algo_from_env() {
  const char* v = std::getenv("KDT_TREE_ACCEPT");
  if (v && std::strcmp(v, "walk") == 0) return Algo::kWalk;
  if (v && std::strcmp(v, "parallel-strict") == 0) return Algo::kStrict;
  return Algo::kParallel;
}

constexpr int kCopyUnroll = 8;

__global__ void __launch_bounds__(32) tree_accept_kernel(TreeAcceptArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  extern __shared__ int64_t sm[];
  const int lane = threadIdx.x;
  const int n = a.n;
  const long long b = blockIdx.x;
  const size_t o = (size_t)b * n;
  int64_t* tok = sm;
  int64_t* want = sm + n;
  int32_t* fc = reinterpret_cast<int32_t*>(sm + 2 * n);
  int32_t* ns = fc + n;
  int32_t* idx = a.accept_index + o;
  const int nn = a.num_nodes ? __ldg(a.num_nodes + b) : n;
  // kCopyUnroll entries per lane in flight: every load of a group before any of its stores.
  for (int base = lane; base < n; base += 32 * kCopyUnroll) {
    int64_t t[kCopyUnroll], w[kCopyUnroll], f[kCopyUnroll], x[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + 32 * u;
      if (i < n) {
        t[u] = __ldg(a.tokens + o + i);
        w[u] = __ldg(a.target_argmax + o + i);
        f[u] = __ldg(a.first_child + o + i);
        x[u] = __ldg(a.next_sibling + o + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + 32 * u;
      if (i < n) {
        tok[i] = t[u];
        want[i] = w[u];
        fc[i] = tree::link_narrow(f[u], n);
        ns[i] = tree::link_narrow(x[u], n);
        idx[i] = -1;
      }
    }
  }
  __syncwarp();
  if (lane != 0) return;
  const tree::AcceptResult r = tree::accept_one(n, nn, tok, fc, ns, want, idx);
  a.accept_len[b] = r.len;
  a.bonus[b] = r.bonus;
  a.status[b] = r.status;
}

// Trees too large for the shared copy (n > kMaxSharedN: the ABI bounds n only below) walk the
// global arrays directly: one warp per request, lane 0 walking.
constexpr int kMaxSharedN = 4096;

__global__ void __launch_bounds__(32) tree_accept_global_kernel(TreeAcceptArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  const int lane = threadIdx.x;
  const long long b = blockIdx.x;
  const size_t o = (size_t)b * a.n;
  int32_t* idx = a.accept_index + o;
  for (int i = lane; i < a.n; i += 32) idx[i] = -1;
  __syncwarp();
  if (lane != 0) return;
  const int nn = a.num_nodes ? a.num_nodes[b] : a.n;
  const tree::AcceptResult r = tree::accept_one(a.n, nn, a.tokens + o, a.first_child + o,
                                                a.next_sibling + o, a.target_argmax + o, idx);
  a.accept_len[b] = r.len;
  a.bonus[b] = r.bonus;
  a.status[b] = r.status;
}

}  // namespace

kdt_status tree_accept_cuda(const TreeAcceptArgs& a, void* stream) {
  static const char* fn = "kdt_tree_accept";
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const Algo algo = algo_from_env();
  if (algo != Algo::kWalk && a.n <= tree::apar::kMaxN) {
    const int threads = tree::apar::threads_for(a.n);
    const size_t bytes = tree::apar::shared_bytes(a.n);
    if (algo == Algo::kStrict)
      launch_pdl(tree_accept_parallel_kernel<true>, a.bs, threads, bytes, st, a);
    else
      launch_pdl(tree_accept_parallel_kernel<false>, a.bs, threads, bytes, st, a);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
    return KDT_OK;
  }
  if (a.n > kMaxSharedN) {
    launch_pdl(tree_accept_global_kernel, a.bs, 32, 0, st, a);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
    return KDT_OK;
  }
  const size_t smem = (size_t)a.n * (2 * sizeof(int64_t) + 2 * sizeof(int32_t));
  // The shared-memory opt-in, once per device at the largest size (no attribute call later,
  // under graph capture).
  static bool opted[64] = {};
  int dev = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  if (smem > 48 * 1024 && (dev < 0 || dev >= 64 || !opted[dev])) {
    const int most = kMaxSharedN * (int)(2 * sizeof(int64_t) + 2 * sizeof(int32_t));
    KDT_CUDA_CHECK(cudaFuncSetAttribute(tree_accept_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, most),
                   fn);
    if (dev >= 0 && dev < 64) opted[dev] = true;
  }
  launch_pdl(tree_accept_kernel, a.bs, 32, smem, st, a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
