// model_load.cpp: config.json + safetensors -> HostModel (FP32), with errors naming file and field.
//
// Which safetensors files: model.safetensors.index.json's weight_map when present, else
// model.safetensors, else every model-*.safetensors (sorted). Other files in the folder (the
// block drafter's weights, for example) are not read. Files are read with the shared strict
// reader (kdtree/kdtr.hpp); F32, BF16 and F16 tensors become FP32.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <set>
#include <sstream>

#include "common.h"
#include "kdtree/kdtr.hpp"
#include "model.h"
#include "model_json.h"

namespace kdt {
namespace model {
namespace {

const char* kFn = "kdt_engine_create";

struct LoadError {
  kdt_status status;
  std::string msg;
};

[[noreturn]] void fail(kdt_status st, const std::string& msg) { throw LoadError{st, msg}; }

bool read_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

bool file_exists(const std::string& path) { return std::ifstream(path).good(); }

// ---- config.json ---------------------------------------------------------------------------

double num_field(const json::Value& cfg, const std::string& path, const char* key, bool required,
                 double dflt) {
  const json::Value* v = cfg.get(key);
  if (!v || v->is_null()) {
    if (required) fail(KDT_ERR_FORMAT, path + ": field '" + key + "' is missing");
    return dflt;
  }
  if (v->kind != json::Value::Number)
    fail(KDT_ERR_FORMAT, path + ": field '" + key + "' must be a number");
  return v->num;
}

int int_field(const json::Value& cfg, const std::string& path, const char* key, bool required,
              int dflt) {
  double d = num_field(cfg, path, key, required, dflt);
  if (d != std::floor(d) || d < 0 || d > 1e9)
    fail(KDT_ERR_FORMAT, path + ": field '" + key + "' must be a non-negative integer");
  return int(d);
}

bool bool_field(const json::Value& cfg, const char* key, bool dflt) {
  const json::Value* v = cfg.get(key);
  return (v && v->kind == json::Value::Bool) ? v->b : dflt;
}

std::string str_field(const json::Value& cfg, const char* key, const char* dflt) {
  const json::Value* v = cfg.get(key);
  return (v && v->kind == json::Value::String) ? v->str : dflt;
}

// DeepSeek-V3 YaRN helpers (HF modeling_deepseek.py semantics), in double.
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}
double yarn_correction_dim(double rotations, int dim, double base, double max_pos) {
  return (dim * std::log(max_pos / (rotations * 2.0 * M_PI))) / (2.0 * std::log(base));
}

void parse_config(const std::string& dir, Config* c) {
  std::string path = dir + "/config.json", text;
  if (!read_file(path, &text)) fail(KDT_ERR_IO, path + ": cannot open (is the weights folder right?)");
  json::Value cfg;
  try {
    cfg = json::parse(text);
  } catch (const json::JsonError& e) {
    fail(KDT_ERR_FORMAT, path + ": not valid JSON: " + e.what());
  }
  if (cfg.kind != json::Value::Object) fail(KDT_ERR_FORMAT, path + ": top level is not an object");
  c->vocab = int_field(cfg, path, "vocab_size", true, 0);
  c->hidden = int_field(cfg, path, "hidden_size", true, 0);
  c->layers = int_field(cfg, path, "num_hidden_layers", true, 0);
  c->heads = int_field(cfg, path, "num_attention_heads", true, 0);
  c->q_lora = int_field(cfg, path, "q_lora_rank", false, 0);
  c->kv_lora = int_field(cfg, path, "kv_lora_rank", true, 0);
  c->rope = int_field(cfg, path, "qk_rope_head_dim", true, 0);
  c->nope = int_field(cfg, path, "qk_nope_head_dim", true, 0);
  c->v_head = int_field(cfg, path, "v_head_dim", true, 0);
  c->inter = int_field(cfg, path, "intermediate_size", true, 0);
  c->n_routed = int_field(cfg, path, "n_routed_experts", false, 0);
  c->moe_inter = int_field(cfg, path, "moe_intermediate_size", c->n_routed > 0, 0);
  c->n_shared = int_field(cfg, path, "n_shared_experts", false, 0);
  c->top_k = int_field(cfg, path, "num_experts_per_tok", c->n_routed > 0, 0);
  c->n_group = int_field(cfg, path, "n_group", false, 1);
  c->topk_group = int_field(cfg, path, "topk_group", false, c->n_group);
  c->first_dense = int_field(cfg, path, "first_k_dense_replace", false, 0);
  c->moe_freq = int_field(cfg, path, "moe_layer_freq", false, 1);
  c->norm_topk = bool_field(cfg, "norm_topk_prob", true);
  c->tie_embeddings = bool_field(cfg, "tie_word_embeddings", false);
  c->routed_scale = num_field(cfg, path, "routed_scaling_factor", false, 1.0);
  c->rms_eps = num_field(cfg, path, "rms_norm_eps", false, 1e-6);
  c->rope_theta = num_field(cfg, path, "rope_theta", false, 10000.0);
  std::string scoring = str_field(cfg, "scoring_func", "sigmoid");
  if (scoring != "sigmoid" && scoring != "softmax")
    fail(KDT_ERR_FORMAT, path + ": field 'scoring_func' must be 'sigmoid' or 'softmax', got '" +
                             scoring + "'");
  c->sigmoid_router = scoring == "sigmoid";
  std::string act = str_field(cfg, "hidden_act", "silu");
  if (act != "silu") fail(KDT_ERR_FORMAT, path + ": field 'hidden_act' must be 'silu', got '" + act + "'");

  if (c->vocab < 1 || c->hidden < 1 || c->layers < 1 || c->heads < 1 || c->kv_lora < 1)
    fail(KDT_ERR_FORMAT, path + ": vocab_size, hidden_size, num_hidden_layers, "
                                "num_attention_heads and kv_lora_rank must be >= 1");
  if (c->rope % 2 != 0 || c->rope < 2)
    fail(KDT_ERR_FORMAT, path + ": field 'qk_rope_head_dim' must be even and >= 2");
  if (c->n_routed > 0) {
    if (c->top_k < 1 || c->top_k > c->n_routed)
      fail(KDT_ERR_FORMAT, path + ": field 'num_experts_per_tok' must be in [1, n_routed_experts]");
    if (c->n_group < 1 || c->n_routed % c->n_group != 0 || c->topk_group < 1 ||
        c->topk_group > c->n_group)
      fail(KDT_ERR_FORMAT, path + ": n_group must divide n_routed_experts and 1 <= topk_group <= n_group");
  }

  // Attention scale and rotary frequencies (YaRN when rope_scaling.type is "yarn").
  c->softmax_scale = 1.0 / std::sqrt(double(c->nope + c->rope));
  int half = c->rope / 2;
  c->inv_freq.assign(half, 0.0);
  for (int i = 0; i < half; ++i) c->inv_freq[i] = 1.0 / std::pow(c->rope_theta, 2.0 * i / c->rope);
  c->rope_mscale = 1.0;
  const json::Value* rs = cfg.get("rope_scaling");
  if (rs && rs->kind == json::Value::Object) {
    std::string type = str_field(*rs, "type", "");
    if (type.empty()) type = str_field(*rs, "rope_type", "");
    std::string rpath = path + " rope_scaling";
    double factor = num_field(*rs, rpath, "factor", true, 1.0);
    if (type == "yarn") {
      double orig = num_field(*rs, rpath, "original_max_position_embeddings", false, 4096);
      double beta_fast = num_field(*rs, rpath, "beta_fast", false, 32);
      double beta_slow = num_field(*rs, rpath, "beta_slow", false, 1);
      double mscale = num_field(*rs, rpath, "mscale", false, 1);
      double mscale_all = num_field(*rs, rpath, "mscale_all_dim", false, 0);
      double low = std::floor(yarn_correction_dim(beta_fast, c->rope, c->rope_theta, orig));
      double high = std::ceil(yarn_correction_dim(beta_slow, c->rope, c->rope_theta, orig));
      low = std::max(low, 0.0);
      high = std::min(high, double(c->rope - 1));
      if (low == high) high += 0.001;
      for (int i = 0; i < half; ++i) {
        double extra = c->inv_freq[i], inter = extra / factor;
        double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
        double extra_w = 1.0 - ramp;  // 1 - linear ramp mask
        c->inv_freq[i] = inter * (1.0 - extra_w) + extra * extra_w;
      }
      c->rope_mscale = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all);
      if (mscale_all != 0.0) {
        double m = yarn_mscale(factor, mscale_all);
        c->softmax_scale *= m * m;
      }
    } else if (type == "linear") {
      for (double& f : c->inv_freq) f /= factor;
    } else {
      fail(KDT_ERR_FORMAT, rpath + ": type '" + type + "' is not supported (yarn, linear)");
    }
  }
}

// ---- safetensors (through the shared strict reader, kdtree/kdtr.hpp) ------------------------

void load_safetensors(const std::string& path, std::map<std::string, Tensor>* out) {
  SafetensorsFile f;
  kdt_status st = f.open(path);
  if (st != KDT_OK) fail(st, f.error());
  for (const TensorInfo& t : f.tensors()) {
    if (out->count(t.name)) fail(KDT_ERR_FORMAT, path + ": tensor '" + t.name + "' is defined twice");
    Tensor ten;
    ten.shape = t.shape;
    if ((st = f.read_f32(t.name, &ten.data)) != KDT_OK) fail(st, f.error());
    (*out)[t.name] = std::move(ten);
  }
}

std::vector<std::string> weight_files(const std::string& dir) {
  std::vector<std::string> files;
  std::string index = dir + "/model.safetensors.index.json", text;
  if (read_file(index, &text)) {
    json::Value idx;
    try {
      idx = json::parse(text);
    } catch (const json::JsonError& e) {
      fail(KDT_ERR_FORMAT, index + ": not valid JSON: " + e.what());
    }
    const json::Value* wm = idx.get("weight_map");
    if (!wm || wm->kind != json::Value::Object) fail(KDT_ERR_FORMAT, index + ": no weight_map object");
    std::set<std::string> names;
    for (const auto& kv : wm->obj) names.insert(kv.second.str);
    for (const auto& n : names) files.push_back(dir + "/" + n);
    return files;
  }
  if (file_exists(dir + "/model.safetensors")) return {dir + "/model.safetensors"};
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* ent = readdir(d)) {
      std::string n = ent->d_name;
      if (n.rfind("model-", 0) == 0 && n.size() > 12 && n.substr(n.size() - 12) == ".safetensors")
        files.push_back(dir + "/" + n);
    }
    closedir(d);
  }
  std::sort(files.begin(), files.end());
  if (files.empty())
    fail(KDT_ERR_IO, dir + ": no model.safetensors, model.safetensors.index.json or model-*.safetensors");
  return files;
}

const float* need(HostModel* m, const std::string& name, std::vector<int64_t> shape) {
  auto it = m->tensors.find(name);
  if (it == m->tensors.end())
    fail(KDT_ERR_FORMAT, m->dir + ": tensor '" + name + "' is missing from the weights");
  if (it->second.shape != shape) {
    std::string want, got;
    for (auto s : shape) want += std::to_string(s) + ",";
    for (auto s : it->second.shape) got += std::to_string(s) + ",";
    fail(KDT_ERR_FORMAT, m->dir + ": tensor '" + name + "' has shape [" + got + "], config.json implies [" + want + "]");
  }
  return it->second.data.data();
}

void bind(HostModel* m) {
  const Config& c = m->cfg;
  const int64_t D = c.hidden, V = c.vocab, H = c.heads;
  m->embed = need(m, "model.embed_tokens.weight", {V, D});
  m->final_norm = need(m, "model.norm.weight", {D});
  if (m->tensors.count("lm_head.weight") || !c.tie_embeddings)
    m->lm_head = need(m, "lm_head.weight", {V, D});
  else
    m->lm_head = m->embed;
  m->shared_inter = c.moe_inter * c.n_shared;
  m->layer.assign(c.layers, LayerWeights());
  for (int l = 0; l < c.layers; ++l) {
    LayerWeights& w = m->layer[l];
    std::string p = "model.layers." + std::to_string(l) + ".";
    w.in_norm = need(m, p + "input_layernorm.weight", {D});
    w.post_norm = need(m, p + "post_attention_layernorm.weight", {D});
    std::string a = p + "self_attn.";
    if (c.q_lora > 0) {
      w.q_a = need(m, a + "q_a_proj.weight", {c.q_lora, D});
      w.q_a_norm = need(m, a + "q_a_layernorm.weight", {c.q_lora});
      w.q_b = need(m, a + "q_b_proj.weight", {H * c.q_head(), c.q_lora});
    } else {
      w.q_proj = need(m, a + "q_proj.weight", {H * c.q_head(), D});
    }
    w.kv_a = need(m, a + "kv_a_proj_with_mqa.weight", {c.kv_dim(), D});
    w.kv_a_norm = need(m, a + "kv_a_layernorm.weight", {c.kv_lora});
    w.kv_b = need(m, a + "kv_b_proj.weight", {H * (c.nope + c.v_head), c.kv_lora});
    w.o_proj = need(m, a + "o_proj.weight", {D, H * c.v_head});
    std::string f = p + "mlp.";
    w.moe = c.is_moe(l);
    if (!w.moe) {
      w.gate = need(m, f + "gate_proj.weight", {c.inter, D});
      w.up = need(m, f + "up_proj.weight", {c.inter, D});
      w.down = need(m, f + "down_proj.weight", {D, c.inter});
      continue;
    }
    w.router = need(m, f + "gate.weight", {c.n_routed, D});
    if (m->tensors.count(f + "gate.e_score_correction_bias"))
      w.router_bias = need(m, f + "gate.e_score_correction_bias", {c.n_routed});
    if (c.n_shared > 0) {
      const int64_t S = m->shared_inter;
      w.gate = need(m, f + "shared_experts.gate_proj.weight", {S, D});
      w.up = need(m, f + "shared_experts.up_proj.weight", {S, D});
      w.down = need(m, f + "shared_experts.down_proj.weight", {D, S});
    }
    for (int e = 0; e < c.n_routed; ++e) {
      std::string x = f + "experts." + std::to_string(e) + ".";
      w.e_gate.push_back(need(m, x + "gate_proj.weight", {c.moe_inter, D}));
      w.e_up.push_back(need(m, x + "up_proj.weight", {c.moe_inter, D}));
      w.e_down.push_back(need(m, x + "down_proj.weight", {D, c.moe_inter}));
    }
  }
}

void rope_tables(HostModel* m, int max_pos) {
  const Config& c = m->cfg;
  const int half = c.rope / 2;
  m->max_pos = max_pos;
  m->cos_table.assign(size_t(max_pos) * half, 0.f);
  m->sin_table.assign(size_t(max_pos) * half, 0.f);
  for (int p = 0; p < max_pos; ++p)
    for (int i = 0; i < half; ++i) {
      double ang = double(p) * c.inv_freq[i];
      m->cos_table[size_t(p) * half + i] = float(std::cos(ang) * c.rope_mscale);
      m->sin_table[size_t(p) * half + i] = float(std::sin(ang) * c.rope_mscale);
    }
}

}  // namespace

kdt_status load_model(const std::string& dir, int max_pos, HostModel* out) {
  try {
    out->dir = dir;
    parse_config(dir, &out->cfg);
    for (const auto& f : weight_files(dir)) load_safetensors(f, &out->tensors);
    bind(out);
    rope_tables(out, max_pos);
  } catch (const LoadError& e) {
    return set_error(e.status, kFn, "%s", e.msg.c_str());
  } catch (const std::bad_alloc&) {
    return set_error(KDT_ERR_OUT_OF_MEMORY, kFn, "%s: out of host memory while loading", dir.c_str());
  }
  return KDT_OK;
}

}  // namespace model
}  // namespace kdt
