// verify_attention_mma_launch.cuh: the host side of the mma.sync path of kdt_verify_attention:
// whether a call fits it (mma_unsupported), the split-KV chunking by waves (mma_chunking), the
// launch of one configuration and its merge (launch_mma_config), KDT_MMA_TILE
// (mma_forced_config) and the choice of configuration for the device (launch_mma). Included by
// verify_attention.cu inside its anonymous namespace (uses its Params and ensure_smem_limit, and
// the kernels and configurations of verify_attention_mma.cuh, included before); not a separate
// unit. Needs <atomic>, <cstdlib> and <cstring>, included by verify_attention.cu at file scope.
#pragma once

// Why the mma.sync path cannot take this call (nullptr when it can): bf16, the MLA shape
// (512 + 64) and 16-byte aligned arrays (cp.async and the merge's float4 stores).
const char* mma_unsupported(const Params& prm, bool bf16) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!bf16) return "it needs a bfloat16 cache (this call is float32)";
  if (prm.dl != mma::kDL || prm.dr != mma::kDR) return "it needs d_latent 512 and d_rope 64";
  if (!aligned(prm.q_lat) || !aligned(prm.q_pe) || !aligned(prm.kv) || !aligned(prm.out) ||
      !aligned(prm.ws_o))
    return "it needs 16-byte aligned q_lat, q_pe, kv_cache, out and workspace";
  return nullptr;
}

// The mma grid's split-KV chunking: at most the plan's splits (its workspace), chosen so that
// the blocks fill whole waves (`slots` = SMs x resident blocks per SM): the cost of s splits is
// waves(s) x chunk(s), the fewest splits among the cheapest (less merge traffic). E.g. bs 64, tree 1, prefix 32k on 132 SMs: the plan's 5 splits are
// 320 blocks in 3 waves of 6.6k cache rows; 2 splits are 128 blocks in one wave of 16.4k.
void mma_chunking(Params& prm, int64_t row_blocks, int64_t sms) {
  if (prm.splits <= 1 || sms <= 0 || row_blocks <= 0) return;
  const int64_t kv = prm.max_kv, tile = VerifyAttentionPlan::kKvTile;
  int64_t best_chunk = prm.chunk, best_splits = prm.splits;
  int64_t best_cost = (row_blocks * prm.splits + sms - 1) / sms * prm.chunk;
  for (int64_t s = prm.splits - 1; s >= 1; --s) {
    const int64_t chunk = ((kv + s - 1) / s + tile - 1) / tile * tile;
    const int64_t splits = (kv + chunk - 1) / chunk;
    const int64_t cost = (row_blocks * splits + sms - 1) / sms * chunk;
    if (cost <= best_cost) {
      best_cost = cost;
      best_chunk = chunk;
      best_splits = splits;
    }
  }
  prm.chunk = best_chunk;
  prm.splits = best_splits;
}

// Launches one mma.sync configuration over (row blocks, splits, bs), then the merge when the
// chunking gives more than one split.
template <int kGroups, int kStages, int kBN, bool kQReg = false>
cudaError_t launch_mma_config(Params prm, int sms, bool wave_chunking, cudaStream_t stream) {
  using C = mma::Config<kGroups, kStages, kBN, kQReg>;
  const cudaError_t e =
      ensure_smem_limit<mma::attention_mma_kernel<kGroups, kStages, kBN, kQReg>>(C::kSmem);
  if (e != cudaSuccess) return e;
  const int64_t rows = int64_t(prm.max_tree) * prm.H;
  const int64_t row_blocks = (rows + C::kRows - 1) / C::kRows;
  if (wave_chunking) {
    // resident blocks per SM: once per (configuration, device); a race only repeats the query
    static std::atomic<int> per_sm[8];
    int dev = 0, n = 0;
    cudaError_t ge = cudaGetDevice(&dev);
    if (ge != cudaSuccess) return ge;
    if (dev < 8) n = per_sm[dev].load(std::memory_order_relaxed);
    if (n <= 0) {
      ge = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &n, mma::attention_mma_kernel<kGroups, kStages, kBN, kQReg>, C::kThreads, C::kSmem);
      if (ge != cudaSuccess) return ge;
      if (n < 1) n = 1;
      if (dev < 8) per_sm[dev].store(n, std::memory_order_relaxed);
    }
    mma_chunking(prm, row_blocks * prm.bs, int64_t(sms) * n);
  }
  const dim3 grid(unsigned(row_blocks), unsigned(prm.splits), unsigned(prm.bs));
  mma::attention_mma_kernel<kGroups, kStages, kBN, kQReg>
      <<<grid, C::kThreads, C::kSmem, stream>>>(prm);
  cudaError_t le = cudaGetLastError();
  if (le != cudaSuccess || prm.splits <= 1) return le;
  const dim3 mgrid(unsigned((rows * mma::kMergeQuarters + 7) / 8), 1u, unsigned(prm.bs));
  mma::merge_kernel<<<mgrid, 256, 0, stream>>>(prm);
  return cudaGetLastError();
}

// KDT_MMA_TILE (read per call) forces one mma configuration where it fits, for side-by-side
// measurement: "16" the previous big one (16-row tiles, the plan's split count), "small" and
// "smallq" the sm_120 ones (query tile in shared memory / query fragments in registers).
enum class MmaConfig { kDefault, kBig16, kSmall, kSmallQ };
MmaConfig mma_forced_config() {
  const char* v = std::getenv("KDT_MMA_TILE");
  if (!v) return MmaConfig::kDefault;
  if (std::strcmp(v, "16") == 0) return MmaConfig::kBig16;
  if (std::strcmp(v, "small") == 0) return MmaConfig::kSmall;
  if (std::strcmp(v, "smallq") == 0) return MmaConfig::kSmallQ;
  return MmaConfig::kDefault;
}

// The mma.sync configuration for the current device: 64 rows x 3 stages of 32-row tiles where
// a block may use its shared memory (sm_90: 227 KB), else (sm_120, sm_86: 99 KB) 32 rows with
// the query fragments in registers x 2 stages of 16-row tiles (two blocks per SM).
kdt_status launch_mma(const Params& prm, cudaStream_t stream) {
  constexpr const char* fn = "kdt_verify_attention";
  int dev = 0, optin = 0, sms = 0;
  KDT_CUDA_CHECK(cudaGetDevice(&dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), fn);
  KDT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn);
  const MmaConfig forced = mma_forced_config();
  const size_t smem = size_t(optin);
  if (forced == MmaConfig::kSmall && smem >= mma::Small::kSmem) {
    KDT_CUDA_CHECK((launch_mma_config<2, 3, 16>(prm, sms, true, stream)), fn);
  } else if (forced == MmaConfig::kSmallQ && smem >= mma::SmallQ::kSmem) {
    KDT_CUDA_CHECK((launch_mma_config<2, 2, 16, true>(prm, sms, true, stream)), fn);
  } else if (forced == MmaConfig::kBig16 && smem >= mma::Big16::kSmem) {
    KDT_CUDA_CHECK((launch_mma_config<4, 4, 16>(prm, sms, false, stream)), fn);
  } else if (smem >= mma::Big::kSmem) {
    KDT_CUDA_CHECK((launch_mma_config<4, 3, 32>(prm, sms, true, stream)), fn);
  } else if (smem >= mma::SmallQ::kSmem) {
    KDT_CUDA_CHECK((launch_mma_config<2, 2, 16, true>(prm, sms, true, stream)), fn);
  } else {
    return set_error(KDT_ERR_UNSUPPORTED, fn,
                     "the mma path needs %zu bytes of shared memory per block; device %d allows %d",
                     mma::SmallQ::kSmem, dev, optin);
  }
  return KDT_OK;
}
