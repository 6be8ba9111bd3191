// _harness.hpp: what every native test program shares (included, not built on its own).
//
// Output protocol read by cuda/run_tests.sh (one line per case, tab-separated):
//   KDT_CASE <tab> <name> <tab> PASS|FAIL|SKIP <tab> <seconds> <tab> <message>
// and, last, "KDT_RESULT passed=P failed=F skipped=S". A program that dies before printing
// KDT_RESULT counts as failed. Exit code: 0 when nothing failed, 1 otherwise.
//
// Arguments: --bundles DIR (KDTR bundles, DIR/<kernel>/*.kdtr), --seed S (default: fresh).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kdtree/compare.hpp"
#include "kdtree/kdtr.hpp"
#include "kdtree/kdtree.h"

namespace kdt_test {

struct Harness {
  std::string bundles;
  uint64_t seed = 0;
  int passed = 0, failed = 0, skipped = 0;

  Harness(int argc, char** argv) {
    seed = std::random_device{}();
    seed = (seed << 32) ^ std::random_device{}();
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--bundles" && i + 1 < argc) bundles = argv[++i];
      else if (a == "--seed" && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
      else {
        std::fprintf(stderr, "error: %s: unknown argument '%s' (use --bundles DIR [--seed S])\n",
                     argv[0], a.c_str());
        std::exit(2);
      }
    }
    std::printf("seed %llu (rerun with --seed %llu)\n", (unsigned long long)seed,
                (unsigned long long)seed);
  }

  void report(const std::string& name, const char* verdict, double secs, const std::string& msg) {
    std::string clean = msg;
    std::replace(clean.begin(), clean.end(), '\t', ' ');
    std::replace(clean.begin(), clean.end(), '\n', ' ');
    std::printf("KDT_CASE\t%s\t%s\t%.3f\t%s\n", name.c_str(), verdict, secs, clean.c_str());
    std::fflush(stdout);
  }

  // Runs fn (returns "" on success, else the failure message) and reports it.
  template <class F>
  void run(const std::string& name, F fn) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string err = fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (err.empty()) { ++passed; report(name, "PASS", s, "ok"); }
    else { ++failed; report(name, "FAIL", s, err + " (seed " + std::to_string(seed) + ")"); }
  }
  void skip(const std::string& name, const std::string& why) { ++skipped; report(name, "SKIP", 0.0, why); }

  int finish() {
    std::printf("KDT_RESULT passed=%d failed=%d skipped=%d\n", passed, failed, skipped);
    return failed ? 1 : 0;
  }

  // Sorted DIR/<kernel>/*.kdtr; empty (with a FAIL case naming the fix) when there are none.
  std::vector<std::string> bundle_files(const std::string& kernel) {
    std::vector<std::string> out;
    const std::string hint = " (generate them: python -m engine.kdtr generate --out DIR, then "
                             "pass --bundles DIR)";
    if (bundles.empty()) {
      run("bundles/" + kernel, [&] { return std::string("no --bundles DIR given") + hint; });
      return out;
    }
    const std::filesystem::path dir = std::filesystem::path(bundles) / kernel;
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec))
      for (const auto& e : std::filesystem::directory_iterator(dir, ec))
        if (e.path().extension() == ".kdtr") out.push_back(e.path().string());
    std::sort(out.begin(), out.end());
    if (out.empty())
      run("bundles/" + kernel, [&] { return "no *.kdtr files in " + dir.string() + hint; });
    return out;
  }
};

inline std::string stem(const std::string& path) {
  return std::filesystem::path(path).stem().string();
}

// "" when the CUDA backend can run here, else why not (for a SKIP line).
inline std::string cuda_unavailable() {
  if (!kdt_has_cuda()) return "CUDA cases skipped: this libkdtree is a CPU-only build";
  if (kdt_cuda_device_count() == 0) return "CUDA cases skipped: no GPU is visible";
  return "";
}

inline std::string status_message(kdt_status s, const char* what) {
  return std::string(what) + " returned status " + std::to_string((int)s) + ": " + kdt_last_error();
}

// Device copy of a host vector, freed on scope exit (tests only: these helpers synchronise).
template <class T>
struct DeviceArray {
  void* ptr = nullptr;
  size_t n = 0;
  kdt_status status = KDT_OK;
  explicit DeviceArray(size_t count) : n(count) { status = kdt_device_alloc(&ptr, n * sizeof(T)); }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (status == KDT_OK) status = kdt_memcpy_htod(ptr, host.data(), n * sizeof(T));
  }
  ~DeviceArray() { kdt_device_free(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return static_cast<T*>(ptr); }
  std::vector<T> to_host() const {
    std::vector<T> h(n);
    kdt_memcpy_dtoh(h.data(), ptr, n * sizeof(T));
    return h;
  }
};

// Reads tensor `name` with dtype `want` from a bundle into out; "" or the error.
template <class T>
std::string read(kdt::SafetensorsFile& f, const std::string& name, kdt::DType want, std::vector<T>* out) {
  return f.read_as(name, want, out) == KDT_OK ? "" : f.error();
}

// A bundle's shape contract, checked before any kernel reads its tensors: the reader vouches for
// each tensor alone (ARCHITECTURE.md "KDTR bundles"), not that `top_ids` has the batch size of
// `root_ids`; a bundle whose tensors disagree would make a kernel read or write past a buffer.
// Sizes are named (bs, L, K, ...). A size is bound by the case metadata (param) or by the first
// tensor that uses it; every later use must agree. Calls chain with &&; the first defect is kept
// in err, naming the file, the tensor and where the disagreeing size came from.
//   BundleShapes s(f);
//   if (!(s.param("bs", 1, 1 << 16) && s.tensor("top_logp", DType::F32, {"bs", "L", "K"}) &&
//         s.tensor("root_ids", DType::I64, {"bs"}))) return s.err;
struct BundleShapes {
  explicit BundleShapes(kdt::SafetensorsFile& file) : f(file) {}

  kdt::SafetensorsFile& f;
  std::map<std::string, int64_t> size;
  std::map<std::string, std::string> source;  // where each size was bound
  std::string err;

  bool fail(const std::string& what) {
    if (err.empty()) err = f.path() + ": inconsistent bundle: " + what;
    return false;
  }
  int64_t operator[](const std::string& name) const {
    auto it = size.find(name);
    return it == size.end() ? -1 : it->second;
  }
  // Binds `name` to the case metadata's integer of the same name, which must lie in [lo, hi].
  bool param(const std::string& name, int64_t lo, int64_t hi) {
    int64_t v = 0;
    if (f.case_int(name, &v) != KDT_OK) {  // the reader's message names the file already
      if (err.empty()) err = f.error();
      return false;
    }
    if (v < lo || v > hi)
      return fail("case " + name + " = " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                  ", " + std::to_string(hi) + "]");
    return bind(name, v, "the case metadata");
  }
  // Binds a derived size (e.g. n = budget + 1); a size bound before must agree.
  bool bind(const std::string& name, int64_t v, const std::string& from) {
    auto it = size.find(name);
    if (it == size.end()) {
      size[name] = v;
      source[name] = from;
      return true;
    }
    if (it->second == v) return true;
    return fail(name + " = " + std::to_string(v) + " from " + from + " but " + std::to_string(it->second) +
                " from " + source[name]);
  }
  // Tensor `name` must exist with dtype `want` and one dimension per entry of dims: a size name
  // (bound here when new) or a decimal constant. Sizes must fit an int32 (the kernels' type).
  bool tensor(const std::string& name, kdt::DType want, const std::vector<std::string>& dims) {
    const kdt::TensorInfo* t = f.find(name);
    if (!t) return fail("tensor " + name + " is missing");
    if (t->dtype != want)
      return fail("tensor " + name + " has dtype " + kdt::dtype_name(t->dtype) + ", expected " +
                  kdt::dtype_name(want));
    std::string expect = "[", got = "[";
    for (size_t d = 0; d < dims.size(); ++d) expect += (d ? ", " : "") + dims[d];
    for (size_t d = 0; d < t->shape.size(); ++d) got += (d ? ", " : "") + std::to_string(t->shape[d]);
    if (t->shape.size() != dims.size())
      return fail("tensor " + name + " has shape " + got + "], expected " + expect + "]");
    for (size_t d = 0; d < dims.size(); ++d) {
      const int64_t v = t->shape[d];
      if (v > INT32_MAX) return fail("tensor " + name + " dimension " + std::to_string(d) + " is " + std::to_string(v));
      const std::string& sym = dims[d];
      const std::string from = "tensor " + name + " " + got + "]";
      if (!sym.empty() && sym.find_first_not_of("0123456789") == std::string::npos) {
        if (v != std::stoll(sym)) return fail(from + ", expected " + expect + "]");
      } else if (!bind(sym, v, from)) {
        return false;
      }
    }
    return true;
  }
};

// Checks an index-pointer array of bs + 1 entries: starts at 0, never decreases, ends at total;
// "" or the defect (the kernels index rows with it, so a bad one reads past the buffers).
inline std::string check_indptr(const std::string& what, const std::vector<int32_t>& p, int64_t total) {
  if (p.empty() || p[0] != 0) return what + "[0] is not 0";
  for (size_t b = 0; b + 1 < p.size(); ++b)
    if (p[b + 1] < p[b])
      return what + " decreases at " + std::to_string(b + 1) + " (" + std::to_string(p[b]) + " -> " +
             std::to_string(p[b + 1]) + ")";
  if (p.back() != total) return what + " ends at " + std::to_string(p.back()) + ", expected " + std::to_string(total);
  return "";
}

// Exact comparison of one output; "" or the comparator's description.
template <class T>
std::string same(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref) {
  if (got.size() != ref.size())
    return what + ": " + std::to_string(got.size()) + " elements, reference " + std::to_string(ref.size());
  const kdt::CompareResult r = kdt::compare_exact(got.data(), ref.data(), got.size());
  return r.ok ? "" : r.describe(what);
}

}  // namespace kdt_test
