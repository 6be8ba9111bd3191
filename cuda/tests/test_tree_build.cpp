// test_tree_build: kdt_tree_build against the reference's KDTR bundles (bit-exact, CPU and, when
// a GPU is present, CUDA), the worked example of DDTREE.md, argument validation, and random
// cross-checks with exact ties up to budget 1024 with K = 1024: the CPU emulations of the
// parallel and the one-warp builds vs the serial heap, and every CUDA mode (KDT_TREE_BUILD:
// auto, warp, parallel, serial) vs the CPU.
//   test_tree_build --bundles DIR [--seed S]
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <random>

#include "_tree_io.hpp"
#include "tree_build_parallel.h"

using namespace kdt_test;

namespace {

std::string load_bundle(const std::string& path, BuildIn* in, BuildOut* ref) {
  kdt::SafetensorsFile f;
  if (f.open(path) != KDT_OK || f.check_kdtr("tree_build") != KDT_OK) return f.error();
  // Every tensor against the case (bs, L, K, budget) and each other, before anything is read:
  // the kernel trusts that top_ids, root_ids and seq_lens are as long as top_logp says.
  using kdt::DType;
  BundleShapes s(f);
  if (!(s.param("bs", 0, 1 << 20) && s.param("L", 1, 1 << 10) && s.param("K", 1, 1 << 20) &&
        s.param("budget", 1, 1 << 16) && s.bind("n", s["budget"] + 1, "budget + 1") &&
        s.bind("W", (s["n"] + 31) / 32, "(n + 31) / 32") &&
        s.tensor("top_logp", DType::F32, {"bs", "L", "K"}) &&
        s.tensor("top_ids", DType::I64, {"bs", "L", "K"}) && s.tensor("root_ids", DType::I64, {"bs"}) &&
        s.tensor("seq_lens", DType::I64, {"bs"}) && s.tensor("budget", DType::I64, {"1"})))
    return s.err;
  for (const char* name : {"expected.tokens", "expected.positions", "expected.first_child", "expected.next_sibling"})
    if (!s.tensor(name, DType::I64, {"bs", "n"})) return s.err;
  if (!(s.tensor("expected.parents", DType::I32, {"bs", "n"}) && s.tensor("expected.depths", DType::I32, {"bs", "n"}) &&
        s.tensor("expected.visibility", DType::U32, {"bs", "n", "W"}) &&
        s.tensor("expected.num_nodes", DType::I32, {"bs"}) && s.tensor("expected.scores", DType::F64, {"bs", "n"})))
    return s.err;
  in->bs = (int)s["bs"]; in->L = (int)s["L"]; in->K = (int)s["K"];
  std::vector<int64_t> budget;
  using kdt::DType;
  for (const std::string& e :
       {read(f, "top_logp", DType::F32, &in->lp), read(f, "top_ids", DType::I64, &in->ids),
        read(f, "root_ids", DType::I64, &in->root), read(f, "seq_lens", DType::I64, &in->seq),
        read(f, "budget", DType::I64, &budget),
        read(f, "expected.tokens", DType::I64, &ref->tokens),
        read(f, "expected.parents", DType::I32, &ref->parents),
        read(f, "expected.depths", DType::I32, &ref->depths),
        read(f, "expected.positions", DType::I64, &ref->positions),
        read(f, "expected.first_child", DType::I64, &ref->first_child),
        read(f, "expected.next_sibling", DType::I64, &ref->next_sibling),
        read(f, "expected.visibility", DType::U32, &ref->visibility),
        read(f, "expected.num_nodes", DType::I32, &ref->num_nodes),
        read(f, "expected.scores", DType::F64, &ref->scores)})
    if (!e.empty()) return e;
  if (budget[0] != s["budget"])
    return path + ": inconsistent bundle: tensor budget holds " + std::to_string(budget[0]) +
           ", the case metadata " + std::to_string(s["budget"]);
  in->budget = (int)budget[0];
  if (in->K > in->budget) {  // the reference allows K > budget; ranks >= budget never win
    std::vector<float> lp;
    std::vector<int64_t> ids;
    for (size_t r = 0; r < (size_t)in->bs * in->L; ++r)
      for (int k = 0; k < in->budget; ++k) {
        lp.push_back(in->lp[r * in->K + k]);
        ids.push_back(in->ids[r * in->K + k]);
      }
    in->lp.swap(lp); in->ids.swap(ids); in->K = in->budget;
  }
  return "";
}

std::string worked_example() {
  // DDTREE.md section 2: L = 3, K = 3, B = 6.
  const double p[3][3] = {{0.6, 0.3, 0.1}, {0.5, 0.4, 0.1}, {0.9, 0.05, 0.05}};
  BuildIn in{1, 3, 3, 6, {}, {11, 12, 13, 21, 22, 23, 31, 32, 33}, {7}, {100}};
  for (auto& row : p)
    for (double v : row) in.lp.push_back((float)std::log(v));
  BuildOut out;
  if (kdt_status s = build_cpu(in, &out)) return status_message(s, "kdt_tree_build");
  BuildOut ref;
  ref.tokens = {7, 11, 21, 12, 31, 22, 31};
  ref.depths = {0, 1, 2, 1, 3, 2, 3};
  ref.parents = {-1, 0, 1, 0, 2, 1, 5};
  ref.first_child = {3, 5, 4, -1, -1, 6, -1};
  ref.next_sibling = {-1, -1, -1, 1, -1, 2, -1};
  // Row i: bit i and its ancestors' bits (root = bit 0).
  ref.visibility = {0x1, 0x3, 0x7, 0x9, 0x17, 0x23, 0x63};
  for (const std::string& e :
       {same("tokens", out.tokens, ref.tokens), same("depths", out.depths, ref.depths),
        same("parents", out.parents, ref.parents), same("first_child", out.first_child, ref.first_child),
        same("next_sibling", out.next_sibling, ref.next_sibling),
        same("visibility", out.visibility, ref.visibility)})
    if (!e.empty()) return e;
  return out.num_nodes[0] == 7 ? "" : "num_nodes " + std::to_string(out.num_nodes[0]) + " != 7";
}

// Each bad argument must give KDT_ERR_INVALID_ARGUMENT and a message naming it.
std::string invalid_arguments() {
  BuildIn in{1, 2, 2, 4, {0.f, -1.f, 0.f, -1.f}, {1, 2, 3, 4}, {0}, {0}};
  BuildOut o;
  o.resize(1, 4);
  struct Case { int bs, L, K, budget; const float* lp; int backend; const char* needle; };
  const Case cases[] = {
      {1, 2, 2, 0, in.lp.data(), 0, "budget"},   {1, 2, 2, 1025, in.lp.data(), 0, "budget"},
      {1, 0, 2, 4, in.lp.data(), 0, "L="},       {1, 33, 2, 4, in.lp.data(), 0, "L="},
      {1, 2, 0, 4, in.lp.data(), 0, "K="},       {1, 2, 5, 4, in.lp.data(), 0, "K="},
      {-1, 2, 2, 4, in.lp.data(), 0, "bs="},     {1, 2, 2, 4, nullptr, 0, "top_logp"},
      {1, 2, 2, 4, in.lp.data(), 7, "backend"},
  };
  for (const Case& c : cases) {
    const kdt_status s = kdt_tree_build((kdt_backend)c.backend, nullptr, c.bs, c.L, c.K, c.budget,
                                        c.lp, in.ids.data(), in.root.data(), in.seq.data(),
                                        o.tokens.data(), o.parents.data(), o.depths.data(),
                                        o.positions.data(), o.first_child.data(),
                                        o.next_sibling.data(), o.visibility.data(),
                                        o.num_nodes.data(), o.scores.data());
    if (s != KDT_ERR_INVALID_ARGUMENT)
      return std::string("case '") + c.needle + "': status " + std::to_string((int)s) + ", expected 1";
    if (!std::strstr(kdt_last_error(), c.needle))
      return std::string("case '") + c.needle + "': message '" + kdt_last_error() + "' does not name it";
  }
  // bs == 0 is a no-op even with NULL arrays; scores may be NULL.
  if (kdt_tree_build(KDT_BACKEND_CPU, nullptr, 0, 2, 2, 4, nullptr, nullptr, nullptr, nullptr,
                     nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr))
    return std::string("bs = 0 failed: ") + kdt_last_error();
  if (kdt_tree_build(KDT_BACKEND_CPU, nullptr, 1, 2, 2, 4, in.lp.data(), in.ids.data(),
                     in.root.data(), in.seq.data(), o.tokens.data(), o.parents.data(),
                     o.depths.data(), o.positions.data(), o.first_child.data(),
                     o.next_sibling.data(), o.visibility.data(), o.num_nodes.data(), nullptr))
    return std::string("scores = NULL failed: ") + kdt_last_error();
  return "";
}

// The parallel build's layouts (tree::par::plan) on the two devices we target, L = 15, K = 64:
// 256 order buckets up to a pool of 512 entries (budgets up to 127), finer ones above where they
// fit, never at the cost of pool entries or a pool copy.
std::string plan_layouts() {
  namespace par = kdt::tree::par;
  struct Want { size_t limit; int budget, cap; bool twin; int nord; };
  const size_t h200 = 232448 - 1024, sm120 = 100352;  // opt-in bytes less the static kilobyte
  const Want wants[] = {{h200, 63, 512, true, 256},      {h200, 255, 1024, true, 1024},
                        {sm120, 63, 512, true, 256},     {h200, 511, 2048, true, 1024},
                        {h200, 127, 512, true, 256},     {h200, 128, 768, true, 1024},
                        {h200, 1023, 3072, true, 4096},  {h200, 1024, 3072, true, 4096},
                        {sm120, 767, 1536, true, 1024},  {sm120, 1023, 2304, false, 1024},
                        {sm120, 1024, 2304, false, 1024}};
  for (const Want& w : wants) {
    par::Plan p{};
    const std::string at = "plan(budget " + std::to_string(w.budget) + ", " +
                           std::to_string(w.limit) + " bytes)";
    if (!par::plan(w.budget, 15, 64, w.limit, &p)) return at + ": no layout";
    if (p.cap != w.cap || p.twin != w.twin || p.nord != w.nord || p.bytes > w.limit ||
        !p.staged)
      return at + ": cap " + std::to_string(p.cap) + " twin " + std::to_string(p.twin) +
             " nord " + std::to_string(p.nord) + " staged " + std::to_string(p.staged) +
             ", expected cap " + std::to_string(w.cap) + " twin " + std::to_string(w.twin) +
             " nord " + std::to_string(w.nord) + " staged 1";
  }
  return "";
}

// A random multiple of 2^g in (-2^(g + bits), 0], as a double (exact for bits <= 53).
double grid_value(std::mt19937_64& rng, int g, int bits) {
  const int64_t m = (int64_t)(rng() >> (64 - bits));
  return -std::ldexp((double)m, g);
}

// tree::par::Bins on exact inputs: scores and bounds are multiples of 2^g spanning up to 2^48
// of them (g from the smallest float's lowest bit to large exponents). Every score in [lo, hi]
// falls in a bin b with edge(b) < s <= edge(b + 1), the bin the exact integer arithmetic gives,
// and the edges are exact multiples of the width.
std::string bins_exact(uint64_t seed) {
  namespace par = kdt::tree::par;
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 4000; ++trial) {
    const int g = -149 + (int)(rng() % 260), bits = 1 + (int)(rng() % 48), m = (int)(rng() % 13);
    double lo = grid_value(rng, g, bits), hi = grid_value(rng, g, bits);
    if (lo > hi) std::swap(lo, hi);
    par::Bins B;
    const std::string at = "g " + std::to_string(g) + " bits " + std::to_string(bits) + " m " +
                           std::to_string(m) + " trial " + std::to_string(trial);
    if (!par::make_bins(lo, hi, m, g, B)) {
      if (hi > lo) return at + ": make_bins refused hi > lo";
      continue;
    }
    if (B.nb != 1 << m || !(B.w >= std::ldexp(1.0, g)) || !(B.w * B.nb > hi - lo))
      return at + ": width " + std::to_string(B.w) + " for nb " + std::to_string(B.nb);
    const int64_t H = (int64_t)std::ldexp(-hi, -g), W = (int64_t)std::ldexp(B.w, -g);
    const uint64_t span = (uint64_t)std::ldexp(hi - lo, -g) + 1;  // grid points in [lo, hi]
    for (int k = 0; k < 50; ++k) {
      double s = k == 0 ? lo : k == 1 ? hi : lo + std::ldexp((double)(rng() % span), g);
      if (k >= 2 && W > 1 && rng() % 2) {  // on an edge: hi - j w
        const int64_t j = (int64_t)(rng() % (uint64_t)B.nb);
        s = hi - (double)j * B.w;
        if (s < lo) continue;
      }
      const int b = B.of(s);
      const int64_t S = (int64_t)std::ldexp(-s, -g);
      const int want = B.nb - 1 - (int)((S - H) / W);
      if (b != want || !(B.edge(b) < s && s <= B.edge(b + 1)))
        return at + ": score " + std::to_string(s) + " in bin " + std::to_string(b) + ", want " +
               std::to_string(want);
      if (std::ldexp(hi - B.edge(b), -g) != (double)((int64_t)(B.nb - b) * W))
        return at + ": edge " + std::to_string(b) + " is not hi - (nb - b) w";
    }
  }
  return "";
}

// count_at_least and, up to K = 64, count_at_least64 (float searches against the smallest float
// at or above t - s; the latter also where no rank passes) against the
// float64 count s + row[r] >= t, on exact inputs with ties and on rows of every magnitude.
std::string count_exact(uint64_t seed) {
  namespace par = kdt::tree::par;
  std::mt19937_64 rng(seed + 1);
  for (int trial = 0; trial < 20000; ++trial) {
    const int g = -149 + (int)(rng() % 250), K = 1 + (int)(rng() % 70);
    std::vector<float> row(K);
    // Up to 32 bits: above 24 a float keeps the multiples of 2^g, and t - s between two floats
    // (below) tells a rounding-up conversion from a rounding-to-nearest one.
    const int top = std::min(32, 127 - g);  // finite floats
    for (float& x : row) x = (float)grid_value(rng, g, 1 + (int)(rng() % top));
    if (rng() % 3 == 0)
      for (int r = 1; r < K; ++r)
        if (rng() % 2) row[r] = row[r - 1];  // ties
    std::sort(row.begin(), row.end(), std::greater<float>());
    const double s = grid_value(rng, g, 1 + (int)(rng() % 40));
    double t = s + (double)row[rng() % K];  // a threshold some ranks meet exactly
    const double step = std::ldexp(1.0, g) * (double)(1 + rng() % 64);
    if (rng() % 3 == 1) t -= step;
    if (rng() % 3 == 2) t += step;  // just above a rank's score
    int want = 0;
    while (want < K && s + (double)row[want] >= t) ++want;
    if (want == 0) {  // count_at_least needs one rank at least; count_at_least64 does not
      if (K <= 64 && par::count_at_least64(row.data(), K, s, t) != 0)
        return "g " + std::to_string(g) + " K " + std::to_string(K) + " trial " +
               std::to_string(trial) + ": count_at_least64 counted ranks below t";
      continue;
    }
    const int got = par::count_at_least(row.data(), K, s, t);
    const int got64 = K <= 64 ? par::count_at_least64(row.data(), K, s, t) : want;
    if (got != want || got64 != want)
      return "g " + std::to_string(g) + " K " + std::to_string(K) + " trial " +
             std::to_string(trial) + ": counted " + std::to_string(got) + " (count_at_least64 " +
             std::to_string(got64) + "), want " + std::to_string(want);
  }
  return "";
}

// div_by against the division on its whole stated domain (n < 2^12, n d < 2^20), and the
// build's uses of it inside that domain for every budget, depth, K and thread count: the family's
// thread indices t < T over L and the grid side g - 1, its extensions' j < next E over next and
// x < next over h (tree::par::consts).
std::string div_exact() {
  namespace par = kdt::tree::par;
  for (int d = 1; d < (1 << 20); ++d) {
    const uint32_t m = par::div_magic(d);
    for (int n = 0; n < 4096 && (int64_t)n * d < (1 << 20); ++n)
      if (par::div_by(n, m) != n / d)
        return "div_by(" + std::to_string(n) + ", div_magic(" + std::to_string(d) + ")) = " +
               std::to_string(par::div_by(n, m)) + ", want " + std::to_string(n / d);
  }
  auto fits = [](int64_t n, int64_t d) { return n < 4096 && n * d < (1 << 20); };
  for (int budget = 1; budget <= kdt::tree::kMaxBudget; ++budget)
    for (int L = 1; L <= kdt::tree::kMaxDepth; ++L)
      for (int K : {1, 2, 3, 16, 64, 1000, 1024, 5000})
        for (int T : {32, 256, 1024}) {
          const par::Consts c = par::consts(budget, L, K, T, par::kOrderBins);
          const std::string at = "budget " + std::to_string(budget) + " L " + std::to_string(L) +
                                 " K " + std::to_string(K) + " T " + std::to_string(T);
          if (!fits(T - 1, L) || (c.g > 1 && !fits(T - 1, c.g - 1)))
            return at + ": a thread index over L or g - 1 leaves div_by's domain";
          if (c.next > 0 && (!fits(c.next * c.E - 1, c.next) || !fits(c.next - 1, c.h)))
            return at + ": an extension index leaves div_by's domain";
          if (c.ncube > 0 && (!fits(c.ncube - 1, c.q - 1) || !fits(c.q * c.q - 1, c.q)))
            return at + ": a cube index leaves div_by's domain";
        }
  return "";
}

// One request of budget K, L rows of K ranks 1/16 apart, except that flat log-prob p + 1 sits
// 1/32 above p (in the same row): the only rise. The reference pops rank p + 1 right after its
// generator p; a build that ranked by score alone would put it first, so the parallel build must
// decline the request. The staged CUDA kernel checks each log-prob against the next one as it
// stages them, a warp 32 P a round (P = 5 when that covers them in one round, else 8): the next
// value is a neighbour lane's, lane 0's next or an extra load by lane 31, so the rises sit at
// each kind of seam (31 | 32, 159 | 160, 255 | 256, 1022 | 1023) and between.
constexpr int kRises[] = {0,   1,   30,  31,  32,  63,  158, 159,  160,  254,  255,  256,
                          287, 319, 320, 479, 511, 767, 1022, 1119, 1279, 1280, 1530};
// (K, L) of the CUDA cases: 1024 log-probs at 512 threads and 300 at 256 (five a lane), 3 x 511
// at 256 (eight a lane).
constexpr int kRiseShapes[][2] = {{1024, 1}, {300, 1}, {511, 3}};
BuildIn one_rise(int p, int K, int L = 1) {
  const size_t n = (size_t)L * K;
  BuildIn in{1, L, K, K, std::vector<float>(n), std::vector<int64_t>(n), {5}, {9}};
  for (size_t i = 0; i < n; ++i) {
    in.lp[i] = -(float)(i % K + 1) / 16.0f;
    in.ids[i] = (int64_t)(i % K);
  }
  in.lp[p + 1] = in.lp[p] + 1.0f / 32.0f;
  return in;
}

}  // namespace

int main(int argc, char** argv) {
  Harness h(argc, argv);
  const std::string no_cuda = cuda_unavailable();
  h.run("worked_example/cpu", worked_example);
  h.run("invalid_arguments", invalid_arguments);
  h.run("plan_layouts", plan_layouts);
  h.run("bins_exact", [&] { return bins_exact(h.seed); });
  h.run("count_exact", [&] { return count_exact(h.seed); });
  h.run("div_exact", div_exact);
  if (!kdt_has_cuda()) {
    h.run("cuda_backend_unsupported_in_cpu_build", [] {
      BuildIn in{1, 1, 1, 1, {0.f}, {1}, {0}, {0}};
      BuildOut o;
      o.resize(1, 1);
      const kdt_status s = kdt_tree_build(KDT_BACKEND_CUDA, nullptr, 1, 1, 1, 1, in.lp.data(), in.ids.data(),
                                          in.root.data(), in.seq.data(), o.tokens.data(), o.parents.data(),
                                          o.depths.data(), o.positions.data(), o.first_child.data(),
                                          o.next_sibling.data(), o.visibility.data(), o.num_nodes.data(), nullptr);
      return s == KDT_ERR_UNSUPPORTED ? std::string() : "status " + std::to_string((int)s) + ", expected 2";
    });
  }

  for (const std::string& path : h.bundle_files("tree_build")) {
    BuildIn in;
    BuildOut ref;
    const std::string err = load_bundle(path, &in, &ref);
    h.run("bundle/" + stem(path) + "/cpu", [&] {
      if (!err.empty()) return err;
      BuildOut out;
      if (kdt_status s = build_cpu(in, &out)) return status_message(s, "kdt_tree_build(cpu)");
      return same_build(out, ref);
    });
    if (!no_cuda.empty()) { h.skip("bundle/" + stem(path) + "/cuda", no_cuda); continue; }
    h.run("bundle/" + stem(path) + "/cuda", [&] {
      if (!err.empty()) return err;
      BuildOut out;
      if (kdt_status s = build_cuda(in, &out)) return status_message(s, "kdt_tree_build(cuda)");
      return same_build(out, ref);
    });
  }

  // A rise anywhere in a row: the CPU emulation refuses it strictly, and CUDA's parallel build
  // (its check on the staged values) must give the serial build's tree.
  h.run("rise_anywhere/cpu_parallel_strict_declines", [&] {
    for (int p : kRises) {
      if (p + 1 >= 1024) continue;
      const BuildIn in = one_rise(p, 1024);
      BuildOut o;
      setenv("KDT_TREE_BUILD", "parallel-strict", 1);
      const kdt_status s = build_cpu(in, &o);
      unsetenv("KDT_TREE_BUILD");
      if (s != KDT_ERR_INTERNAL)
        return "rise at " + std::to_string(p) + ": status " + std::to_string((int)s) +
               ", expected the strict refusal (KDT_ERR_INTERNAL)";
    }
    return std::string();
  });
  if (!no_cuda.empty()) {
    h.skip("rise_anywhere/cuda_parallel_vs_serial", no_cuda);
  } else {
    h.run("rise_anywhere/cuda_parallel_vs_serial", [&] {
      for (int p : kRises) {
        for (const auto& shape : kRiseShapes) {
          const int K = shape[0], L = shape[1];
          if (p + 1 >= L * K || (p + 1) % K == 0) continue;  // p + 1 in p's row
          const BuildIn in = one_rise(p, K, L);
          BuildOut a, b;
          setenv("KDT_TREE_BUILD", "serial", 1);
          if (kdt_status s = build_cpu(in, &a)) return status_message(s, "kdt_tree_build(cpu)");
          setenv("KDT_TREE_BUILD", "parallel", 1);
          const kdt_status s = build_cuda(in, &b);
          unsetenv("KDT_TREE_BUILD");
          if (s) return status_message(s, "kdt_tree_build(cuda)");
          const std::string e = same_build(b, a);
          if (!e.empty())
            return "rise at " + std::to_string(p) + ", K " + std::to_string(K) + ", L " +
                   std::to_string(L) + ": " + e;
        }
      }
      return std::string();
    });
  }

  // Random CPU vs CUDA: awkward sizes, exact ties, the largest budget.
  const int grid[][4] = {{1, 1, 1, 1}, {3, 1, 7, 16}, {5, 4, 1, 9}, {12, 15, 8, 64},
                         {17, 15, 16, 37}, {4, 32, 3, 100}, {33, 15, 64, 255}, {3, 15, 1024, 1024},
                         {2, 32, 1024, 1024}};
  // KDT_TREE_BUILD picks the algorithm per call: the CPU reference runs the serial heap; the
  // CPU emulations of the parallel and warp builds and every CUDA mode must equal it.
  std::mt19937_64 rng(h.seed);
  for (const auto& g : grid) {
    const std::string shape = "bs" + std::to_string(g[0]) + "_L" + std::to_string(g[1]) + "_K" +
                              std::to_string(g[2]) + "_B" + std::to_string(g[3]);
    for (const char* emu : {"parallel", "warp"}) {
      h.run(std::string("random_cpu_") + emu + "_vs_serial/" + shape, [&] {
        for (int ties = 0; ties < 2; ++ties) {
          const BuildIn in = random_build(rng, g[0], g[1], g[2], g[3], ties != 0);
          BuildOut a, b;
          setenv("KDT_TREE_BUILD", "serial", 1);
          if (kdt_status s = build_cpu(in, &a)) return status_message(s, "kdt_tree_build(cpu serial)");
          setenv("KDT_TREE_BUILD", emu, 1);
          const kdt_status s = build_cpu(in, &b);
          unsetenv("KDT_TREE_BUILD");
          if (s) return status_message(s, "kdt_tree_build(cpu emulation)");
          const std::string e = same_build(b, a);
          if (!e.empty()) return std::string(ties ? "ties: " : "no ties: ") + e;
        }
        return std::string();
      });
    }
    for (const char* mode : {"auto", "warp", "parallel", "serial"}) {
      const std::string name = std::string("random_cpu_vs_cuda_") + mode + "/" + shape;
      if (!no_cuda.empty()) { h.skip(name, no_cuda); continue; }
      h.run(name, [&] {
        for (int ties = 0; ties < 2; ++ties) {
          const BuildIn in = random_build(rng, g[0], g[1], g[2], g[3], ties != 0);
          BuildOut a, b;
          setenv("KDT_TREE_BUILD", "serial", 1);
          if (kdt_status s = build_cpu(in, &a)) return status_message(s, "kdt_tree_build(cpu)");
          setenv("KDT_TREE_BUILD", mode, 1);
          const kdt_status s = build_cuda(in, &b);
          unsetenv("KDT_TREE_BUILD");
          if (s) return status_message(s, "kdt_tree_build(cuda)");
          const std::string e = same_build(b, a);
          if (!e.empty()) return std::string(ties ? "ties: " : "no ties: ") + e;
        }
        return std::string();
      });
    }
  }
  return h.finish();
}
