// round_finish_core.h: one request's end of a decode round (kdt_round_finish), shared by the
// CPU backend (round_finish_cpu.cpp) and the CUDA kernel (round_finish.cu).
#pragma once

#include <cstdint>

#include "kdtree/hd.h"

namespace kdt {
namespace round {

struct FinishArgs {
  int bs, n, D, max_seq, scratch_slot;
  const int64_t* rows;          // [bs] slot of each request (scratch_slot: padding)
  const int64_t* prefix;        // [bs] committed length P before the round
  const int64_t* tokens;        // [bs, n] tree tokens
  const int32_t* num_nodes;     // [bs] or null (a one-node tree)
  const int32_t* accept_index;  // [bs, n]
  const int32_t* accept_len;    // [bs]
  const int64_t* bonus;         // [bs]
  const float* hidden;          // [bs, n, D] the verify's final-norm hidden states
  float* hidden_ctx;            // [(scratch_slot + 1) * max_seq, D] committed hidden states
  int64_t* next_root;           // [scratch_slot + 1]
  int32_t* result;              // [bs, n + 2]
};

KDT_HD int accepted(const FinishArgs& a, int b) {
  const int len = a.accept_len[b];
  return len < 0 ? 0 : (len > a.n ? a.n : len);
}

KDT_HD bool real_slot(const FinishArgs& a, int b) {
  return a.rows[b] >= 0 && a.rows[b] < a.scratch_slot;
}

// Entry j of request b's result row: [a, tree nodes, a - 1 accepted tokens after the root,
// the bonus token, zeros].
KDT_HD int32_t result_at(const FinishArgs& a, int b, int j) {
  const int len = accepted(a, b);
  if (j == 0) return len;
  if (j == 1) return a.num_nodes ? a.num_nodes[b] : 1;
  const int k = j - 1;  // accepted node k (k >= 1), or the bonus at k == len
  if (k < len) {
    const int node = a.accept_index[size_t(b) * a.n + k];
    return node >= 0 && node < a.n ? int32_t(a.tokens[size_t(b) * a.n + node]) : 0;
  }
  return k == len ? int32_t(a.bonus[b]) : 0;
}

// Destination row of accepted node k's hidden state, or -1 (padding, out of range).
KDT_HD long long ctx_row(const FinishArgs& a, int b, int k) {
  if (!real_slot(a, b) || k >= accepted(a, b)) return -1;
  const int node = a.accept_index[size_t(b) * a.n + k];
  const long long pos = a.prefix[b] + k;
  if (node < 0 || node >= a.n || pos < 0 || pos >= a.max_seq) return -1;
  return a.rows[b] * (long long)a.max_seq + pos;
}

}  // namespace round
}  // namespace kdt
