// tree_accept.cu: CUDA backend of kdt_tree_accept. One warp (one block) per request: the lanes
// copy the request's tokens, target argmaxes and links into shared memory (coalesced, links
// narrowed to int32 by tree::link_narrow) and clear its accept_index row; then lane 0 runs the
// bounded walk of tree_accept_core.h (the same code as the CPU backend) on the shared copy, so
// each link followed costs a shared-memory load instead of a dependent global load. Status codes
// and bounds are exactly the CPU backend's (larger trees: the global walk below). No host synchronisation: safe under graph capture.
//
// KDT_TREE_ACCEPT (read per call): "walk" (the default) is the kernel above for every n;
// "table" runs the match-table phases of tree_accept_table.h on the warp (parents by pointer
// jumping, no sibling-list scan; an irregular tree takes lane 0's reference walk in the same
// launch) for n <= kMaxTableN. The walk is the default because the H200 measured it as fast or
// faster (kernel alone, dev run 2026-12-01: bs 64 B 255 walk 8.5 us vs table 9.6 us, B 1023
// 11.9 vs 30.3 us; B 15 / 63 within 1 us of each other): the table's phases cost more than the
// walk's few shared-memory loads.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "common.h"
#include "tree_accept_core.h"
#include "tree_accept_table.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;

// Shared memory of the table kernel: tokens and targets (8 bytes), links and five int32 tables
// (4 bytes each) = 44 n bytes; n <= kMaxTableN keeps it under the 48 KB that needs no opt-in.
constexpr int kMaxTableN = 1100;

__global__ void __launch_bounds__(32) tree_accept_table_kernel(TreeAcceptArgs a) {
  extern __shared__ int64_t sm[];
  __shared__ int irregular;
  const int lane = threadIdx.x;
  const int n = a.n;
  const long long b = blockIdx.x;
  const size_t o = (size_t)b * n;
  int64_t* tok = sm;
  int64_t* want = sm + n;
  int32_t* fc = reinterpret_cast<int32_t*>(sm + 2 * n);
  int32_t* ns = fc + n;
  int32_t* idx = a.accept_index + o;
  for (int i = lane; i < n; i += 32) {
    tok[i] = a.tokens[o + i];
    want[i] = a.target_argmax[o + i];
    fc[i] = tree::link_narrow(a.first_child[o + i], n);
    ns[i] = tree::link_narrow(a.next_sibling[o + i], n);
    idx[i] = -1;
  }
  const tree::acc::Table t{tok, want, fc, ns, ns + n, ns + 2 * n, ns + 3 * n, ns + 4 * n,
                           ns + 5 * n, &irregular, n, a.num_nodes ? a.num_nodes[b] : n};
  tree::acc::phase_clear(t, lane);
  __syncwarp();
  tree::acc::phase_scatter(t, lane);
  __syncwarp();
  if (!irregular) {
    const int rounds = tree::acc::jump_rounds(n);
    for (int r = 0; r < rounds; ++r) {
      const bool ch = tree::acc::phase_jump(t, lane);
      __syncwarp();
      if (!__any_sync(kFull, ch)) break;
    }
    if (!irregular) tree::acc::phase_match(t, lane);
    __syncwarp();
  }
  if (lane != 0) return;
  const tree::AcceptResult r = tree::acc::phase_walk(t, idx);
  a.accept_len[b] = r.len;
  a.bonus[b] = r.bonus;
  a.status[b] = r.status;
}

bool table_from_env() {
  const char* v = std::getenv("KDT_TREE_ACCEPT");
  return v && std::strcmp(v, "table") == 0;
}

__global__ void __launch_bounds__(32) tree_accept_kernel(TreeAcceptArgs a) {
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
  for (int i = lane; i < n; i += 32) {
    tok[i] = a.tokens[o + i];
    want[i] = a.target_argmax[o + i];
    fc[i] = tree::link_narrow(a.first_child[o + i], n);
    ns[i] = tree::link_narrow(a.next_sibling[o + i], n);
    idx[i] = -1;
  }
  __syncwarp();
  if (lane != 0) return;
  const int nn = a.num_nodes ? a.num_nodes[b] : n;
  const tree::AcceptResult r = tree::accept_one(n, nn, tok, fc, ns, want, idx);
  a.accept_len[b] = r.len;
  a.bonus[b] = r.bonus;
  a.status[b] = r.status;
}

// Trees too large for the shared copy (n > kMaxSharedN: the ABI bounds n only below) walk the
// global arrays directly: one warp per request, lane 0 walking.
constexpr int kMaxSharedN = 4096;

__global__ void __launch_bounds__(32) tree_accept_global_kernel(TreeAcceptArgs a) {
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
  if (a.n <= kMaxTableN && table_from_env()) {
    tree_accept_table_kernel<<<a.bs, 32, (size_t)a.n * 44, st>>>(a);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
    return KDT_OK;
  }
  if (a.n > kMaxSharedN) {
    tree_accept_global_kernel<<<a.bs, 32, 0, st>>>(a);
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
  tree_accept_kernel<<<a.bs, 32, smem, st>>>(a);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  return KDT_OK;
}

}  // namespace kdt
