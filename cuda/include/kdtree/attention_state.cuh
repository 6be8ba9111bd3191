// attention_state.cuh: the online-softmax state and the log-sum-exp merge, shared by the CPU
// backend (double), the CUDA kernels (float) and mirrored by engine/reference/mla.py's merge_states.
//
// A state over a set of keys with scores s_j and values v_j is (o, m, d):
//   m = max_j s_j (-inf when the set is empty), d = sum_j exp(s_j - m), o = sum_j exp(s_j - m) v_j
// (o unnormalised while accumulating). Its normalised form is (o / d, lse) with
// lse = m + log(d) in the natural log (not base 2, unlike FlashInfer). The empty state is
// (o = 0, m = -inf, d = 0), normalised (0, -inf); every function below handles it without
// producing NaN (exp(-inf - -inf) is never evaluated).
#pragma once

#include <cmath>
#include <cstring>

#include "kdtree/hd.h"

namespace kdt {

KDT_HD float att_exp(float x) { return expf(x); }
KDT_HD double att_exp(double x) { return exp(x); }
KDT_HD float att_log(float x) { return logf(x); }
KDT_HD double att_log(double x) { return log(x); }
template <typename F>
KDT_HD F att_neg_inf() { return -static_cast<F>(INFINITY); }

// Running (m, d) of one query row; the caller keeps o beside it (in registers or an array).
template <typename F>
struct SoftmaxState {
  F m;  // running max of the scores absorbed so far (-inf: none yet)
  F d;  // sum of exp(score - m) over the scores absorbed so far

  KDT_HD void init() {
    m = att_neg_inf<F>();
    d = F(0);
  }
  // Before absorbing a block of scores whose max is block_max: moves m to max(m, block_max),
  // rescales d, and returns the factor by which the caller must scale its o (1 when nothing
  // changes; 0 when the state was empty, so stale o never leaks in).
  KDT_HD F rescale(F block_max) {
    F new_m = block_max > m ? block_max : m;
    if (new_m == att_neg_inf<F>()) return F(1);  // still empty: nothing to rescale
    F s = (m == att_neg_inf<F>()) ? F(0) : att_exp(m - new_m);
    d *= s;
    m = new_m;
    return s;
  }
  // The weight of one score after rescale(); a masked score (-inf) weighs 0.
  KDT_HD F weight(F score) const {
    return score == att_neg_inf<F>() ? F(0) : att_exp(score - m);
  }
  KDT_HD F lse() const { return d > F(0) ? m + att_log(d) : att_neg_inf<F>(); }
  // 1 / d for normalising o; 0 for the empty state (its o is 0 and stays 0).
  KDT_HD F inv_d() const { return d > F(0) ? F(1) / d : F(0); }
};

// Merge of normalised states by their LSEs, in two steps so that n-way merges stay exact:
// lse_max over the parts, then w_k = exp(lse_k - lse_max), o = sum w_k o_k / sum w_k,
// lse = lse_max + log(sum w_k). Parts with lse = -inf weigh 0; all parts empty gives (0, -inf).
template <typename F>
KDT_HD F merge_weight(F lse_part, F lse_max) {
  return lse_part == att_neg_inf<F>() ? F(0) : att_exp(lse_part - lse_max);
}
template <typename F>
KDT_HD F merged_lse(F lse_max, F weight_sum) {
  return weight_sum > F(0) ? lse_max + att_log(weight_sum) : att_neg_inf<F>();
}

// bfloat16 stored as raw uint16: the float with the same top 16 bits (exact).
KDT_HD float bf16_bits_to_float(unsigned short b) {
  unsigned int u = static_cast<unsigned int>(b) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace kdt
