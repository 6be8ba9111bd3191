// oracle_core.h: one row (request b, depth d) of the batched noisy ORACLE drafter, shared by the
// CPU backend (oracle_cpu.cpp) and the CUDA kernel (oracle.cu). It computes exactly what the
// torch reference computes (engine/drafters/oracle.py, OracleDrafter.draft_batch), bit for bit:
// 32-bit integer hashes, doubles rounded at every step as torch rounds them (no FMA
// contraction), a float32 cast at the end. Notation of kdtree.h (kdt_oracle_draft).
#pragma once

#include <cstdint>

#include "kdtree/hd.h"

namespace kdt {
namespace oracle {

struct Args {
  int bs, L, K, V;
  double quality, q_mid, log_p0, rest_c, spread;  // q_mid = q + (1 - q) q; rest_c: see kdtree.h
  const int64_t* table;  // [table_rows, cols] true tokens by slot and position
  int table_rows, cols;
  const int64_t* seeds;    // [table_rows]
  const int64_t* rows;     // [bs] slot of each request
  const int64_t* lengths;  // [bs] committed length P of each request
  float* top_logp;         // [bs, L, K]
  int64_t* top_ids;        // [bs, L, K]
};

KDT_HD uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x4F6CDD1Du;
  return x ^ (x >> 16);
}

// IEEE double product and sum, never contracted into an FMA (torch rounds each).
KDT_HD double dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KDT_HD double dadd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

KDT_HD double unit(uint32_t h) { return double(h >> 8) / 16777216.0; }  // [0, 1), exact

// What a row needs before its K entries: the true token, its rank (K = outside the top K), the
// wrong tokens' offset and the row's hash.
struct Row {
  int64_t true_tok;
  int rank;
  int64_t offset;
  uint32_t base;
};

KDT_HD Row row_setup(const Args& a, int b, int d /* 1 .. L */) {
  int64_t slot = a.rows[b];
  if (slot < 0 || slot >= a.table_rows) slot = a.table_rows - 1;
  int64_t P = a.lengths[b] < 0 ? 0 : a.lengths[b];
  int64_t pos = P + d;
  if (pos > a.cols - 1) pos = a.cols - 1;
  Row r;
  r.true_tok = a.table[slot * a.cols + pos];
  uint32_t h = uint32_t(a.seeds[slot]);
  h = mix(h ^ uint32_t(P));
  h = mix(h ^ uint32_t(d));
  r.base = mix(h);
  const double u = unit(mix(r.base ^ 1u));
  const int k1 = a.K - 1 > 1 ? a.K - 1 : 1;
  const int r_mid = 1 + int(mix(r.base ^ 2u) % uint32_t(k1));
  r.rank = u < a.quality ? 0 : ((u < a.q_mid && a.K > 1) ? r_mid : a.K);
  const int v1 = a.V - 1 > 1 ? a.V - 1 : 1;
  r.offset = int64_t(mix(r.base ^ 3u) % uint32_t(v1));
  return r;
}

// Token at rank j: the true one at its rank, distinct wrong ones around it.
KDT_HD int64_t token_at(const Args& a, const Row& r, int j) {
  const int v1 = a.V - 1 > 1 ? a.V - 1 : 1;
  auto other = [&](int i) { return (r.true_tok + 1 + (r.offset + i) % v1) % a.V; };
  if (j < r.rank) return other(j);
  if (j == r.rank) return r.true_tok;
  return other(j - 1);
}

// The unsorted log-probability of wrong rank j >= 1: rest_c + spread * z_j, z_j a centred
// Irwin-Hall(4) draw scaled to variance 1.
KDT_HD double rest_at(const Args& a, const Row& r, int j) {
  double s = 0.0;
  for (int t = 0; t < 4; ++t) s = dadd(s, unit(mix(r.base ^ uint32_t(4 + 4 * j + t))));
  const double z = dmul(dadd(dmul(s, 2.0), -4.0), 1.7320508075688772);
  return dadd(a.rest_c, dmul(a.spread, z));
}

}  // namespace oracle
}  // namespace kdt
