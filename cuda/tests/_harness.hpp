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

// Exact comparison of one output; "" or the comparator's description.
template <class T>
std::string same(const std::string& what, const std::vector<T>& got, const std::vector<T>& ref) {
  if (got.size() != ref.size())
    return what + ": " + std::to_string(got.size()) + " elements, reference " + std::to_string(ref.size());
  const kdt::CompareResult r = kdt::compare_exact(got.data(), ref.data(), got.size());
  return r.ok ? "" : r.describe(what);
}

}  // namespace kdt_test
