// kdt_bench: times the tree kernels (kdt_tree_build, kdt_tree_accept) on random inputs with
// exact ties, per backend, and prints a table. Every configuration is validated first (CUDA
// output == CPU output, bit for bit) and timed only if it matches.
//
//   kdt_bench [--backend cpu|cuda|all] [--reps N] [--quick] [--seed S]
//
// CPU: steady_clock around each call. CUDA: the program links only libkdtree (no cudart, so no
// events): each sample is `reps_per_sample` back-to-back launches then kdt_device_synchronize,
// divided by the launch count; that is launch + kernel time, including the enqueue cost
// (ARCHITECTURE.md: ~4 us per launch on the H200). Use the Python bench (bench/kernels.py)
// for event-timed numbers.
#include <algorithm>
#include <array>
#include <chrono>

#include "_tree_io.hpp"

using namespace kdt_test;
using Clock = std::chrono::steady_clock;

namespace {

struct Stats { double median, min, p90; };

Stats summarize(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  return {s[s.size() / 2], s.front(), s[std::min(s.size() - 1, (size_t)(0.9 * (double)s.size()))]};
}

// Random accept inputs on a built tree: targets follow a random path (the long walks).
AcceptIn accept_inputs(const BuildIn& in, const BuildOut& t, std::mt19937_64& rng) {
  AcceptIn a;
  a.bs = in.bs;
  a.n = in.budget + 1;
  a.tokens = t.tokens; a.first_child = t.first_child; a.next_sibling = t.next_sibling;
  a.num_nodes = t.num_nodes;
  a.target.assign((size_t)a.bs * a.n, -7);
  for (int b = 0; b < a.bs; ++b) {
    const size_t o = (size_t)b * a.n;
    int64_t cur = 0;
    while (t.first_child[o + cur] != -1) {
      std::vector<int64_t> kids;
      for (int64_t c = t.first_child[o + cur]; c != -1; c = t.next_sibling[o + c]) kids.push_back(c);
      const int64_t pick = kids[rng() % kids.size()];
      a.target[o + cur] = t.tokens[o + pick];
      cur = pick;
    }
  }
  return a;
}

struct DeviceBuild {
  DeviceArray<float> lp; DeviceArray<int64_t> ids, root, seq, tok, pos, fc, ns;
  DeviceArray<int32_t> par, dep, nn; DeviceArray<uint32_t> vis; DeviceArray<double> sc;
  const BuildIn& in;
  explicit DeviceBuild(const BuildIn& i, const BuildOut& o)
      : lp(i.lp), ids(i.ids), root(i.root), seq(i.seq), tok(o.tokens.size()), pos(o.positions.size()),
        fc(o.first_child.size()), ns(o.next_sibling.size()), par(o.parents.size()), dep(o.depths.size()),
        nn(o.num_nodes.size()), vis(o.visibility.size()), sc(o.scores.size()), in(i) {}
  kdt_status launch() {
    return kdt_tree_build(KDT_BACKEND_CUDA, nullptr, in.bs, in.L, in.K, in.budget, lp.get(), ids.get(),
                          root.get(), seq.get(), tok.get(), par.get(), dep.get(), pos.get(), fc.get(),
                          ns.get(), vis.get(), nn.get(), sc.get());
  }
};

struct DeviceAccept {
  DeviceArray<int64_t> tok, fc, ns, tgt, bonus; DeviceArray<int32_t> nn, idx, len, st;
  const AcceptIn& in;
  explicit DeviceAccept(const AcceptIn& a)
      : tok(a.tokens), fc(a.first_child), ns(a.next_sibling), tgt(a.target), bonus((size_t)a.bs),
        nn(a.num_nodes), idx((size_t)a.bs * a.n), len((size_t)a.bs), st((size_t)a.bs), in(a) {}
  kdt_status launch() {
    return kdt_tree_accept(KDT_BACKEND_CUDA, nullptr, in.bs, in.n, tok.get(), fc.get(), ns.get(), nn.get(),
                           tgt.get(), idx.get(), len.get(), bonus.get(), st.get());
  }
};

template <class F>
std::vector<double> time_cpu(F fn, int reps) {
  std::vector<double> s;
  fn();  // warm-up
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    fn();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return s;
}

template <class F>
std::vector<double> time_cuda(F launch, int reps) {
  const int per = 20;
  std::vector<double> s;
  for (int w = 0; w < per; ++w) launch();
  kdt_device_synchronize();
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    for (int k = 0; k < per; ++k) launch();
    kdt_device_synchronize();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / per);
  }
  return s;
}

void row(const char* kernel, const char* backend, const BuildIn& in, const Stats& st) {
  const double nodes = (double)in.bs * in.budget;
  std::printf("%-7s %-5s %4d %3d %5d %6d %11.2f %11.2f %11.2f %10.1f\n", kernel, backend, in.bs, in.L,
              in.K, in.budget, st.median * 1e6, st.min * 1e6, st.p90 * 1e6, st.median * 1e9 / nodes);
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend = "all";
  int reps = 50;
  bool quick = false;
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) backend = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--quick") quick = true;
    else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else { std::fprintf(stderr, "error: kdt_bench: unknown argument '%s' (--backend cpu|cuda|all, --reps N, --quick, --seed S)\n", a.c_str()); return 5; }
  }
  if (backend != "cpu" && backend != "cuda" && backend != "all") {
    std::fprintf(stderr, "error: kdt_bench: --backend %s is not cpu, cuda or all\n", backend.c_str());
    return 5;
  }
  const bool want_cuda = backend != "cpu", want_cpu = backend != "cuda";
  const std::string no_cuda = cuda_unavailable();
  if (want_cuda && !no_cuda.empty()) std::printf("note: %s\n", no_cuda.c_str());
  const bool run_cuda = want_cuda && no_cuda.empty();
  const char* variant = std::getenv("KDT_TREE_BUILD_VARIANT");
  std::printf("kdt_bench: libkdtree %s, seed %llu, %d samples per row, CUDA build variant %s\n",
              kdt_version(), (unsigned long long)seed, reps, variant ? variant : "warp (default)");
  std::printf("%-7s %-5s %4s %3s %5s %6s %11s %11s %11s %10s\n", "kernel", "dev", "bs", "L", "K", "budget",
              "median_us", "min_us", "p90_us", "ns/node");
  std::vector<std::array<int, 4>> grid = {{1, 15, 16, 16}, {1, 15, 64, 64}, {1, 15, 256, 256},
                                          {1, 15, 512, 512}, {1, 15, 1024, 1024}, {8, 15, 64, 64},
                                          {32, 15, 64, 64}, {64, 15, 256, 256}};
  if (quick) grid.resize(3);
  std::mt19937_64 rng(seed);
  int failures = 0;
  for (const auto& g : grid) {
    const BuildIn in = random_build(rng, g[0], g[1], g[2], g[3], true);
    BuildOut ref;
    if (kdt_status s = build_cpu(in, &ref)) { std::fprintf(stderr, "%s\n", status_message(s, "build").c_str()); return 1; }
    const AcceptIn acc = accept_inputs(in, ref, rng);
    AcceptOut acc_ref;
    accept_cpu(acc, &acc_ref);
    if (run_cuda) {  // validate before timing
      BuildOut got;
      AcceptOut got_acc;
      std::string e = build_cuda(in, &got) ? kdt_last_error() : same_build(got, ref);
      if (e.empty()) e = accept_cuda(acc, &got_acc) ? kdt_last_error() : same_accept(got_acc, acc_ref);
      if (!e.empty()) { std::printf("VALIDATION FAILED bs=%d B=%d: %s\n", in.bs, in.budget, e.c_str()); ++failures; continue; }
    }
    if (want_cpu) {
      BuildOut o;
      row("build", "cpu", in, summarize(time_cpu([&] { build_cpu(in, &o); }, reps)));
      AcceptOut ao;
      row("accept", "cpu", in, summarize(time_cpu([&] { accept_cpu(acc, &ao); }, reps)));
    }
    if (run_cuda) {
      DeviceBuild db(in, ref);
      row("build", "cuda", in, summarize(time_cuda([&] { db.launch(); }, reps)));
      DeviceAccept da(acc);
      row("accept", "cuda", in, summarize(time_cuda([&] { da.launch(); }, reps)));
    }
  }
  return failures ? 1 : 0;
}
