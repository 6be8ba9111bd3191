// verify_attention_mma.cuh: the mma.sync tensor-core path of kdt_verify_attention for bfloat16
// caches of the MLA production shape (d_latent 512, d_rope 64), for sm_80+ (sm_120 has no
// wgmma; it also runs on sm_90). Included by verify_attention.cu inside its anonymous namespace
// (uses its Params); not a separate unit.
//
// Work decomposition. A request's rows are its (node, head) pairs, row = node * H + head; a
// block owns kGroups x 16 consecutive rows of one request and one chunk of the request's cache
// rows [0, kv_len) (prefix AND tree: the tree rows are just the last tiles, masked by the
// visibility bits; the mask is evaluated only on tiles that reach past the prefix). Chunks are
// the plan's split-KV (flash-decoding) chunks; with one chunk the block writes out / lse
// directly, else a normalised partial state per row into the workspace, merged exactly by LSE
// by merge_kernel (kdt::merge_weight). With 64 rows per block the AR step (tree 1, 64 heads)
// reads each cache row once per request.
//
// Block: 2 x kGroups warps; warp (group g, half h) owns rows [16 g, 16 g + 16) of the block and
// output columns [256 h, 256 h + 256). The cache streams through a kStages-deep cp.async ring of
// kBN-row tiles (each tile read from global once per block, used for both S = Q K^T and
// O += P V: V is the first 512 columns of K). S is split by the contraction dimension: half h
// computes the partial S over dims [288 h, 288 h + 288) (18 MMA k-steps x kBN / 8 n8 tiles), the
// pair exchanges the 16 x kBN partials through shared memory and both add them in the same
// order, so no MMA work is repeated and both warps hold the same S. Online softmax in registers
// (exp2 with log2(e) folded into the scale), P rounded once to bf16 as the A operand of P V (the
// bf16 tolerance is 1e-2 relative), fp32 accumulation of O in the MMA: 16 x 256 fp32 = 128
// registers per lane.
//
// Shared-memory traffic is what bounds this kernel (one SM reads 128 B of shared memory per
// clock; an ldmatrix.x4 is 512 B and feeds 2 MMAs). Per 16 keys a warp reads its Q fragment
// (16 x 288: 18 ldmatrix), the K fragments (18) and V^T (16). kBN = 32 (sm_90's default)
// reads the Q fragment once per 32 keys (43 instead of 52 ldmatrix per 16 keys, -17%) and halves
// the block barriers, pair exchanges and softmax reductions per key; it needs 37 KB per stage,
// so sm_120 (99 KB) keeps kBN = 16 and instead holds the query fragments in registers
// (SmallQ: 72 registers, 254 in all; 34 ldmatrix per 16 keys; 41 KB, two blocks per SM).
// Sharing a B fragment across two m16 row tiles would halve the K / V reads but needs 256 O
// registers per lane (or a 4-way S exchange that costs as much shared memory as it saves).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16, lane = 4 gq + tq):
//   A (16 x 16, row): a0 (row gq, k 2tq..2tq+1), a1 (row gq+8, same k), a2 (row gq, k 2tq+8..),
//                     a3 (row gq+8, k 2tq+8..)
//   B (16 x 8, col):  b0 (k 2tq..2tq+1, col gq), b1 (k 2tq+8.., col gq)
//   C (16 x 8, f32):  c0, c1 (row gq, cols 2tq, 2tq+1), c2, c3 (row gq+8, same cols)
// ldmatrix.x4 (no .trans): lane l addresses row (l & 7) of matrix l >> 3 and receives, per
// matrix, (M[l/4][2(l%4)], M[l/4][2(l%4)+1]); .trans receives (M[2(l%4)][l/4], M[2(l%4)+1][l/4]).
//
// Shared-memory rows are padded to 584 bf16 (1168 B = 292 words, 4 banks apart per row): the 8
// row addresses of one ldmatrix phase cover all 32 banks once.
#pragma once

// Needs <cuda_bf16.h>, included by verify_attention.cu at file scope.

namespace mma {

constexpr int kDL = 512, kDR = 64, kDK = kDL + kDR;
constexpr int kLd = kDK + 8;        // padded row, bf16 elements
constexpr int kHalfK = kDK / 2;     // 288: the contraction dims of one warp's partial S
constexpr int kHalfV = kDL / 2;     // 256: output columns per warp
constexpr int kNT = kHalfV / 8;     // 32 n8 output tiles per warp
constexpr int kChunks = kDK / 8;    // 16-byte pieces per cache / query row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kHalfK % 16 == 0, "each half of the contraction is whole k16 steps");

// Shared memory of one configuration: queries, the ring of kBN-row tiles, the S exchange
// (kBN / 2 floats per lane).
// kQReg: the queries' A fragments live in registers (72 per lane), loaded once through the
// ring's memory before the ring starts, so the block keeps no query tile in shared memory and
// the S loop reads only K from it.
template <int kGroups, int kStages, int kBN, bool kQReg = false>
struct Config {
  static constexpr int kRows = 16 * kGroups;
  static constexpr int kThreads = 64 * kGroups;
  static constexpr size_t kQTile = size_t(kRows) * kLd * 2;
  static constexpr size_t kQBytes = kQReg ? 0 : kQTile;
  static constexpr size_t kStageBytes = size_t(kBN) * kLd * 2;
  static constexpr size_t kRingBytes =
      kQReg && kQTile > kStages * kStageBytes ? kQTile : kStages * kStageBytes;
  static constexpr size_t kXBytes = size_t(2 * kGroups) * (kBN / 2) * 32 * 4;
  static constexpr size_t kSmem = kQBytes + kRingBytes + kXBytes;
  static_assert(kStages >= 2, "a ring needs two stages at least");
  static_assert(kBN == 16 || kBN == 32, "tiles of 16 or 32 cache rows");
  static_assert(VerifyAttentionPlan::kKvTile % kBN == 0, "chunks are whole tiles");
};
// sm_90 / sm_100-class parts (227 KB per block): 64 rows, 3 stages of 32-row tiles, 203,264 B
// (KDT_MMA_TILE=16 selects the previous configuration, 16-row tiles x 4 stages, 157,696 B).
using Big = Config<4, 3, 32>;
using Big16 = Config<4, 4, 16>;
// sm_120 / sm_86-class parts (99 KB per block): 32 rows, 3 stages of 16-row tiles, 97,536 B
// (32-row tiles do not fit two stages beside 32 query rows there); KDT_MMA_TILE=small.
using Small = Config<2, 3, 16>;
// The same rows with the query fragments in registers and 2 stages: 41,472 B, so two blocks
// (8 warps) share an SM of sm_120's 100 KB, and per 16 keys a warp reads 34 ldmatrix, not 52.
// sm_120's default (not yet measured there; KDT_MMA_TILE=smallq forces it on sm_90).
using SmallQ = Config<2, 2, 16, true>;
static_assert(Big::kSmem <= 232448 && Big16::kSmem <= 232448, "the big configurations fit 227 KB");
static_assert(Small::kSmem <= 101376, "the small configuration fits sm_120's 99 KB");
static_assert(2 * (SmallQ::kSmem + 1024) <= 102400, "two SmallQ blocks share an sm_120 SM");

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row)));
}
// 16-byte asynchronous copy global -> shared; src_bytes 0 writes zeros (src must still be a
// valid address).
__device__ __forceinline__ void cp_async16(uint16_t* dst, const uint16_t* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}
// Barrier of the two warps of one row group (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void pair_barrier(int group) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(group + 1));
}
// Two floats as a bf16x2 register (x in the low half: the lower column of the fragment).
__device__ __forceinline__ uint32_t pack_bf16(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <int kGroups, int kStages, int kBN, bool kQReg>
__global__ void __launch_bounds__(64 * kGroups) attention_mma_kernel(Params p) {
  using C = Config<kGroups, kStages, kBN, kQReg>;
  constexpr int kNB = kBN / 16;  // 16-key blocks per tile (k16 steps of P V)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem_raw + C::kQBytes);    // [kStages][kBN][kLd]
  uint16_t* q_s = kQReg ? ring : reinterpret_cast<uint16_t*>(smem_raw);    // [kRows][kLd]
  float* xs = reinterpret_cast<float*>(smem_raw + C::kQBytes + C::kRingBytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp >> 1, half = warp & 1;
  const int gq = lane >> 2, tq = lane & 3;
  const int b = blockIdx.z;
  const int q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int n = q1 - q0, kv_len = k1 - k0, P = kv_len - n, H = p.H;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  const int64_t rows = int64_t(n) * H, row_base = int64_t(blockIdx.x) * C::kRows;
  if (!valid) {
    // Broken index pointers cannot be reported without a host sync: with one chunk this
    // kernel writes the output, so it poisons the rows it would own where addressable (the
    // merge kernel does it otherwise).
    if (p.splits == 1 && q0 >= 0 && q1 <= p.total_q && n > 0 && n <= p.max_tree) {
      const float nan = __int_as_float(0x7fc00000);
      for (int64_t r = row_base + warp; r < min(rows, row_base + C::kRows); r += 2 * kGroups) {
        const int64_t g = int64_t(q0) * H + r;
        for (int k = lane; k < kDL; k += 32) p.out[g * kDL + k] = nan;
        if (lane == 0) p.lse[g] = nan;
      }
    }
    return;
  }
  if (row_base >= rows) return;  // uniform over the block
  const int64_t begin64 = int64_t(blockIdx.y) * p.chunk;
  if (begin64 >= kv_len) return;  // this request has fewer chunks; the merge reads only its own
  const int begin = int(begin64);
  const int end = int(min(int64_t(kv_len), begin64 + p.chunk));
  const int ntiles = (end - begin + kBN - 1) / kBN;
  const uint16_t* q_lat = static_cast<const uint16_t*>(p.q_lat);
  const uint16_t* q_pe = static_cast<const uint16_t*>(p.q_pe);
  const uint16_t* kv = static_cast<const uint16_t*>(p.kv);

  // ---- queries (cp.async group 0): row r = [q_lat (512) | q_pe (64)], zeros past the request
  for (int e = threadIdx.x; e < C::kRows * kChunks; e += C::kThreads) {
    const int r = e / kChunks, c = e % kChunks;
    const bool ok = row_base + r < rows;
    const int64_t g = int64_t(q0) * H + row_base + (ok ? r : 0);
    const uint16_t* src = c < kDL / 8 ? q_lat + g * kDL + c * 8 : q_pe + g * kDR + (c - kDL / 8) * 8;
    cp_async16(q_s + r * kLd + c * 8, src, ok);
  }
  // ldmatrix row addresses (elements) of this lane, before the k / column offset:
  const int mi = lane >> 3, ri = lane & 7;
  const uint16_t* qa = q_s + (group * 16 + (mi & 1) * 8 + ri) * kLd + (mi >> 1) * 8 + half * kHalfK;
  // kQReg: the query fragments (group 0 alone) into registers; the ring then reuses the staging
  uint32_t qf[kQReg ? kHalfK / 16 : 1][4];
  if constexpr (kQReg) {
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < kHalfK / 16; ++ks) ldmatrix_x4(qf[ks], qa + 16 * ks);
    __syncthreads();
  }
  // ---- ring prologue: tiles 0 .. kStages-2, one commit group each (empty groups complete at once)
  auto load_tile = [&](int t) {
    uint16_t* dst = ring + (t % kStages) * (kBN * kLd);
    const int t0 = begin + t * kBN;
    for (int e = threadIdx.x; e < kBN * kChunks; e += C::kThreads) {
      const int j = e / kChunks, c = e % kChunks;
      const bool ok = t0 + j < end;
      cp_async16(dst + j * kLd + c * 8, kv + (int64_t(k0) + (ok ? t0 + j : begin)) * kDK + c * 8, ok);
    }
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < ntiles) load_tile(t);
    cp_async_commit();
  }

  // ---- this lane's rows: gq and gq + 8 of its group; their nodes for the tree mask
  const int64_t r_lo = row_base + group * 16 + gq;
  int node[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = r_lo + 8 * h;
    node[h] = int((r < rows ? r : rows - 1) / H);  // padding rows borrow a real node's mask
  }
  const float scale2 = p.scale * kLog2e;  // scores in log2 units
  float o[kNT][4];
#pragma unroll
  for (int i = 0; i < kNT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 units), quad-uniform
  float d[2] = {0.f, 0.f};              // lane-partial sums, reduced over the quad at the end
  const int kb_off = ((mi >> 1) * 8 + ri) * kLd + (mi & 1) * 8 + half * kHalfK;  // K as B of S
  const int vb_off = ((mi & 1) * 8 + ri) * kLd + (mi >> 1) * 8 + half * kHalfV;  // V^T as B of PV
  float4* x_mine = reinterpret_cast<float4*>(xs) + warp * (2 * kNB * 32) + lane;
  const float4* x_other = reinterpret_cast<const float4*>(xs) + (warp ^ 1) * (2 * kNB * 32) + lane;

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<kStages - 2>();  // tile t (and the queries) landed for this thread
    __syncthreads();               // ... for every thread; and stage (t - 1) % kStages is free
    if (t + kStages - 1 < ntiles) load_tile(t + kStages - 1);
    cp_async_commit();
    const uint16_t* kt = ring + (t % kStages) * (kBN * kLd);
    const int t0 = begin + t * kBN;

    // ---- partial S over this half's 288 contraction dims: 16 rows x kBN keys (n8 tile nt:
    // keys 8 nt .. 8 nt + 7); one Q fragment serves the kNB key blocks of a k16 step
    float s[2 * kNB][4];
#pragma unroll
    for (int nt = 0; nt < 2 * kNB; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    if constexpr (kQReg) {
#pragma unroll
      for (int ks = 0; ks < kHalfK / 16; ++ks) {
#pragma unroll
        for (int j = 0; j < kNB; ++j) {
          uint32_t bk[4];  // keys 16 j + 0-7: (bk0, bk1); 16 j + 8-15: (bk2, bk3)
          ldmatrix_x4(bk, kt + kb_off + j * 16 * kLd + 16 * ks);
          mma_bf16(s[2 * j], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], bk[0], bk[1]);
          mma_bf16(s[2 * j + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], bk[2], bk[3]);
        }
      }
    } else {
#pragma unroll(kNB == 1 ? 6 : 3)
      for (int kk = 0; kk < kHalfK; kk += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, qa + kk);  // a0..a3 as in the layout table
#pragma unroll
        for (int j = 0; j < kNB; ++j) {
          uint32_t bk[4];  // keys 16 j + 0-7: (bk0, bk1); 16 j + 8-15: (bk2, bk3)
          ldmatrix_x4(bk, kt + kb_off + j * 16 * kLd + kk);
          mma_bf16(s[2 * j], a[0], a[1], a[2], a[3], bk[0], bk[1]);
          mma_bf16(s[2 * j + 1], a[0], a[1], a[2], a[3], bk[2], bk[3]);
        }
      }
    }
    // ---- exchange the partials within the pair; both add them as part(half 0) + part(half 1)
#pragma unroll
    for (int nt = 0; nt < 2 * kNB; ++nt)
      x_mine[nt * 32] = make_float4(s[nt][0], s[nt][1], s[nt][2], s[nt][3]);
    pair_barrier(group);
#pragma unroll
    for (int nt = 0; nt < 2 * kNB; ++nt) {
      const float4 ov = x_other[nt * 32];
      const float other[4] = {ov.x, ov.y, ov.z, ov.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[nt][i] = half == 0 ? s[nt][i] + other[i] : other[i] + s[nt][i];
    }
    // ---- scale and mask: keys past the chunk always, tree keys (col >= P) by visibility
    const bool tail = t0 + kBN > P;
#pragma unroll
    for (int nt = 0; nt < 2 * kNB; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = t0 + nt * 8 + 2 * tq + (i & 1);
        bool vis = col < end;
        if (tail && vis && col >= P) {
          const int j = col - P;
          const uint32_t w = __ldg(p.vis + int64_t(q0 + node[i >> 1]) * p.vis_words + (j >> 5));
          vis = (w >> (j & 31)) & 1u;
        }
        s[nt][i] = vis ? s[nt][i] * scale2 : -INFINITY;
      }
    // ---- online softmax (rows gq: i = 0, 1; gq + 8: i = 2, 3)
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(s[0][2 * h], s[0][2 * h + 1]);
#pragma unroll
      for (int nt = 1; nt < 2 * kNB; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float new_m = fmaxf(m[h], mx);
      f[h] = (m[h] == -INFINITY || new_m == -INFINITY) ? (m[h] == -INFINITY ? 0.f : 1.f)
                                                       : exp2f(m[h] - new_m);
      m[h] = new_m;
      d[h] *= f[h];
    }
    // P as the A operand of key block j: pa[j][0] (row gq, keys 16 j + 0-7), pa[j][1] (gq + 8,
    // same keys), pa[j][2] / pa[j][3] (keys 16 j + 8-15)
    uint32_t pa[kNB][4];
#pragma unroll
    for (int nt = 0; nt < 2 * kNB; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mu = m[h] == -INFINITY ? 0.f : m[h];  // all masked so far: weights stay 0
        const float x = exp2f(s[nt][2 * h] - mu), y = exp2f(s[nt][2 * h + 1] - mu);
        d[h] += x + y;
        pa[nt >> 1][2 * (nt & 1) + h] = pack_bf16(x, y);
      }
    // ---- O = f O + P V over this warp's 256 output columns, two n8 tiles per ldmatrix
    if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < kNT; ++i) {
        o[i][0] *= f[0];
        o[i][1] *= f[0];
        o[i][2] *= f[1];
        o[i][3] *= f[1];
      }
    }
#pragma unroll
    for (int nt = 0; nt < kNT; nt += 2) {
#pragma unroll
      for (int j = 0; j < kNB; ++j) {
        uint32_t bv[4];  // keys 16 j ..: cols nt*8..: (bv0, bv1); next 8 cols: (bv2, bv3)
        ldmatrix_x4_trans(bv, kt + vb_off + j * 16 * kLd + nt * 8);
        mma_bf16(o[nt], pa[j][0], pa[j][1], pa[j][2], pa[j][3], bv[0], bv[1]);
        mma_bf16(o[nt + 1], pa[j][0], pa[j][1], pa[j][2], pa[j][3], bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();  // no copy outlives the block

  // ---- normalised state of rows gq and gq + 8: the output itself (one chunk) or a partial
  const int64_t all_rows = int64_t(p.total_q) * H;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    d[h] += __shfl_xor_sync(0xffffffffu, d[h], 1);
    d[h] += __shfl_xor_sync(0xffffffffu, d[h], 2);
    const int64_t r = r_lo + 8 * h;
    if (r >= rows) continue;
    const int64_t g = int64_t(q0) * H + r;
    const float inv = d[h] > 0.f ? 1.f / d[h] : 0.f;
    const float lse = d[h] > 0.f ? (m[h] + log2f(d[h])) * kLn2 : -INFINITY;
    const int64_t slot = p.splits == 1 ? g : int64_t(blockIdx.y) * all_rows + g;
    float* dst = (p.splits == 1 ? p.out : p.ws_o) + slot * kDL + half * kHalfV + 2 * tq;
#pragma unroll
    for (int i = 0; i < kNT; ++i)
      *reinterpret_cast<float2*>(dst + i * 8) = make_float2(o[i][2 * h] * inv, o[i][2 * h + 1] * inv);
    if (half == 0 && tq == 0) (p.splits == 1 ? p.lse : p.ws_lse)[slot] = lse;
  }
}

// Exact LSE merge of a request's chunk states (chunks partition [0, kv_len), so request b has
// ceil(kv_len / chunk) of them): four warps per (node, head) row, one float4 (4 output columns)
// per lane, so that the AR step at bs 1 (64 rows, ~128 chunks) still spreads over 32 blocks;
// the chunk loop is unrolled so that several chunks' loads are in flight. Every chunk below the
// request's count was written by its block (zeros and lse -inf when it saw no key).
// Grid (ceil(max_tree * H * 4 / 8), 1, bs), 256 threads.
constexpr int kMergeQuarters = 4;
__global__ void __launch_bounds__(256) merge_kernel(Params p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.z;
  const int q0 = p.q_indptr[b], q1 = p.q_indptr[b + 1];
  const int k0 = p.kv_indptr[b], k1 = p.kv_indptr[b + 1];
  const int n = q1 - q0, kv_len = k1 - k0, P = kv_len - n, H = p.H;
  const bool valid = q0 >= 0 && k0 >= 0 && n >= 0 && n <= p.max_tree && P >= 0 &&
                     kv_len <= p.max_kv && q1 <= p.total_q && k1 <= p.total_kv;
  const int64_t item = int64_t(blockIdx.x) * 8 + warp;
  const int64_t r = item / kMergeQuarters;
  const int quarter = int(item % kMergeQuarters);
  if (q0 < 0 || q1 > p.total_q || n <= 0 || n > p.max_tree || r >= int64_t(n) * H) return;
  const int64_t g = int64_t(q0) * H + r;
  const int col = quarter * (kDL / kMergeQuarters) + 4 * lane;
  if (!valid) {
    const float nan = __int_as_float(0x7fc00000);
    *reinterpret_cast<float4*>(p.out + g * kDL + col) = make_float4(nan, nan, nan, nan);
    if (quarter == 0 && lane == 0) p.lse[g] = nan;
    return;
  }
  const int64_t all_rows = int64_t(p.total_q) * H;
  const int64_t nsp = (kv_len + p.chunk - 1) / p.chunk;  // >= 1: kv_len >= n >= 1
  float lmax = -INFINITY;
  for (int64_t sp = lane; sp < nsp; sp += 32) lmax = fmaxf(lmax, p.ws_lse[sp * all_rows + g]);
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffffu, lmax, off));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
#pragma unroll 4
  for (int64_t sp = 0; sp < nsp; ++sp) {
    const int64_t slot = sp * all_rows + g;
    const float w = merge_weight(p.ws_lse[slot], lmax);
    const float4 v = *reinterpret_cast<const float4*>(p.ws_o + slot * kDL + col);
    wsum += w;
    acc.x = fmaf(w, v.x, acc.x);
    acc.y = fmaf(w, v.y, acc.y);
    acc.z = fmaf(w, v.z, acc.z);
    acc.w = fmaf(w, v.w, acc.w);
  }
  const float winv = wsum > 0.f ? 1.f / wsum : 0.f;
  *reinterpret_cast<float4*>(p.out + g * kDL + col) =
      make_float4(acc.x * winv, acc.y * winv, acc.z * winv, acc.w * winv);
  if (quarter == 0 && lane == 0) p.lse[g] = merged_lse(lmax, wsum);
}

}  // namespace mma
