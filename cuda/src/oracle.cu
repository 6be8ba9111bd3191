// oracle.cu: CUDA backend of kdt_oracle_draft. One block per (request, depth) row: each thread
// computes entries j of the row (oracle_core.h, the CPU backend's code), then the K - 1 wrong
// ranks' log-probabilities are sorted descending in shared memory by rank counting (K <= 1024).
// No host synchronisation, no allocation: safe under CUDA graph capture.
#include <cuda_runtime.h>

#include "common.h"
#include "pdl.cuh"
#include "oracle_core.h"

namespace kdt {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) oracle_kernel(oracle::Args a) {
  pdl_enter();  // before any global access (pdl.cuh)
  __shared__ double rest[1024];
  __shared__ oracle::Row row;
  const int b = blockIdx.x / a.L, d = 1 + blockIdx.x % a.L;
  if (threadIdx.x == 0) row = oracle::row_setup(a, b, d);
  __syncthreads();
  const size_t o = (size_t(b) * a.L + (d - 1)) * a.K;
  for (int j = threadIdx.x; j < a.K; j += kThreads) {
    a.top_ids[o + j] = oracle::token_at(a, row, j);
    if (j >= 1) rest[j - 1] = oracle::rest_at(a, row, j);
  }
  __syncthreads();
  const int m = a.K - 1;
  for (int i = threadIdx.x; i < m; i += kThreads) {  // position of rest[i] in descending order
    const double v = rest[i];
    int pos = 0;
    for (int k = 0; k < m; ++k) pos += (rest[k] > v) || (rest[k] == v && k < i);
    a.top_logp[o + 1 + pos] = float(v < a.log_p0 ? v : a.log_p0);
  }
  if (threadIdx.x == 0) a.top_logp[o] = float(a.log_p0);
}

}  // namespace

kdt_status oracle_draft_cuda(const oracle::Args& a, void* stream) {
  launch_pdl(oracle_kernel, a.bs * a.L, kThreads, 0, static_cast<cudaStream_t>(stream), a);
  KDT_CUDA_CHECK(cudaGetLastError(), "kdt_oracle_draft");
  return KDT_OK;
}

}  // namespace kdt
