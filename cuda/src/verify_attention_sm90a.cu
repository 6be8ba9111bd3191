// verify_attention_sm90a.cu: the Hopper (sm_90a) path of kdt_verify_attention: wgmma tensor
// cores fed by a TMA load pipeline, for bf16 caches at the MLA shape (d_latent 512, d_rope 64,
// any head count). Raw PTX (verify_attention_sm90a_ptx.cuh: wgmma.mma_async with shared-memory
// matrix descriptors, mbarrier, cp.async.bulk.tensor), no CUTLASS: nothing to vendor onto a
// host without internet, and a compile that stays short on small build machines.
//
// Work decomposition. Rows of request b are (node, head) pairs, row = node * H + head, so with
// 64 heads one M tile of 64 rows is one tree node. Grid (M tiles, splits, bs): a CTA owns one
// 64-row M tile of one request and one chunk of its key range [0, kv_len) (prefix then tree;
// at most VerifyAttentionPlan's split count, so the workspace query is shared with the other
// backends). With one split the CTA writes out / lse itself; with several it writes a
// normalised partial state (o / d, lse) into the workspace and a merge kernel combines the
// chunks by LSE (kdt::merge_weight / merged_lse of attention_state.cuh): a warp a row for a few
// splits, a block a (row, column quarter) with the splits spread over its warps for many (the
// AR step at bs 1). A chunk past a request's kv_len writes the empty state (lse = -inf).
//
// Inside a CTA (the warpgroups' roles, the TMA ring, the wgmma shapes), the kernel's history and
// its registers: verify_attention_sm90a_kernel.cuh; the merge kernels:
// verify_attention_sm90a_merge.cuh (both included below, inside this file's namespaces).
//
// The sm_90a code exists only in the compute_90a pass (__CUDA_ARCH_FEAT_SM90_ALL); in the other
// passes the kernels are empty stubs, and the host entry returns KDT_ERR_UNSUPPORTED unless the
// device is compute capability 9.0 and the binary carries sm_90a code for it.
#include <cuda.h>  // CUtensorMap (the encode function comes through the runtime, no -lcuda)
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "kdtree/attention_state.cuh"
#include "verify_attention_sm90a_ptx.cuh"
#include "verify_attention.h"

namespace kdt {
namespace sm90a {
namespace {

constexpr int kDL = 512, kDR = 64, kDK = kDL + kDR;  // the supported MLA shape
constexpr int kM = 64;                               // rows per CTA (one wgmma M)
constexpr int kN = 64;                               // cache rows per tile
constexpr int kBlocks = kDK / 64;                    // 9 column blocks of 64 bf16 (128 B)
constexpr int kBlockBytes = 64 * 128;                // one 64-row x 128 B block
constexpr int kTileBytes = kBlocks * kBlockBytes;    // 73728: Q tile and one cache stage
constexpr int kStages = 2;
constexpr int kThreads = 384;  // producer WG + 2 consumer WGs
// shared memory: Q | stages | P | rescale factors, row sums | mbarriers (+1 KB slack to align to
// 1 KB). The factor / sum area keeps the [2 (max, sum)][2 WGs][64 rows] size of the split-keys
// variant this file once had (only [0][0] and [1][*] are used), so that the offsets, and with
// them the kernel's machine code, stay those of the kernel that was measured.
constexpr int kOffQ = 0;
constexpr int kOffKV = kOffQ + kTileBytes;
constexpr int kOffP = kOffKV + kStages * kTileBytes;
constexpr int kOffRed = kOffP + kM * 128;
constexpr int kOffBar = kOffRed + 2 * 2 * kM * 4;
constexpr int kSmemUsed = kOffBar + (kBlocks + 1) * kStages * 8;  // full [stage][block], empty
constexpr int kSmemBytes = kSmemUsed + 1024;
static_assert(kSmemBytes <= 232448, "over the 227 KB an sm_90 block may use");
static_assert(kN == 64 && kM == 64, "the wgmma shapes below assume 64-row tiles");

struct Params {
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const uint16_t* q_lat;  // [total_q * H, 512] bf16 bits
  const uint16_t* q_pe;   // [total_q * H, 64]
  const uint16_t* kv;     // [total_kv, 576]; unread (the TMA reads the cache through the tensor
                          // map), kept so that the parameter layout stays the measured kernel's
  const uint32_t* vis;
  float* out;
  float* lse;
  float* ws_o;    // [splits, total_q * H, 512]
  float* ws_lse;  // [splits, total_q * H]
  int32_t H, total_q, total_kv, max_tree, max_kv, vis_words;
  int64_t chunk, splits;
  float scale_log2;  // softmax_scale * log2(e)
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDT_SM90A_DEVICE 1
#endif

#include "verify_attention_sm90a_kernel.cuh"

#include "verify_attention_sm90a_merge.cuh"

// Whether this binary carries the sm_90a kernel for the current device: the sm_90 / sm_120
// cubins hold only the empty stub (a handful of registers), the sm_90a one the real kernel
// (over a hundred). cudaFuncGetAttributes reports the cubin the driver picked, without a sync,
// so this is safe under stream capture. Cached per process (one kind of GPU per process).
bool have_sm90a_code() {
  static std::atomic<int> cached{-1};  // -1 unknown, 0 no, 1 yes
  int c = cached.load(std::memory_order_relaxed);
  if (c >= 0) return c == 1;
  cudaFuncAttributes attr{};
  const cudaError_t e = cudaFuncGetAttributes(&attr, attention_kernel);
  if (e != cudaSuccess) (void)cudaGetLastError();  // no image for this device: not sticky, clear it
  const bool ok = e == cudaSuccess && attr.binaryVersion == 90 && attr.numRegs >= 64;
  cached.store(ok ? 1 : 0, std::memory_order_relaxed);
  return ok;
}

// Key-range splits for `base` CTAs per split (M tiles x requests) on `sms` multiprocessors, at
// most the plan's count (the workspace is sized by the plan): the count whose waves x (tiles a
// CTA streams + its fixed cost: Q load, epilogue; more with a partial state to write and merge)
// is least. One CTA per SM (224 KB of shared memory each).
int64_t choose_splits(const VerifyAttentionPlan& plan, int64_t base, int32_t max_kv, int sms) {
  int64_t best = 1, best_cost = INT64_MAX;
  for (int64_t s = 1; s <= plan.splits; ++s) {
    const int64_t chunk = ((int64_t(max_kv) + s - 1) / s + kN - 1) / kN * kN;
    const int64_t used = (int64_t(max_kv) + chunk - 1) / chunk;
    if (used != s) continue;  // the same split as a smaller count
    const int64_t waves = (base * s + sms - 1) / sms;
    const int64_t cost = waves * (chunk / kN + (s > 1 ? 3 : 1));
    if (cost < best_cost) {
      best_cost = cost;
      best = s;
    }
  }
  return best;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no -lcuda at link time);
// null when the driver does not offer it. Looked up once per process.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      ptr = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// The cache [total_kv, 576] bf16 as a 2-D tensor of 64 x 64 boxes (128 bytes wide, swizzled
// the way the K-major / MN-major wgmma descriptors read them); rows past total_kv read as zero.
bool encode_kv_map(CUtensorMap* map, const void* kv, int32_t total_kv) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
  if (fn == nullptr) return false;
  const cuuint64_t dims[2] = {cuuint64_t(kDK), cuuint64_t(total_kv)};
  const cuuint64_t strides[1] = {cuuint64_t(kDK) * 2};
  const cuuint32_t box[2] = {64, kN};
  const cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(kv), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace
}  // namespace sm90a

kdt_status verify_attention_sm90a(const VerifyAttentionArgs& a, void* stream, void* workspace,
                                  size_t workspace_bytes) {
  using namespace sm90a;
  constexpr const char* fn = "kdt_verify_attention";
  if (a.dtype != KDT_DTYPE_BF16 || a.d_latent != kDL || a.d_rope != kDR)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path supports bf16 caches with d_latent 512 and d_rope 64 "
                     "(got dtype %d, %d + %d)",
                     int(a.dtype), a.d_latent, a.d_rope);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(a.q_lat) || !aligned(a.q_pe) || !aligned(a.kv_cache) || !aligned(a.out) ||
      (workspace != nullptr && !aligned(workspace)))
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs 16-byte aligned q_lat, q_pe, kv_cache, out and workspace");
  int dev = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  int major = 0, minor = 0;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), fn);
  if (major != 9 || minor != 0)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs a compute capability 9.0 device (this one is %d.%d)",
                     major, minor);
  if (!have_sm90a_code())
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "this build has no sm_90a code (build with --arch sm_90a,...)");
  const auto plan = VerifyAttentionPlan::make(a.bs, a.num_heads, a.max_tree, a.max_kv);
  if (plan.splits == 0) return KDT_OK;  // max_kv == 0: no cache rows, so no query rows either
  const int64_t m_tiles = (int64_t(a.max_tree) * a.num_heads + kM - 1) / kM;
  if (plan.splits > 65535 || a.bs > 65535 || m_tiles > 0x7fffffff)
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "grid too large for one launch (splits %lld, bs %d, M tiles %lld)",
                     (long long)plan.splits, a.bs, (long long)m_tiles);
  int sms = 132;
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn);
  const int64_t splits = choose_splits(plan, m_tiles * a.bs, a.max_kv, sms);
  const int64_t chunk = (int64_t(a.max_kv) + splits - 1) / splits;
  const int64_t chunk_tiled = (chunk + kN - 1) / kN * kN;
  const size_t need = plan.workspace_bytes(a.total_q, a.num_heads, a.d_latent);
  if (splits > 1 && (workspace == nullptr || workspace_bytes < need))
    return set_error(KDT_ERR_INVALID_ARGUMENT, fn,
                     "workspace_bytes = %zu is below the %zu bytes the split prefix needs",
                     workspace_bytes, need);
  Params prm{};
  prm.q_indptr = a.q_indptr;
  prm.kv_indptr = a.kv_indptr;
  prm.q_lat = static_cast<const uint16_t*>(a.q_lat);
  prm.q_pe = static_cast<const uint16_t*>(a.q_pe);
  prm.kv = static_cast<const uint16_t*>(a.kv_cache);
  prm.vis = a.visibility;
  prm.out = a.out;
  prm.lse = a.lse;
  const size_t o_elems = size_t(plan.splits) * size_t(a.total_q) * size_t(a.num_heads) * kDL;
  prm.ws_o = static_cast<float*>(workspace);
  prm.ws_lse = workspace ? static_cast<float*>(workspace) + o_elems : nullptr;
  prm.H = a.num_heads;
  prm.total_q = a.total_q;
  prm.total_kv = a.total_kv;
  prm.max_tree = a.max_tree;
  prm.max_kv = a.max_kv;
  prm.vis_words = a.vis_words;
  prm.chunk = chunk_tiled;
  prm.splits = (int64_t(a.max_kv) + chunk_tiled - 1) / chunk_tiled;
  prm.scale_log2 = a.softmax_scale * 1.4426950408889634f;
  static std::atomic<uint64_t> smem_set{0};
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (!bit || !(smem_set.load(std::memory_order_relaxed) & bit)) {
    KDT_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                   fn);
    smem_set.fetch_or(bit, std::memory_order_relaxed);
  }
  CUtensorMap map;
  std::memset(&map, 0, sizeof map);
  if (!encode_kv_map(&map, a.kv_cache, a.total_kv))
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the sm90a path needs cuTensorMapEncodeTiled, which this driver did not give "
                     "(or it refused the cache's tensor map)");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const dim3 grid(unsigned(m_tiles), unsigned(prm.splits), unsigned(a.bs));
  attention_kernel<<<grid, kThreads, kSmemBytes, s>>>(prm, map);
  KDT_CUDA_CHECK(cudaGetLastError(), fn);
  if (prm.splits > 1) {
    const int64_t all_rows = int64_t(a.total_q) * a.num_heads;
    if (prm.splits > kWideWarps && all_rows <= 0x7fffffff)
      merge_wide_kernel<<<dim3(unsigned(all_rows), 4), 32 * kWideWarps, 0, s>>>(prm);
    else
      merge_kernel<<<unsigned((all_rows + 7) / 8), 256, 0, s>>>(prm);
    KDT_CUDA_CHECK(cudaGetLastError(), fn);
  }
  return KDT_OK;
}

}  // namespace kdt
