// round_finish.cu: CUDA backend of kdt_round_finish. One block per request: its threads copy
// the accepted nodes' hidden states into the drafters' context and write the result row
// (round_finish_core.h, the CPU backend's logic). No sync, no allocation: graph-safe.
#include <cuda_runtime.h>

#include "common.h"
#include "pdl.cuh"
#include "round_finish_core.h"

namespace kdt {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) round_finish_kernel(round::FinishArgs a) {
  pdl_enter();  // before any global access (pdl.cuh)
  const int b = blockIdx.x;
  for (int k = 0; k < a.n; ++k) {
    const long long dst = round::ctx_row(a, b, k);  // uniform across the block
    if (dst < 0) continue;
    const int node = a.accept_index[size_t(b) * a.n + k];
    const float* src = a.hidden + (size_t(b) * a.n + node) * a.D;
    float* out = a.hidden_ctx + size_t(dst) * a.D;
    for (int i = threadIdx.x; i < a.D; i += kThreads) out[i] = src[i];
  }
  for (int j = threadIdx.x; j < a.n + 2; j += kThreads)
    a.result[size_t(b) * (a.n + 2) + j] = round::result_at(a, b, j);
  if (threadIdx.x == 0 && round::real_slot(a, b)) a.next_root[a.rows[b]] = a.bonus[b];
}

}  // namespace

kdt_status round_finish_cuda(const round::FinishArgs& a, void* stream) {
  launch_pdl(round_finish_kernel, a.bs, kThreads, 0, static_cast<cudaStream_t>(stream), a);
  KDT_CUDA_CHECK(cudaGetLastError(), "kdt_round_finish");
  return KDT_OK;
}

}  // namespace kdt
