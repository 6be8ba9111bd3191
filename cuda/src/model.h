// model.h: the DeepSeek-V3-style target model of the native engine (config, weights, shapes).
//
// The model is read from a Hugging Face style folder: config.json (DeepSeek-V3 keys) and
// safetensors files with DeepSeek-V3 tensor names. Weights are held as FP32 on the host; the
// CUDA backend uploads a copy. Notation used in the shape comments of model_*.cpp / *.cu:
//   D  hidden_size            H  num_attention_heads     V  vocab_size
//   Ql q_lora_rank (0: none)   C  kv_lora_rank            R  qk_rope_head_dim
//   N  qk_nope_head_dim       Dv v_head_dim              F  intermediate_size (dense layers)
//   E  n_routed_experts       Fm moe_intermediate_size   S  n_shared_experts    k  top-k
//   T  tokens in a forward batch (all requests' tree nodes, concatenated)
// The latent KV cache holds per token and layer one row of C + R floats: c_kv then k_pe.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kdtree/kdtree.h"

namespace kdt {
namespace model {

struct Config {
  int vocab = 0, hidden = 0, layers = 0, heads = 0;
  int q_lora = 0, kv_lora = 0, rope = 0, nope = 0, v_head = 0;
  int inter = 0, moe_inter = 0, n_routed = 0, n_shared = 0, top_k = 0;
  int n_group = 1, topk_group = 1, first_dense = 0, moe_freq = 1;
  bool norm_topk = true, sigmoid_router = true, tie_embeddings = false;
  double routed_scale = 1.0, rms_eps = 1e-6, rope_theta = 10000.0;
  // Derived (double, computed once): the attention scale (q_head_dim^-0.5, times the YaRN
  // mscale^2 when rope_scaling asks for it), the rotary inverse frequencies [R/2] and the
  // YaRN multiplier applied to cos and sin.
  double softmax_scale = 0.0, rope_mscale = 1.0;
  std::vector<double> inv_freq;

  int kv_dim() const { return kv_lora + rope; }     // one latent cache row
  int q_head() const { return nope + rope; }        // one query head before absorption
  bool is_moe(int layer) const {
    return n_routed > 0 && layer >= first_dense && (layer % (moe_freq > 0 ? moe_freq : 1)) == 0;
  }
};

// A named FP32 tensor loaded from safetensors (any float dtype is widened on load).
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Pointers into HostModel::tensors for one layer (row-major [out, in] like torch Linear).
struct LayerWeights {
  const float *in_norm = nullptr, *post_norm = nullptr;   // [D]
  const float *q_a = nullptr, *q_a_norm = nullptr, *q_b = nullptr;  // [Ql,D] [Ql] [H*(N+R),Ql]
  const float* q_proj = nullptr;                          // [H*(N+R), D] when Ql == 0
  const float *kv_a = nullptr, *kv_a_norm = nullptr;      // [C+R, D] [C]
  const float* kv_b = nullptr;                            // [H*(N+Dv), C]: W_UK rows then W_UV
  const float* o_proj = nullptr;                          // [D, H*Dv]
  // Dense FFN ([F,D] [F,D] [D,F]) or shared experts ([S*Fm, D] ...).
  const float *gate = nullptr, *up = nullptr, *down = nullptr;
  bool moe = false;
  const float *router = nullptr, *router_bias = nullptr;  // [E, D], [E] (bias may be null)
  std::vector<const float*> e_gate, e_up, e_down;         // per expert [Fm,D] [Fm,D] [D,Fm]
};

struct HostModel {
  Config cfg;
  std::string dir;
  std::map<std::string, Tensor> tensors;
  const float *embed = nullptr, *final_norm = nullptr, *lm_head = nullptr;  // [V,D] [D] [V,D]
  std::vector<LayerWeights> layer;
  int shared_inter = 0;  // rows of the dense FFN / shared-expert matrices of MoE layers (S*Fm)
  // Rotary tables for positions 0..max_pos-1: [max_pos, R/2] each, computed in double, stored FP32.
  int max_pos = 0;
  std::vector<float> cos_table, sin_table;
};

// Reads DIR/config.json and the target's safetensors; on error sets kdt_last_error (naming the
// file and the field or tensor) and returns the status. max_pos sizes the rotary tables.
kdt_status load_model(const std::string& dir, int max_pos, HostModel* out);

}  // namespace model
}  // namespace kdt
