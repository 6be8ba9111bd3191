// verify_attention_sm90a_kernel.cuh: the sm_90a attention kernel of kdt_verify_attention
// (attention_kernel: a producer warpgroup streaming the cache by TMA, two consumer warpgroups
// on wgmma) and its device helpers. Included by verify_attention_sm90a.cu inside its
// kdt::sm90a anonymous namespace (uses its constants, Params, KDT_SM90A_DEVICE and
// verify_attention_sm90a_ptx.cuh); not a separate unit.
//
// Inside a CTA: 3 warpgroups. WG0 is the producer: one thread streams 64-row cache tiles
// (64 x 576 bf16 = 72 KB) into a 2-stage ring, laid out as nine 64 x 64 column blocks in the
// 128-byte-swizzled form that wgmma reads: nine cp.async.bulk.tensor boxes a tile (tensor map
// encoded on the host per call, swizzle done by the TMA unit), each on its own mbarrier with an
// expect-tx arrive; the rest of the producer WG exits. The consumers wait for the whole tile.
// Rows past the chunk are other requests' rows (or zeros past the cache): the consumers zero
// them in V before P V reads them, so a non-finite value there cannot leak through 0 * NaN.
// WG1 and WG2 are the consumers. WG1 scores all 64 keys of a tile (S = Q K^T, wgmma m64n64k16
// x 36, Q and K both K-major from shared memory) and owns the softmax; it writes P = exp(S - m)
// as bf16 into a shared 64 x 64 tile and the per-row rescale factors beside it, and scores tile
// i + 1 while WG2 still multiplies P(i) V. WG w owns output columns [256 w, 256 w + 256)
// (O_w += P V_w: wgmma m64n256k16 x 4, P K-major, V = the first 512 columns of the same cache
// tile, MN-major). Each consumer WG holds a 64 x 256 fp32 accumulator (128 registers a thread);
// setmaxnreg gives the consumers 232 registers and the producer 40. The tree mask is applied
// only on tiles that reach the tree tail (or the chunk end); prefix keys are visible to every
// row. Scores are kept in base 2 (scale * log2 e) and the LSE converted back to the natural log.
//
// History: the H200 dev run of 2026-12-01 measured six variants of this kernel (tree 64,
// prefix 32k): cp.async loads by the whole producer WG with the two consumer WGs splitting the
// keys (v0) or with one scoring WG (v1), 290-305 TFLOP/s, load-bound; TMA loads with split keys
// (v2) 450; TMA with one scoring WG (v3) 500-512; TMA with Q K^T starting on the first three
// column blocks (v6 split keys, v7 one scorer) 458 / 505. All were correct; v3 was kept, and is
// the code below (its machine code unchanged by the removal of the others).
//
// nvcc 13.0 -O3 -Xptxas -v, sm_90a: 168 registers at entry (setmaxnreg then moves them to the
// consumers), no spills, 231584 B of dynamic shared memory, 1 CTA per SM.
#pragma once

#if defined(KDT_SM90A_DEVICE)

// Zeroes rows [valid, 64) of a stage's V part (column blocks 0-7) with threads t of n: on a
// tile that the chunk ends inside, the TMA brought other requests' cache rows there, and P = 0
// times a non-finite value would still be NaN. The caller fences (proxy) and syncs before P V.
__device__ __forceinline__ void zero_tail_rows(uint8_t* stage, int valid, int t, int n) {
  const int count = (kN - valid) * 64;  // rows x 8 blocks x 8 chunks of 16 bytes
  for (int e = t; e < count; e += n) {
    const int r = valid + (e >> 6), blk = (e >> 3) & 7, c = e & 7;
    *reinterpret_cast<uint4*>(stage + blk * kBlockBytes + r * 128 + c * 16) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// O *= the per-row factors (rows r0, r1 of this thread). Skipped, exactly, when no row of the
// warp changed its running max (every factor 1): after the first tiles of a long prefix that is
// most tiles, and it saves 128 multiplies a thread on the consumers' critical path.
__device__ __forceinline__ void rescale_o(float (&o)[128], float f0, float f1) {
  if (!__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) return;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j + 0] *= f0;
    o[4 * j + 1] *= f0;
    o[4 * j + 2] *= f1;
    o[4 * j + 3] *= f1;
  }
}

#endif  // KDT_SM90A_DEVICE

// The attention kernel (see the top of the file): producer WG0, consumers WG1 (scores, softmax)
// and WG2.
__global__ void __launch_bounds__(kThreads, 1)
    attention_kernel(const Params p, const __grid_constant__ CUtensorMap kv_map) {
#if defined(KDT_SM90A_DEVICE)
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t s_base = smem_u32(smem);
  const uint32_t s_q = s_base + kOffQ, s_kv = s_base + kOffKV, s_p = s_base + kOffP;
  float* red = reinterpret_cast<float*>(smem + kOffRed);  // [2 (factor, sum)][2 WGs][64 rows]
  // full barrier of (stage s, column block b): bar_full + 8 (s kBlocks + b); each 64-column
  // block's TMA box completes on its own barrier.
  const uint32_t bar_full = s_base + kOffBar, bar_empty = bar_full + 8 * kStages * kBlocks;

  const int tid = threadIdx.x;
  const int b = blockIdx.z;
  const int64_t q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int64_t k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int64_t n = q1 - q0, kv_len = k1 - k0, P = kv_len - n;
  const int64_t H = p.H;
  const int64_t rows = n * H;
  const int64_t row_base = int64_t(blockIdx.x) * kM;
  const int64_t all_rows = int64_t(p.total_q) * H;
  const bool direct = p.splits == 1;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  if (!valid) {
    // A broken index-pointer contract cannot be reported without a host sync: poison the rows
    // this CTA would own, where addressable (the merge propagates a NaN partial).
    if (q0 >= 0 && q1 <= p.total_q && n > 0) {
      const float nan = __int_as_float(0x7fc00000);
      for (int64_t r = row_base; r < min(rows, row_base + kM); ++r) {
        const int64_t g = q0 * H + r;
        float* o = direct ? p.out + g * kDL : p.ws_o + (int64_t(blockIdx.y) * all_rows + g) * kDL;
        for (int k = tid; k < kDL; k += kThreads) o[k] = nan;
        if (tid == 0) (direct ? p.lse[g] : p.ws_lse[int64_t(blockIdx.y) * all_rows + g]) = nan;
      }
    }
    return;
  }
  if (row_base >= rows) return;  // uniform over the CTA
  const int64_t begin = int64_t(blockIdx.y) * p.chunk;
  const int64_t end = min(kv_len, begin + p.chunk);
  const int n_tiles = begin < end ? int((end - begin + kN - 1) / kN) : 0;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (int b = 0; b < kBlocks; ++b)  // one arrive + the transaction bytes
        mbar_init(bar_full + 8 * (s * kBlocks + b), 1);
      mbar_init(bar_empty + 8 * s, 256);  // every consumer thread arrives
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid < 128) {
    // ============================== producer warpgroup
    setmaxnreg_dec<40>();
    // One thread streams the tiles: nine 64 x 64 boxes (one per 128-byte column block, the
    // tensor map swizzles them as wgmma reads them) on the stage's full barriers. Rows past the
    // cache are zero-filled by the TMA unit; rows past the chunk but inside the cache are other
    // requests' rows, zeroed by the consumers before P V reads them (zero_tail_rows).
    if (tid == 0) {
      for (int i = 0; i < n_tiles; ++i) {
        const int s = i % kStages;
        mbar_wait(bar_empty + 8 * s, ((i / kStages) & 1) ^ 1);
        const int32_t row = int32_t(k0 + begin + int64_t(i) * kN);
        const uint32_t dst0 = s_kv + s * kTileBytes;
#pragma unroll
        for (int blk = 0; blk < kBlocks; ++blk) {
          const uint32_t bar = bar_full + 8 * (s * kBlocks + blk);
          mbar_arrive_expect_tx(bar, kBlockBytes);
          tma_load_2d(dst0 + blk * kBlockBytes, &kv_map, blk * 64, row, bar);
        }
      }
    }
    return;
  }

  // ============================== consumer warpgroups
  setmaxnreg_inc<232>();
  const int ct = tid - 128;       // 0..255
  const int w = ct >> 7;          // consumer WG: 0 scores; each owns out cols [256 w, +256)
  const int t = ct & 127;
  const int lane = t & 31, warp = t >> 5;
  const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8;  // this thread's two rows of the tile
  const int q4 = lane & 3;

  // ---- Q tile [64 rows, 576] into shared memory (swizzled K-major), zero past the rows
  for (int e = ct; e < kM * 72; e += 256) {
    const int r = e / 72, c = e - r * 72;
    const int blk = c >> 3, cc = c & 7;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    const int64_t rr = row_base + r;
    if (rr < rows) {
      const int64_t g = q0 * H + rr;
      const uint16_t* src = c < 64 ? p.q_lat + g * kDL + c * 8 : p.q_pe + g * kDR + (c - 64) * 8;
      v = __ldg(reinterpret_cast<const uint4*>(src));
    }
    *reinterpret_cast<uint4*>(smem + kOffQ + blk * kBlockBytes + swz(r, cc)) = v;
  }
  fence_proxy_async();
  named_bar_sync(1, 256);

  // per-row state: rows r0, r1 (the running max lives in WG 0, which scores)
  const int64_t rg0 = row_base + r0, rg1 = row_base + r1;
  const int64_t node0 = rg0 / H, node1 = rg1 / H;
  const uint32_t* vis0 = p.vis + (q0 + min(node0, n - 1)) * p.vis_words;
  const uint32_t* vis1 = p.vis + (q0 + min(node1, n - 1)) * p.vis_words;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max (base 2)
  float d0 = 0.f, d1 = 0.f;              // this thread's partial sums over its keys
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float* fac = red;               // [64]: the current tile's per-row rescale factors (w 0 -> w 1)
  float* red_sum = red + 2 * kM;  // [2][64]

  for (int i = 0; i < n_tiles; ++i) {
    const int s = i % kStages;
    const int64_t t0 = begin + int64_t(i) * kN;
    const uint32_t st = s_kv + s * kTileBytes;
    const uint32_t full = bar_full + 8 * kBlocks * s, parity = (i / kStages) & 1;
    for (int b = 0; b < kBlocks; ++b) mbar_wait(full + 8 * b, parity);
    if (w == 0) {
      // ---- S = Q K^T for all 64 keys of the tile
      float sc[32];
#pragma unroll
      for (int k = 0; k < 32; ++k) sc[k] = 0.f;
      reg_fence(sc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 36; ++ks) {
        const uint32_t koff = (ks >> 2) * kBlockBytes + (ks & 3) * 32;
        wgmma_m64n64_ss(sc, make_desc(s_q + koff, 16, 1024), make_desc(st + koff, 16, 1024),
                        ks > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(sc);
      if (t0 + kN > end) zero_tail_rows(smem + kOffKV + s * kTileBytes, int(end - t0), t, 128);
      const bool masked = t0 + kN > P || t0 + kN > end;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t kk = t0 + j * 8 + q4 * 2 + h;
          float x0 = sc[4 * j + h] * p.scale_log2;
          float x1 = sc[4 * j + 2 + h] * p.scale_log2;
          if (masked) {
            bool v0 = kk < end, v1 = kk < end;
            if (kk >= P && kk < end) {
              const int64_t tk = kk - P;
              v0 = (__ldg(vis0 + (tk >> 5)) >> (tk & 31)) & 1u;
              v1 = (__ldg(vis1 + (tk >> 5)) >> (tk & 31)) & 1u;
            }
            x0 = v0 ? x0 : -INFINITY;
            x1 = v1 ? x1 : -INFINITY;
          }
          sc[4 * j + h] = x0;
          sc[4 * j + 2 + h] = x1;
          mx0 = fmaxf(mx0, x0);
          mx1 = fmaxf(mx1, x1);
        }
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
      const float base0 = nm0 == -INFINITY ? 0.f : nm0;
      const float base1 = nm1 == -INFINITY ? 0.f : nm1;
      const float f0 = exp2f(m0 - base0), f1 = exp2f(m1 - base1);
      m0 = nm0;
      m1 = nm1;
      d0 *= f0;
      d1 *= f1;
      if (i > 0) named_bar_sync(2, 256);  // the other WG is done with P(i - 1) and its factors
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p00 = exp2f(sc[4 * j + 0] - base0), p01 = exp2f(sc[4 * j + 1] - base0);
        const float p10 = exp2f(sc[4 * j + 2] - base1), p11 = exp2f(sc[4 * j + 3] - base1);
        d0 += p00 + p01;
        d1 += p10 + p11;
        *reinterpret_cast<uint32_t*>(smem + kOffP + swz(r0, j) + q4 * 4) = pack_bf16(p00, p01);
        *reinterpret_cast<uint32_t*>(smem + kOffP + swz(r1, j) + q4 * 4) = pack_bf16(p10, p11);
      }
      if (q4 == 0) {
        fac[r0] = f0;
        fac[r1] = f1;
      }
      rescale_o(o, f0, f1);
      fence_proxy_async();
      named_bar_sync(1, 256);  // P(i) and the factors are in shared memory
    } else {
      named_bar_sync(1, 256);
      const float f0 = fac[r0], f1 = fac[r1];
      rescale_o(o, f0, f1);
    }
    // ---- O_w += P V_w
    reg_fence(o);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t da = make_desc(s_p + ks * 32, 16, 1024);
      const uint64_t db = make_desc(st + (4 * w) * kBlockBytes + ks * 16 * 128, kBlockBytes, 1024);
      wgmma_m64n256_ss_tb(o, da, db, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(o);
    mbar_arrive(bar_empty + 8 * s);
    if (w == 1 && i + 1 < n_tiles) named_bar_arrive(2, 256);  // P(i) and factors consumed
  }

  // ---- epilogue: total row sums over both WGs' keys, normalise, write
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    d0 += __shfl_xor_sync(0xffffffffu, d0, off);
    d1 += __shfl_xor_sync(0xffffffffu, d1, off);
  }
  if (q4 == 0) {
    red_sum[w * kM + r0] = d0;
    red_sum[w * kM + r1] = d1;
  }
  named_bar_sync(1, 256);
  const float dt0 = red_sum[r0] + red_sum[kM + r0];
  const float dt1 = red_sum[r1] + red_sum[kM + r1];
  const float inv0 = dt0 > 0.f ? 1.f / dt0 : 0.f, inv1 = dt1 > 0.f ? 1.f / dt1 : 0.f;
  constexpr float kLn2 = 0.69314718055994531f;
  const float lse0 = dt0 > 0.f ? m0 * kLn2 + logf(dt0) : -INFINITY;
  const float lse1 = dt1 > 0.f ? m1 * kLn2 + logf(dt1) : -INFINITY;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t rr = h == 0 ? rg0 : rg1;
    if (rr >= rows) continue;
    const int64_t g = q0 * H + rr;
    const float inv = h == 0 ? inv0 : inv1;
    float* orow = direct ? p.out + g * kDL : p.ws_o + (int64_t(blockIdx.y) * all_rows + g) * kDL;
    orow += 256 * w + 2 * q4;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(orow + 8 * j) = make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    if (w == 0 && q4 == 0) {
      const float l = h == 0 ? lse0 : lse1;
      if (direct) p.lse[g] = l;
      else p.ws_lse[int64_t(blockIdx.y) * all_rows + g] = l;
    }
  }
#endif  // KDT_SM90A_DEVICE
}
