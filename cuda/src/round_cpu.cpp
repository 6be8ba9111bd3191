// round_cpu.cpp: the device path of the engine (kdt_engine_verify / _commit_accepted) on the
// CPU backend, where "the device" is host memory. Same semantics as model_cuda.cu's: trees are
// padded to n nodes (token -1 past num_nodes), the scratch slot's rows are padding. Here padding
// costs nothing: each request runs only its real nodes (the leading tokens >= 0), and padding
// rows and nodes get argmax -1 and zero hidden states.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common.h"
#include "engine.h"

namespace kdt {
namespace engine {

kdt_status verify_cpu(Engine& e, const RoundBatch& rb) {
  const auto& c = e.model.cfg;
  const int n = rb.n, D = c.hidden, V = c.vocab, W = rb.vis_words;
  std::vector<int32_t> slots, q_indptr{0}, prefix, rows;  // rows: the round row of each request
  std::vector<int64_t> tokens, positions;
  std::vector<uint32_t> vis;
  std::vector<char> seen(e.max_slots, 0);
  for (int r = 0; r < rb.n_req; ++r) {
    const int s = rb.slots[r];
    if (s < 0 || s >= e.max_slots || seen[s]) continue;  // padding (or a repeated slot)
    int n_b = 0;
    while (n_b < n && rb.tokens[size_t(r) * n + n_b] >= 0) ++n_b;
    if (n_b == 0 || e.seq_len[s] + n > e.max_seq) continue;
    seen[s] = 1;
    slots.push_back(s);
    rows.push_back(r);
    prefix.push_back(e.seq_len[s]);
    for (int i = 0; i < n_b; ++i) {
      const size_t t = size_t(r) * n + i;
      const int64_t tok = rb.tokens[t], pos = rb.positions[t];
      tokens.push_back(tok < V ? tok : 0);
      positions.push_back(pos >= 0 && pos < e.max_seq ? pos : e.seq_len[s]);
      const uint32_t* v = rb.visibility + t * W;
      for (int w = 0; w < W; ++w) {  // bits of padding nodes cleared; the self bit always set
        uint32_t bits = v[w];
        for (int j = 32 * w; j < 32 * w + 32; ++j)
          if (j >= n_b) bits &= ~(1u << (j & 31));
        if (i >> 5 == w) bits |= 1u << (i & 31);
        vis.push_back(bits);
      }
    }
    q_indptr.push_back(q_indptr.back() + n_b);
  }
  std::fill(rb.argmax, rb.argmax + size_t(rb.n_req) * n, int64_t(-1));
  if (rb.hidden) std::fill(rb.hidden, rb.hidden + size_t(rb.n_req) * n * D, 0.f);
  if (slots.empty()) return KDT_OK;
  const int total = q_indptr.back();
  std::vector<float> logits(size_t(total) * V), hidden(size_t(total) * D);
  const int32_t final_norm = c.layers + 1;
  Batch b;
  b.n_req = int(slots.size());
  b.slots = slots.data();
  b.q_indptr = q_indptr.data();
  b.prefix = prefix.data();
  b.total = total;
  b.tokens = tokens.data();
  b.positions = positions.data();
  b.visibility = vis.data();
  b.vis_words = W;
  b.max_tree = n;
  b.n_capture = 1;
  b.capture = &final_norm;
  b.logits = logits.data();
  b.hidden = hidden.data();
  kdt_status st = forward_cpu(e, b);
  if (st != KDT_OK) return st;
  for (size_t q = 0; q < slots.size(); ++q)
    for (int i = 0; i < q_indptr[q + 1] - q_indptr[q]; ++i) {
      const size_t t = size_t(q_indptr[q]) + i, out = size_t(rows[q]) * n + i;
      const float* row = &logits[t * V];
      rb.argmax[out] = std::max_element(row, row + V) - row;  // the first maximum
      if (rb.logits) std::memcpy(rb.logits + out * V, row, sizeof(float) * V);
      if (rb.hidden) std::memcpy(rb.hidden + out * D, &hidden[t * D], sizeof(float) * D);
    }
  return KDT_OK;
}

kdt_status commit_accepted_cpu(Engine& e, const AcceptBatch& a) {
  for (int r = 0; r < a.n_req; ++r) {
    const int s = a.slots[r];
    if (s < 0 || s >= e.max_slots) continue;  // padding rows
    const int len = std::min(std::max(a.accept_len[r], 0), a.n);
    const int32_t* keep = a.accept_index + size_t(r) * a.n;
    bool ok = e.seq_len[s] + len <= e.max_seq;
    for (int k = 0; k < len && ok; ++k) ok = keep[k] >= 0 && keep[k] < a.n;
    if (!ok)
      return set_error(KDT_ERR_INVALID_ARGUMENT, "kdt_engine_commit_accepted",
                       "row %d (slot %d): accept_index / accept_len %d outside the tree of %d "
                       "nodes or beyond max_seq %d", r, s, len, a.n, e.max_seq);
    kdt_status st = commit_cpu(e, s, len, keep);
    if (st != KDT_OK) return st;
  }
  return KDT_OK;
}

}  // namespace engine
}  // namespace kdt
