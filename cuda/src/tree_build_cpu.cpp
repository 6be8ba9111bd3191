// tree_build_cpu.cpp: the kdt_tree_build entry point (validation, dispatch) and its CPU backend.
// The algorithm lives in tree_build_core.h, shared with the CUDA kernels (tree_build_serial.cu).
//
// KDT_TREE_BUILD (read per call) picks the algorithm: "serial" (the default here: the binary
// heap, the fastest on one CPU core), "warp": the CUDA kernel's one-warp best-first build
// (tree_build_warp.h) emulated lane by lane (budget 1024, above tree::wrp::kMaxBudget, runs the
// parallel build, as on CUDA), or "parallel": the CUDA kernel's block-synchronous
// algorithm (tree_build_parallel.h) emulated thread by thread, with KDT_TREE_BUILD_THREADS
// threads (default: the CUDA launch's count), so that it is tested without a GPU. A request
// the parallel algorithm declines (tree_build_parallel.h) falls back to the heap, as on CUDA;
// "parallel-strict" reports it as KDT_ERR_INTERNAL instead (tests use it to prove the parallel
// path ran). KDT_TREE_BUILD_SMEM (bytes per block) emulates a device with that much shared
// memory: the parallel build takes the layout the CUDA launch would (tree::par::plan; e.g.
// 100352 for sm_120: one pool copy at budget 1023).
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "tree_build_core.h"
#include "tree_build_parallel.h"
#include "tree_build_warp.h"
#include "tree_kernels.h"

namespace kdt {
namespace {

// The CPU stand-in for a CTA (tree_build_parallel.h's Block): each phase runs for thread 0, 1,
// ..., T - 1 in turn; the collectives run serially (tree_build_gpu_block.cuh's GpuBlock has the
// parallel ones). Compiled by nvcc too (host code), hence KDT_HD and the guards.
struct CpuBlock {
  int T;
  KDT_HD int threads() const { return T; }
  KDT_HD void mark(int) {}
  KDT_HD void chain_sums(const float* lp, int L, int K, int kc, double* chain,
                         unsigned long long* fmin) {
    double c = 0.0;
    unsigned long long lo = ~0ull;
    chain[0] = 0.0;
    for (int d = 0; d < L; ++d) {
      const unsigned long long u = tree::par::ordered(c + (double)lp[(size_t)d * K + kc - 1]);
      if (u < lo) lo = u;
      c += (double)lp[(size_t)d * K];
      chain[d + 1] = c;
    }
    *fmin = lo;
  }
  template <class F>
  KDT_HD int offsets(int m, int* off, uint16_t* lens, F len) {
    int s = 0;
#if !defined(__CUDA_ARCH__)
    for (int q = 0; q < m; ++q) {
      const int n = len(q);
      off[q] = s;
      lens[q] = (uint16_t)n;
      s += n;
    }
#endif
    return s;
  }
  template <class F>
  KDT_HD void run(F f) {
#if !defined(__CUDA_ARCH__)
    for (int t = 0; t < T; ++t) f(t);
#endif
  }
  // count_at_least64 for a run of the rank-0 chain (0 when not live).
  KDT_HD int count_run(bool live, const float* row, int kc, double s, double t) {
    return live ? tree::par::count_at_least64(row, kc, s, t) : 0;
  }
  // The queue in order: entry i expanded after entries 1 .. i - 1 (a breadth-first order; the
  // CUDA block's order depends on its schedule, and the build does not depend on it).
  // An entry the queue wrote that live calls childless is not expanded (the CUDA block
  // skips a batch only when every entry in it is such; an unsound live drops nodes here).
  template <class Probe, class ParentOf, class Put, class Live>
  KDT_HD int expand(unsigned*, uint32_t* cand, int*, int n0, int cap, int kc, Probe probe,
                    ParentOf parent, Put put, Live live) {
    int a = n0;
#if !defined(__CUDA_ARCH__)
    for (int i = 1; i < a; ++i) {
      const auto p = parent(i);
      const bool expand = i < n0 || live(tree::par::Child{cand[i], p.score});
      const int c = expand ? tree::par::probe_len(probe, i, kc) : 0;
      if (a + c > cap) return -1;
      for (int r = 0; r < c; ++r) cand[a + r] = put(p, i, a + r, r).cand;
      a += c;
    }
#endif
    return a;
  }
  KDT_HD int scan(int* a, int m) {
#if !defined(__CUDA_ARCH__)
    int s = 0;
    for (int i = 0; i < m; ++i) { const int v = a[i]; a[i] = s; s += v; }
    return s;
#else
    return 0;
#endif
  }
  KDT_HD int suffix_pick(const int* hist, int nb, int need, int* got) {
    *got = 0;
#if !defined(__CUDA_ARCH__)
    int s = 0;
    for (int j = nb - 1; j >= 0; --j) {
      s += hist[j];
      if (s >= need) { *got = s; return j; }
    }
#endif
    return -1;
  }
};

enum class Algo { kSerial, kParallel, kStrict, kWarp };

Algo algo_from_env() {
  const char* v = std::getenv("KDT_TREE_BUILD");
  if (!v || !*v || std::strcmp(v, "serial") == 0) return Algo::kSerial;
  if (std::strcmp(v, "parallel") == 0) return Algo::kParallel;
  if (std::strcmp(v, "parallel-strict") == 0) return Algo::kStrict;
  if (std::strcmp(v, "warp") == 0) return Algo::kWarp;
  return Algo::kSerial;
}

// The one-warp build (tree_build_warp.h) emulated lane by lane, S slots per lane.
template <int S>
int warp_build(const float* lp, int L, int K, int budget, const tree::Scratch& s,
               const tree::wrp::WarpNodes& N) {
  tree::wrp::CpuWarp<S> w;
  return tree::wrp::build<S>(w, lp, L, K, budget, s.key_bits, s.key_depth, N);
}

int warp_build_any(const float* lp, int L, int K, int budget, const tree::Scratch& s,
                   const tree::wrp::WarpNodes& N) {
  switch (tree::wrp::slots_for(budget)) {
    case 1: return warp_build<1>(lp, L, K, budget, s, N);
    case 2: return warp_build<2>(lp, L, K, budget, s, N);
    case 4: return warp_build<4>(lp, L, K, budget, s, N);
    case 8: return warp_build<8>(lp, L, K, budget, s, N);
    case 16: return warp_build<16>(lp, L, K, budget, s, N);
    default: return warp_build<32>(lp, L, K, budget, s, N);
  }
}

// The parallel algorithm's pool and scratch for one request at a time: the layout the CUDA
// launch would pick (tree::par::plan) under KDT_TREE_BUILD_SMEM bytes of shared memory per
// block when that is set (e.g. 100352: sm_120's), else two copies at pool_capacity.
struct ParallelScratch {
  int cap, T;
  bool twin;
  std::vector<double> score0, score1, chain, bscore;
  std::vector<uint32_t> cand0, cand1, bcand;
  std::vector<uint64_t> key0, key1, bkey;
  std::vector<int> cnt, hist, bto;
  std::vector<uint16_t> srt, order;
  std::vector<int16_t> inv;
  tree::par::Arrays A;
  tree::par::Shared S;
  tree::par::Consts C;

  ParallelScratch(int L, int K, int budget, int threads, const tree::par::Plan& p)
      : cap(p.cap), T(threads), twin(p.twin), score0(cap), score1(twin ? cap : 0), chain(L + 1),
        bscore(twin ? 0 : tree::par::kCompactBuf), cand0(cap), cand1(twin ? cap : 0),
        bcand(bscore.size()), key0(cap), key1(twin ? cap : 0), bkey(bscore.size()), cnt(cap),
        hist(p.nord), bto(bscore.size()), srt(cap), order(cap), inv(cap),
        C(tree::par::consts(budget, L, K, threads, p.nord)) {
    A = tree::par::Arrays{{score0.data(), cand0.data(), key0.data()},
                          {score1.data(), cand1.data(), key1.data()},
                          twin,
                          {bscore.data(), bcand.data(), bkey.data()},
                          bto.data(),
                          (int)bscore.size(),
                          cnt.data(),
                          srt.data(),
                          order.data(),
                          inv.data(),
                          hist.data(),
                          chain.data(),
                          C.key_bits,
                          C.key_depth,
                          p.nord};
  }
};

// The layout (see ParallelScratch); false when KDT_TREE_BUILD_SMEM fits none (the CUDA launch
// then runs the serial kernel: here the heap).
bool plan_from_env(int budget, int L, int K, tree::par::Plan* p) {
  if (const size_t x = tree::par::smem_from_env()) return tree::par::plan(budget, L, K, x, p);
  const int cap = tree::par::pool_capacity(budget);
  *p = tree::par::Plan{cap, true, true, tree::par::order_bins(cap), 0};
  return true;
}

}  // namespace

kdt_status tree_build_cpu(const TreeBuildArgs& a) {
  static const char* fn = "kdt_tree_build";
  const int n = a.budget + 1, W = (n + 31) / 32;
  const Algo algo = algo_from_env();
  std::vector<double> heap_score(n), node_score(n);
  std::vector<uint32_t> heap_cand(n), node_cand(n);
  std::vector<int16_t> first_child(n), next_sibling(n);
  std::vector<uint64_t> node_key(n);
  tree::Scratch s{heap_score.data(), heap_cand.data(),    node_score.data(), node_cand.data(),
                  first_child.data(), next_sibling.data(), node_key.data(),   0, 0};
  tree::set_key_layout(s, a.L, a.K);
  // "warp" takes budgets up to tree::wrp::kMaxBudget; larger ones run the parallel build, as on
  // CUDA.
  const bool warp = algo == Algo::kWarp && a.budget <= tree::wrp::kMaxBudget;
  // The warp build also makes the visibility rows up to tree::wrp::kMaskMaxBudget.
  std::vector<uint64_t> masks(warp && a.budget <= tree::wrp::kMaskMaxBudget ? n : 0);
  std::vector<ParallelScratch> ps;
  tree::par::Plan plan{};
  if (algo != Algo::kSerial && !warp) {
    if (plan_from_env(a.budget, a.L, a.K, &plan))
      ps.emplace_back(a.L, a.K, a.budget, tree::par::threads_from_env(a.budget), plan);
    else if (algo == Algo::kStrict)
      return set_error(KDT_ERR_INTERNAL, fn,
                       "KDT_TREE_BUILD_SMEM=%s bytes fit no layout of the parallel build at "
                       "budget %d; KDT_TREE_BUILD=parallel-strict refuses the serial fallback",
                       std::getenv("KDT_TREE_BUILD_SMEM"), a.budget);
  }
  const tree::par::Nodes nodes{node_score.data(), node_cand.data(), first_child.data(),
                               next_sibling.data()};
  for (int b = 0; b < a.bs; ++b) {
    const size_t lk = (size_t)a.L * a.K;
    const float* lp = a.top_logp + b * lk;
    const int64_t* ids = a.top_ids + b * lk;
    int used = -1;
    if (warp) {
      used = warp_build_any(lp, a.L, a.K, a.budget, s,
                            {node_score.data(), node_cand.data(), first_child.data(),
                             next_sibling.data(), masks.empty() ? nullptr : masks.data()});
    } else if (!ps.empty()) {
      CpuBlock blk{ps[0].T};
      tree::par::init(ps[0].S);
      used = tree::par::build(blk, ps[0].S, ps[0].A, nodes, lp, a.L, a.K, a.budget, ps[0].cap,
                              ps[0].C);
      if (used < 0 && algo == Algo::kStrict)
        return set_error(KDT_ERR_INTERNAL, fn,
                         "request %d: the parallel build declined it (%s); "
                         "KDT_TREE_BUILD=parallel-strict refuses the serial fallback",
                         b, (ps[0].S.flags & tree::par::kAnomaly)
                                ? "a positive log-prob or an unsorted row: a score above its generator"
                                : (ps[0].S.flags & tree::par::kInexact)
                                      ? "non-finite log-probs or mixed magnitudes whose float64 sums may round"
                                      : "pool overflow");
    }
    if (used < 0) used = tree::build_one(lp, a.L, a.K, a.budget, s);
    const size_t o = (size_t)b * n;
    for (int i = 0; i < n; ++i)
      write_tree_slot(a, o, i, used, a.root_ids[b], a.seq_lens[b], node_cand.data(),
                      node_score.data(), first_child.data(), next_sibling.data(), ids);
    // Row i = its parent's row plus bit i (parents come first): one row copy per node. The
    // CUDA kernels walk each row's ancestors instead (tree_build_device.cuh,
    // write_visibility_rows).
    uint32_t* vis = a.visibility + (size_t)b * n * W;
    std::memset(vis, 0, sizeof(uint32_t) * (size_t)n * W);
    if (warp && !masks.empty()) {  // the rows the warp build made with the tree (as on CUDA)
      for (int i = 0; i < used; ++i)
        for (int w = 0; w < W; ++w) vis[(size_t)i * W + w] = (uint32_t)(masks[i] >> (32 * w));
      a.num_nodes[b] = used;
      continue;
    }
    vis[0] = 1u;
    for (int i = 1; i < used; ++i) {
      const int p = tree::cand_parent(node_cand[i]);
      std::memcpy(vis + (size_t)i * W, vis + (size_t)p * W, sizeof(uint32_t) * (size_t)(p / 32 + 1));
      vis[(size_t)i * W + i / 32] |= 1u << (i % 32);
    }
    a.num_nodes[b] = used;
  }
  return KDT_OK;
}

}  // namespace kdt

extern "C" kdt_status kdt_tree_build(kdt_backend backend, void* stream, int32_t bs, int32_t L,
                                     int32_t K, int32_t budget, const float* top_logp,
                                     const int64_t* top_ids, const int64_t* root_ids,
                                     const int64_t* seq_lens, int64_t* tokens, int32_t* parents,
                                     int32_t* depths, int64_t* positions, int64_t* first_child,
                                     int64_t* next_sibling, uint32_t* visibility,
                                     int32_t* num_nodes, double* scores) {
  static const char* fn = "kdt_tree_build";
  kdt::clear_error();
  KDT_CHECK_ARG(backend == KDT_BACKEND_CPU || backend == KDT_BACKEND_CUDA, fn,
                "backend=%d is not KDT_BACKEND_CPU (0) or KDT_BACKEND_CUDA (1)", (int)backend);
  KDT_CHECK_ARG(bs >= 0, fn, "bs=%d must be >= 0", bs);
  KDT_CHECK_ARG(budget >= 1 && budget <= kdt::tree::kMaxBudget, fn,
                "budget=%d must be in [1, %d]", budget, kdt::tree::kMaxBudget);
  KDT_CHECK_ARG(L >= 1 && L <= kdt::tree::kMaxDepth, fn, "L=%d must be in [1, %d]", L,
                kdt::tree::kMaxDepth);
  KDT_CHECK_ARG(K >= 1 && K <= budget, fn, "K=%d must be in [1, budget=%d]", K, budget);
  if (bs == 0) return KDT_OK;
  KDT_CHECK_PTR(top_logp, fn);
  KDT_CHECK_PTR(top_ids, fn);
  KDT_CHECK_PTR(root_ids, fn);
  KDT_CHECK_PTR(seq_lens, fn);
  KDT_CHECK_PTR(tokens, fn);
  KDT_CHECK_PTR(parents, fn);
  KDT_CHECK_PTR(depths, fn);
  KDT_CHECK_PTR(positions, fn);
  KDT_CHECK_PTR(first_child, fn);
  KDT_CHECK_PTR(next_sibling, fn);
  KDT_CHECK_PTR(visibility, fn);
  KDT_CHECK_PTR(num_nodes, fn);
  const kdt::TreeBuildArgs args{bs,       L,         K,          budget,      top_logp,
                                top_ids,  root_ids,  seq_lens,   tokens,      parents,
                                depths,   positions, first_child, next_sibling, visibility,
                                num_nodes, scores};
  if (backend == KDT_BACKEND_CPU) return kdt::tree_build_cpu(args);
#if defined(KDT_WITH_CUDA)
  return kdt::tree_build_cuda(args, stream);
#else
  (void)stream;
  return kdt::cuda_unsupported(fn);
#endif
}
