// _tree_io.hpp: host-side inputs and outputs of kdt_tree_build / kdt_tree_accept for the native
// tests and the benchmark, and one call per backend (CUDA through the device helpers).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "_harness.hpp"

namespace kdt_test {

struct BuildIn {
  int bs = 0, L = 0, K = 0, budget = 0;
  std::vector<float> lp;       // [bs, L, K], rows sorted descending
  std::vector<int64_t> ids;    // [bs, L, K]
  std::vector<int64_t> root;   // [bs]
  std::vector<int64_t> seq;    // [bs]
};

struct BuildOut {
  std::vector<int64_t> tokens, positions, first_child, next_sibling;  // [bs, n]
  std::vector<int32_t> parents, depths;                               // [bs, n]
  std::vector<uint32_t> visibility;                                   // [bs, n, W]
  std::vector<int32_t> num_nodes;                                     // [bs]
  std::vector<double> scores;                                         // [bs, n]
  void resize(int bs, int budget) {
    const size_t n = (size_t)budget + 1, W = (n + 31) / 32, bn = (size_t)bs * n;
    tokens.assign(bn, 0); positions.assign(bn, 0); first_child.assign(bn, 0);
    next_sibling.assign(bn, 0); parents.assign(bn, 0); depths.assign(bn, 0);
    visibility.assign(bn * W, 0); num_nodes.assign((size_t)bs, 0); scores.assign(bn, 0.0);
  }
};

// Random inputs; ties = log-probs drawn from 4 repeated values (exact float64 score ties).
inline BuildIn random_build(std::mt19937_64& rng, int bs, int L, int K, int budget, bool ties) {
  BuildIn in{bs, L, K, budget, {}, {}, {}, {}};
  const size_t total = (size_t)bs * L * K;
  in.lp.resize(total);
  in.ids.resize(total);
  std::normal_distribution<float> normal(0.f, 3.f);
  float pool[4] = {0.f, -0.25f, -0.75f, -1.5f};
  if (ties && rng() % 2) for (float& p : pool) p = -std::uniform_real_distribution<float>(0.f, 3.f)(rng);
  for (size_t r = 0; r < (size_t)bs * L; ++r) {
    float* row = in.lp.data() + r * K;
    for (int k = 0; k < K; ++k) row[k] = ties ? pool[rng() % 4] : normal(rng) - 8.f;
    std::sort(row, row + K, [](float a, float b) { return a > b; });
  }
  for (auto& v : in.ids) v = (int64_t)(rng() % 1000);
  in.root.resize(bs);
  in.seq.resize(bs);
  for (int b = 0; b < bs; ++b) { in.root[b] = (int64_t)(rng() % 1000); in.seq[b] = (int64_t)(rng() % 5000); }
  return in;
}

inline kdt_status build_cpu(const BuildIn& in, BuildOut* out) {
  out->resize(in.bs, in.budget);
  return kdt_tree_build(KDT_BACKEND_CPU, nullptr, in.bs, in.L, in.K, in.budget, in.lp.data(),
                        in.ids.data(), in.root.data(), in.seq.data(), out->tokens.data(),
                        out->parents.data(), out->depths.data(), out->positions.data(),
                        out->first_child.data(), out->next_sibling.data(),
                        out->visibility.data(), out->num_nodes.data(), out->scores.data());
}

inline kdt_status build_cuda(const BuildIn& in, BuildOut* out) {
  out->resize(in.bs, in.budget);
  DeviceArray<float> lp(in.lp);
  DeviceArray<int64_t> ids(in.ids), root(in.root), seq(in.seq);
  DeviceArray<int64_t> tok(out->tokens.size()), pos(out->positions.size()),
      fc(out->first_child.size()), ns(out->next_sibling.size());
  DeviceArray<int32_t> par(out->parents.size()), dep(out->depths.size()), nn(out->num_nodes.size());
  DeviceArray<uint32_t> vis(out->visibility.size());
  DeviceArray<double> sc(out->scores.size());
  for (kdt_status s : {lp.status, ids.status, root.status, seq.status, tok.status, pos.status,
                       fc.status, ns.status, par.status, dep.status, nn.status, vis.status, sc.status})
    if (s != KDT_OK) return s;
  kdt_status s = kdt_tree_build(KDT_BACKEND_CUDA, nullptr, in.bs, in.L, in.K, in.budget, lp.get(),
                                ids.get(), root.get(), seq.get(), tok.get(), par.get(), dep.get(),
                                pos.get(), fc.get(), ns.get(), vis.get(), nn.get(), sc.get());
  if (s != KDT_OK) return s;
  if ((s = kdt_device_synchronize()) != KDT_OK) return s;
  out->tokens = tok.to_host(); out->positions = pos.to_host(); out->first_child = fc.to_host();
  out->next_sibling = ns.to_host(); out->parents = par.to_host(); out->depths = dep.to_host();
  out->num_nodes = nn.to_host(); out->visibility = vis.to_host(); out->scores = sc.to_host();
  return KDT_OK;
}

inline std::string same_build(const BuildOut& g, const BuildOut& r) {
  for (const std::string& e :
       {same("tokens", g.tokens, r.tokens), same("parents", g.parents, r.parents),
        same("depths", g.depths, r.depths), same("positions", g.positions, r.positions),
        same("first_child", g.first_child, r.first_child),
        same("next_sibling", g.next_sibling, r.next_sibling),
        same("visibility", g.visibility, r.visibility), same("num_nodes", g.num_nodes, r.num_nodes),
        same("scores", g.scores, r.scores)})
    if (!e.empty()) return e;
  return "";
}

struct AcceptIn {
  int bs = 0, n = 0;
  std::vector<int64_t> tokens, first_child, next_sibling, target;  // [bs, n]
  std::vector<int32_t> num_nodes;                                  // [bs] (empty: NULL)
};

struct AcceptOut {
  std::vector<int32_t> accept_index, accept_len, status;
  std::vector<int64_t> bonus;
  void resize(int bs, int n) {
    accept_index.assign((size_t)bs * n, 0); accept_len.assign(bs, 0); status.assign(bs, 0);
    bonus.assign(bs, 0);
  }
};

inline kdt_status accept_cpu(const AcceptIn& in, AcceptOut* out) {
  out->resize(in.bs, in.n);
  return kdt_tree_accept(KDT_BACKEND_CPU, nullptr, in.bs, in.n, in.tokens.data(),
                         in.first_child.data(), in.next_sibling.data(),
                         in.num_nodes.empty() ? nullptr : in.num_nodes.data(), in.target.data(),
                         out->accept_index.data(), out->accept_len.data(), out->bonus.data(),
                         out->status.data());
}

inline kdt_status accept_cuda(const AcceptIn& in, AcceptOut* out) {
  out->resize(in.bs, in.n);
  DeviceArray<int64_t> tok(in.tokens), fc(in.first_child), ns(in.next_sibling), tgt(in.target);
  DeviceArray<int32_t> nn(in.num_nodes);
  DeviceArray<int32_t> idx(out->accept_index.size()), len(out->accept_len.size()),
      st(out->status.size());
  DeviceArray<int64_t> bonus(out->bonus.size());
  for (kdt_status s : {tok.status, fc.status, ns.status, tgt.status, nn.status, idx.status,
                       len.status, st.status, bonus.status})
    if (s != KDT_OK) return s;
  kdt_status s = kdt_tree_accept(KDT_BACKEND_CUDA, nullptr, in.bs, in.n, tok.get(), fc.get(),
                                 ns.get(), in.num_nodes.empty() ? nullptr : nn.get(), tgt.get(),
                                 idx.get(), len.get(), bonus.get(), st.get());
  if (s != KDT_OK) return s;
  if ((s = kdt_device_synchronize()) != KDT_OK) return s;
  out->accept_index = idx.to_host(); out->accept_len = len.to_host();
  out->status = st.to_host(); out->bonus = bonus.to_host();
  return KDT_OK;
}

inline std::string same_accept(const AcceptOut& g, const AcceptOut& r) {
  for (const std::string& e :
       {same("accept_index", g.accept_index, r.accept_index),
        same("accept_len", g.accept_len, r.accept_len), same("bonus", g.bonus, r.bonus),
        same("status", g.status, r.status)})
    if (!e.empty()) return e;
  return "";
}

}  // namespace kdt_test
