// test_tree_accept: kdt_tree_accept against the reference's KDTR bundles (bit-exact, CPU and,
// when a GPU is present, CUDA), hand-made malformed trees (each defect, never a hang), argument
// validation, and random malformed trees CPU vs CUDA. Every case runs every algorithm
// (KDT_TREE_ACCEPT walk and parallel, on both backends; the CPU reference of the random cases is
// the walk).
//   test_tree_accept --bundles DIR [--seed S]
#include <cstdlib>

#include "_tree_io.hpp"

using namespace kdt_test;

namespace {

std::string load_bundle(const std::string& path, AcceptIn* in, AcceptOut* ref) {
  kdt::SafetensorsFile f;
  if (f.open(path) != KDT_OK || f.check_kdtr("tree_accept") != KDT_OK) return f.error();
  // Every tensor against the case (bs, n) and each other, before anything is read: the kernel
  // trusts that each link array and the targets hold bs * n entries.
  using kdt::DType;
  BundleShapes s(f);
  if (!(s.param("bs", 0, 1 << 20) && s.param("n", 1, 1 << 20)))
    return s.err;
  for (const char* name : {"tokens", "first_child", "next_sibling", "target_argmax"})
    if (!s.tensor(name, DType::I64, {"bs", "n"})) return s.err;
  if (!(s.tensor("num_nodes", DType::I32, {"bs"}) && s.tensor("expected.accept_index", DType::I32, {"bs", "n"}) &&
        s.tensor("expected.accept_len", DType::I32, {"bs"}) && s.tensor("expected.bonus", DType::I64, {"bs"}) &&
        s.tensor("expected.status", DType::I32, {"bs"})))
    return s.err;
  in->bs = (int)s["bs"];
  in->n = (int)s["n"];
  for (const std::string& e :
       {read(f, "tokens", DType::I64, &in->tokens), read(f, "first_child", DType::I64, &in->first_child),
        read(f, "next_sibling", DType::I64, &in->next_sibling),
        read(f, "num_nodes", DType::I32, &in->num_nodes),
        read(f, "target_argmax", DType::I64, &in->target),
        read(f, "expected.accept_index", DType::I32, &ref->accept_index),
        read(f, "expected.accept_len", DType::I32, &ref->accept_len),
        read(f, "expected.bonus", DType::I64, &ref->bonus),
        read(f, "expected.status", DType::I32, &ref->status)})
    if (!e.empty()) return e;
  return "";
}

// Four requests of n = 4, one defect each (DDTREE.md section 4): a self-loop sibling list, a
// child cycle whose tokens always match (the walk would never end), an out-of-range first
// child, two matching siblings.
AcceptIn handmade() {
  AcceptIn in;
  in.bs = 4;
  in.n = 4;
  in.tokens = {0, 5, 5, 5, 0, 5, 5, 5, 0, 5, 5, 5, 0, 5, 5, 5};
  in.first_child = {1, -1, -1, -1, 1, 1, -1, -1, 4, -1, -1, -1, 1, -1, -1, -1};
  in.next_sibling = {-1, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, -1, -1};
  in.target = {9, 9, 9, 9, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5};
  return in;
}

std::string check_handmade(const AcceptOut& o) {
  AcceptOut ref;
  ref.status = {KDT_ACCEPT_CYCLE, KDT_ACCEPT_CYCLE, KDT_ACCEPT_OUT_OF_RANGE, KDT_ACCEPT_DUPLICATE};
  ref.accept_len = {1, 4, 1, 1};
  ref.accept_index = {0, -1, -1, -1, 0, 1, 1, 1, 0, -1, -1, -1, 0, -1, -1, -1};
  ref.bonus = {9, 5, 5, 5};
  return same_accept(o, ref);
}

// Random link arrays mixing valid indices, -1, out-of-range values and cycles.
AcceptIn random_malformed(std::mt19937_64& rng, int bs, int n) {
  AcceptIn in;
  in.bs = bs;
  in.n = n;
  const size_t bn = (size_t)bs * n;
  const int64_t odd[] = {-1, -1, 0, n, n + 5, -2};
  auto link = [&]() -> int64_t { return rng() % 10 < 3 ? odd[rng() % 6] : (int64_t)(rng() % n); };
  for (size_t i = 0; i < bn; ++i) {
    in.tokens.push_back((int64_t)(rng() % 3));
    in.first_child.push_back(link());
    in.next_sibling.push_back(link());
    in.target.push_back((int64_t)(rng() % 3));
  }
  if (rng() % 2)
    for (int b = 0; b < bs; ++b) in.num_nodes.push_back((int32_t)(rng() % (n + 2)));  // 0 and n+1: bad
  return in;
}

const char* const kAlgos[] = {"walk", "parallel"};

// fn() under each KDT_TREE_ACCEPT algorithm; the first failure, prefixed with its algorithm.
template <class F>
std::string for_each_algo(F fn) {
  std::string err;
  for (const char* algo : kAlgos) {
    setenv("KDT_TREE_ACCEPT", algo, 1);
    err = fn();
    if (!err.empty()) { err = std::string("KDT_TREE_ACCEPT=") + algo + ": " + err; break; }
  }
  unsetenv("KDT_TREE_ACCEPT");
  return err;
}

// Both backends' outputs for `in`: the CPU walk (the reference) and CUDA under the current
// KDT_TREE_ACCEPT.
std::string cpu_walk_vs_cuda(const AcceptIn& in, AcceptOut* a) {
  AcceptOut b;
  const char* cur = std::getenv("KDT_TREE_ACCEPT");
  const std::string algo = cur ? cur : "";
  setenv("KDT_TREE_ACCEPT", "walk", 1);
  kdt_status s = accept_cpu(in, a);
  setenv("KDT_TREE_ACCEPT", algo.c_str(), 1);
  if (s) return status_message(s, "kdt_tree_accept(cpu)");
  if ((s = accept_cuda(in, &b))) return status_message(s, "kdt_tree_accept(cuda)");
  return same_accept(b, *a);
}

}  // namespace

int main(int argc, char** argv) {
  Harness h(argc, argv);
  const std::string no_cuda = cuda_unavailable();

  h.run("handmade_defects/cpu", [] {
    return for_each_algo([] {
      AcceptOut o;
      if (kdt_status s = accept_cpu(handmade(), &o)) return status_message(s, "kdt_tree_accept(cpu)");
      return check_handmade(o);
    });
  });
  if (no_cuda.empty())
    h.run("handmade_defects/cuda", [] {
      return for_each_algo([] {
        AcceptOut o;
        if (kdt_status s = accept_cuda(handmade(), &o)) return status_message(s, "kdt_tree_accept(cuda)");
        return check_handmade(o);
      });
    });
  else
    h.skip("handmade_defects/cuda", no_cuda);

  h.run("invalid_arguments", [] {
    AcceptIn in = handmade();
    AcceptOut o;
    o.resize(in.bs, in.n);
    kdt_status s = kdt_tree_accept(KDT_BACKEND_CPU, nullptr, 4, 0, in.tokens.data(), in.first_child.data(),
                                   in.next_sibling.data(), nullptr, in.target.data(), o.accept_index.data(),
                                   o.accept_len.data(), o.bonus.data(), o.status.data());
    if (s != KDT_ERR_INVALID_ARGUMENT || !std::strstr(kdt_last_error(), "n="))
      return "n = 0: status " + std::to_string((int)s) + ", message '" + kdt_last_error() + "'";
    s = kdt_tree_accept(KDT_BACKEND_CPU, nullptr, 4, 4, in.tokens.data(), nullptr, in.next_sibling.data(),
                        nullptr, in.target.data(), o.accept_index.data(), o.accept_len.data(),
                        o.bonus.data(), o.status.data());
    if (s != KDT_ERR_INVALID_ARGUMENT || !std::strstr(kdt_last_error(), "first_child"))
      return "first_child = NULL: status " + std::to_string((int)s) + ", message '" + kdt_last_error() + "'";
    return std::string();
  });

  for (const std::string& path : h.bundle_files("tree_accept")) {
    AcceptIn in;
    AcceptOut ref;
    const std::string err = load_bundle(path, &in, &ref);
    h.run("bundle/" + stem(path) + "/cpu", [&] {
      if (!err.empty()) return err;
      return for_each_algo([&] {
        AcceptOut out;
        if (kdt_status s = accept_cpu(in, &out)) return status_message(s, "kdt_tree_accept(cpu)");
        return same_accept(out, ref);
      });
    });
    if (!no_cuda.empty()) { h.skip("bundle/" + stem(path) + "/cuda", no_cuda); continue; }
    h.run("bundle/" + stem(path) + "/cuda", [&] {
      if (!err.empty()) return err;
      return for_each_algo([&] {
        AcceptOut out;
        if (kdt_status s = accept_cuda(in, &out)) return status_message(s, "kdt_tree_accept(cuda)");
        return same_accept(out, ref);
      });
    });
  }

  std::mt19937_64 rng(h.seed);
  if (!no_cuda.empty()) {
    h.skip("random_malformed_cpu_vs_cuda", no_cuda);
  } else {
    h.run("random_malformed_cpu_vs_cuda", [&] {
      return for_each_algo([&] {
        int seen[4] = {0, 0, 0, 0};
        for (int trial = 0; trial < 200; ++trial) {
          const AcceptIn in = random_malformed(rng, 1 + (int)(rng() % 9), 1 + (int)(rng() % 70));
          AcceptOut a;
          const std::string e = cpu_walk_vs_cuda(in, &a);
          if (!e.empty()) return "trial " + std::to_string(trial) + ": " + e;
          for (int st : a.status) seen[st & 3]++;
        }
        for (int k = 0; k < 4; ++k)
          if (!seen[k]) return "status " + std::to_string(k) + " never occurred: the generator is too weak";
        return std::string();
      });
    });
  }
  // The CPU walk on random malformed trees: it must end, keep accept_len in [1, n] and list
  // only in-range nodes (a crash or hang here is the failure this guards against).
  h.run("random_malformed_cpu_bounds", [&] {
    return for_each_algo([&] {
      for (int trial = 0; trial < 500; ++trial) {
        const AcceptIn in = random_malformed(rng, 1 + (int)(rng() % 9), 1 + (int)(rng() % 70));
        AcceptOut a;
        if (kdt_status s = accept_cpu(in, &a)) return status_message(s, "kdt_tree_accept(cpu)");
        for (int b = 0; b < in.bs; ++b) {
          if (a.accept_len[b] < 1 || a.accept_len[b] > in.n)
            return "trial " + std::to_string(trial) + ": accept_len " + std::to_string(a.accept_len[b]);
          for (int i = 0; i < in.n; ++i) {
            const int32_t v = a.accept_index[(size_t)b * in.n + i];
            if ((i < a.accept_len[b]) != (v >= 0) || v >= in.n)
              return "trial " + std::to_string(trial) + ": accept_index[" + std::to_string(b) + "][" +
                     std::to_string(i) + "] = " + std::to_string(v);
          }
        }
      }
      return std::string();
    });
  });
  return h.finish();
}
