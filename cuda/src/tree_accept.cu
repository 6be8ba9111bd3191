// tree_accept.cu: CUDA backend of kdt_tree_accept. One warp per request: the lanes clear the
// request's accept_index row, then lane 0 runs the bounded walk of tree_accept_core.h (the same
// code as the CPU backend). No host synchronisation: safe under CUDA graph capture.
#include <cuda_runtime.h>

#include "common.h"
#include "tree_accept_core.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr int kWarpsPerBlock = 4;

__global__ void __launch_bounds__(32 * kWarpsPerBlock) tree_accept_kernel(TreeAcceptArgs a) {
  const int lane = threadIdx.x & 31;
  const long long b = (long long)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (b >= a.bs) return;
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
  const int blocks = (a.bs + kWarpsPerBlock - 1) / kWarpsPerBlock;
  tree_accept_kernel<<<blocks, 32 * kWarpsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
