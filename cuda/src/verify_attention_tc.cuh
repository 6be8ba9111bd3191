// verify_attention_tc.cuh: the tensor-core prefix pass of kdt_verify_attention for bfloat16
// caches of the MLA production shape (d_latent 512, d_rope 64). Included by
// verify_attention.cu inside its anonymous namespace (uses its Params); not a separate unit.
//
// mma.sync.m16n8k16 bf16 -> fp32 (sm_80+; the only MMA on sm_120, which lacks wgmma).
// Block: 8 warps = 4 row groups x 2 output halves. The block owns 64 (node, head) rows whose
// queries sit in shared memory ([64, 576] bf16) for the whole chunk, and streams the cache in
// 16-row tiles ([16, 576] bf16, read from global once per block). Warp (group, half) computes
// S = Q K^T for its 16 rows x 16 keys over all 576 dims (both halves compute the same S, which
// costs 53% more MMA work but needs no cross-warp softmax exchange), then O[:, half*256 ..+256]
// += P V. O is 16 x 256 fp32 per warp: 128 registers per lane.
//
// Precision: Q and K are bf16 inputs, so S = Q K^T is exact products with fp32 accumulation.
// P (fp32) is split as P = hi + lo with hi = bf16(P), lo = bf16(P - hi), and both halves go
// through the MMA, so P carries ~16 mantissa bits (relative error <= 2^-17) instead of bf16's 8;
// this keeps the bf16 path inside the same 1e-5 bound as fp32 at the cost of a second P.V MMA.
//
// Shared-memory rows are padded to 584 bf16 (1168 B): fragment loads of 8 rows then fall on
// banks 4 words apart, conflict-free for both 32-bit fragment loads and ldmatrix.
#pragma once

// Needs <cuda_bf16.h>, included by verify_attention.cu at file scope.

namespace tc {

constexpr int kDL = 512, kDR = 64, kDK = kDL + kDR;
constexpr int kLd = kDK + 8;  // padded row, bf16 elements
constexpr int kBM = VerifyAttentionPlan::kRowsPerBlockTc;  // 64 rows per block
constexpr int kBN = 16;                                     // cache rows per tile
constexpr int kHalf = kDL / 2;                              // output columns per warp
constexpr int kNT = kHalf / 8;                              // n8 tiles per warp
constexpr int kChunks = kDK / 8;                            // 16-byte chunks per row
constexpr size_t kSmemBytes = size_t(kBM + kBN) * kLd * 2;  // 93,440 B (sm_120 limit 101,376)
static_assert(kBM == 4 * 16, "4 row groups of 16 rows");
static_assert(VerifyAttentionPlan::kKvTile % kBN == 0, "chunks are whole tiles");

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two transposed 8x8 b16 matrices; lane l < 16 supplies the row address of matrix l / 8,
// row l % 8. Lane l receives (M[2 (l%4)][l/4], M[2 (l%4) + 1][l/4]) of each: a B fragment.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const uint16_t* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t lds32(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// Two floats as a bf16x2 register (x in the low half: the lower column of the fragment).
__device__ __forceinline__ uint32_t pack_bf16(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ float bf16_round(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// 16-byte copy of 8 bf16 (zeros when !valid).
__device__ __forceinline__ void copy16(uint16_t* dst, const uint16_t* src, bool valid) {
  uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
  *reinterpret_cast<uint4*>(dst) = v;
}

__global__ void __launch_bounds__(256) prefix_kernel_tc(Params p) {
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_s = smem;              // [kBM][kLd]
  uint16_t* kv_s = smem + kBM * kLd; // [kBN][kLd]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp >> 1, half = warp & 1;
  const int gq = lane >> 2, tq = lane & 3;  // fragment coordinates: row gq (+8), cols 2 tq (+1)
  const int b = blockIdx.z;
  // Sizes are int32 by the ABI; 32-bit indices keep registers free for the accumulators
  // (products that can exceed 2^31 are formed in 64 bits where they are used).
  const int q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int n = q1 - q0, kv_len = k1 - k0, P = kv_len - n, H = p.H;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  if (!valid) return;  // the tree pass poisons this request's rows
  const int64_t rows = int64_t(n) * H, row_base = int64_t(blockIdx.x) * kBM;
  if (row_base >= rows) return;
  const int begin = int(int64_t(blockIdx.y) * p.chunk);  // < P <= max_kv when in range
  if (int64_t(blockIdx.y) * p.chunk >= P) return;
  const int end = int(min(int64_t(P), int64_t(begin) + p.chunk));
  const uint16_t* q_lat = static_cast<const uint16_t*>(p.q_lat);
  const uint16_t* q_pe = static_cast<const uint16_t*>(p.q_pe);
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);

  // ---- the block's queries, once: row r = [q_lat (512) | q_pe (64)], zeros past the request
  for (int e = threadIdx.x; e < kBM * kChunks; e += 256) {
    const int r = e / kChunks, c = e % kChunks;
    const int64_t g = int64_t(q0) * H + row_base + r;
    const bool ok = row_base + r < rows;
    const uint16_t* src = c < kDL / 8 ? q_lat + g * kDL + c * 8 : q_pe + g * kDR + (c - kDL / 8) * 8;
    copy16(q_s + r * kLd + c * 8, ok ? src : q_lat, ok);
  }
  const uint16_t* qw = q_s + group * 16 * kLd;

  float o[kNT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // rows gq and gq + 8 (quad-uniform)
  float d[2] = {0.f, 0.f};              // lane-partial sums, reduced over the quad at the end

  for (int t0 = begin; t0 < end; t0 += kBN) {
    const int tn = end - t0 < kBN ? int(end - t0) : kBN;
    __syncthreads();  // previous tile consumed (and, the first time, q_s written)
    for (int e = threadIdx.x; e < kBN * kChunks; e += 256) {
      const int j = e / kChunks, c = e % kChunks;
      copy16(kv_s + j * kLd + c * 8, kv + int64_t(k0 + t0 + (j < tn ? j : 0)) * kDK + c * 8, j < tn);
    }
    __syncthreads();

    // ---- S = Q K^T: 16 rows x 16 keys (two n8 tiles), k over 576
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 4
    for (int kk = 0; kk < kDK; kk += 16) {
      uint32_t a[4];
      a[0] = lds32(qw + gq * kLd + kk + 2 * tq);
      a[1] = lds32(qw + (gq + 8) * kLd + kk + 2 * tq);
      a[2] = lds32(qw + gq * kLd + kk + 8 + 2 * tq);
      a[3] = lds32(qw + (gq + 8) * kLd + kk + 8 + 2 * tq);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint16_t* krow = kv_s + (nt * 8 + gq) * kLd + kk + 2 * tq;
        mma_bf16(s[nt], a, lds32(krow), lds32(krow + 8));
      }
    }
    // ---- scale, mask the tile's tail, online softmax (rows gq: i = 0, 1; gq + 8: i = 2, 3)
    float mx[2] = {-INFINITY, -INFINITY};
    float f[2];  // per-row rescale of o for this tile
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = nt * 8 + 2 * tq + (i & 1);
        s[nt][i] = col < tn ? s[nt][i] * p.scale : -INFINITY;
        mx[i >> 1] = fmaxf(mx[i >> 1], s[nt][i]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float new_m = fmaxf(m[h], mx[h]);  // finite: every tile has tn >= 1 keys
      f[h] = m[h] == -INFINITY ? 0.f : expf(m[h] - new_m);  // o is rescaled in the P.V step
      m[h] = new_m;
      d[h] *= f[h];
    }
    uint32_t a_hi[4], a_lo[4];  // P as the A operand (16 rows x 16 keys), hi + lo
    {
      float pr[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pr[nt][i] = expf(s[nt][i] - m[i >> 1]);  // masked: exp(-inf) = 0
          d[i >> 1] += pr[nt][i];
        }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float x = pr[nt][2 * h], y = pr[nt][2 * h + 1];
          const float xh = bf16_round(x), yh = bf16_round(y);
          a_hi[2 * nt + h] = pack_bf16(xh, yh);  // a0: (gq, k 0-7), a1: (gq+8, k 0-7), a2/a3: k 8-15
          a_lo[2 * nt + h] = pack_bf16(x - xh, y - yh);
        }
    }
    // ---- O[:, half] = f O + P V: V^T fragments by ldmatrix.trans, one n8 tile per load.
    // Each tile's P V starts from a zero accumulator and is added with an IEEE fma: the MMA's
    // own fp32 accumulation truncates, and chaining it over a whole chunk (hundreds of tiles)
    // biased the output by ~3e-5 relative at P = 32k on the H200 (measured; 2 MMAs per chain
    // now, so the bias stays at the one-tile level and the tile sums add with rounding).
    // ldmatrix.x2.trans: lanes 0-7 address keys 0-7, lanes 8-15 keys 8-15 (lanes 16-31 are
    // ignored) of the 8 columns of one n8 tile: b0 and b1 of that tile. One n8 tile at a time
    // keeps the temporaries small beside the 128 accumulator registers (sm_120: 170 registers,
    // no spills; sm_90: 255 registers and ~350 B of L1-resident spills).
    const uint16_t* vrow = kv_s + (lane & 15) * kLd + half * kHalf;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      uint32_t bv[2];
      ldmatrix_x2_trans(bv, vrow + nt * 8);
      float t[4] = {0.f, 0.f, 0.f, 0.f};
      mma_bf16(t, a_hi, bv[0], bv[1]);
      mma_bf16(t, a_lo, bv[0], bv[1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[nt][i] = fmaf(o[nt][i], f[i >> 1], t[i]);
    }
  }

  // ---- normalised partial state of rows gq and gq + 8 (same slot layout as the SIMT pass)
  const int64_t all_rows = int64_t(p.total_q) * H;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    d[h] += __shfl_xor_sync(0xffffffffu, d[h], 1);
    d[h] += __shfl_xor_sync(0xffffffffu, d[h], 2);
    const int64_t r = row_base + group * 16 + gq + 8 * h;
    if (r >= rows) continue;
    const int64_t slot = int64_t(blockIdx.y) * all_rows + int64_t(q0) * H + r;
    const float inv = 1.f / d[h];
    float* dst = p.ws_o + slot * kDL + half * kHalf + 2 * tq;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
      *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    if (half == 0 && tq == 0) p.ws_lse[slot] = m[h] + logf(d[h]);
  }
}

}  // namespace tc
