// compare.hpp: the one comparator of the native tests (the C++ twin of the Python one).
//
//   auto r = kdt::compare_close(got, ref, n, /*rtol=*/1e-5, /*atol=*/1e-6);
//   auto e = kdt::compare_exact(got_ids, ref_ids, n);
//   if (!r.ok) printf("%s\n", r.describe("out").c_str());
//
// Floats: element i passes when |got - ref| <= atol or |got - ref| / |ref| <= rtol, and
// non-finite values must sit at the same positions with the same value (NaN matches NaN).
// The result carries the max abs and rel errors, the worst element's index and both values,
// and how many elements failed (max rel counts only elements whose abs error exceeds atol, so
// near-zero references do not swamp it). Integers: exact, with the first mismatch reported.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>

namespace kdt {

struct CompareResult {
  bool ok = true;
  size_t n = 0, failed = 0;
  size_t worst = 0;          // index of the worst element (first mismatch in exact mode)
  double max_abs = 0.0, max_rel = 0.0;
  double got = 0.0, ref = 0.0;  // values at `worst`
  bool exact = false;
  // Ranking state of compare_close (not part of the report).
  bool worst_bad = false;
  double worst_rel = 0.0, worst_abs = 0.0;
  int n_seen = 0;

  std::string describe(const std::string& name) const {
    char buf[512];
    if (exact)
      std::snprintf(buf, sizeof buf, "%s: %s (%zu of %zu differ; first at [%zu]: got %.17g, ref %.17g)",
                    name.c_str(), ok ? "OK" : "MISMATCH", failed, n, worst, got, ref);
    else
      std::snprintf(buf, sizeof buf,
                    "%s: %s (%zu of %zu out of tolerance; max abs %.3g, max rel %.3g; worst at "
                    "[%zu]: got %.17g, ref %.17g)",
                    name.c_str(), ok ? "OK" : "MISMATCH", failed, n, max_abs, max_rel, worst, got, ref);
    return buf;
  }
};

template <class G, class R>
CompareResult compare_close(const G* got, const R* ref, size_t n, double rtol, double atol) {
  CompareResult r;
  r.n = n;
  for (size_t i = 0; i < n; ++i) {
    const double g = (double)got[i], f = (double)ref[i];
    bool bad;
    double abs_err = 0.0, rel_err = 0.0;
    if (!std::isfinite(g) || !std::isfinite(f)) {
      // inf must equal inf of the same sign; NaN matches only NaN.
      bad = !((std::isnan(g) && std::isnan(f)) || g == f);
      if (bad) abs_err = rel_err = INFINITY;
    } else {
      abs_err = std::fabs(g - f);
      rel_err = f != 0.0 ? abs_err / std::fabs(f) : (abs_err == 0.0 ? 0.0 : INFINITY);
      bad = !(abs_err <= atol || rel_err <= rtol);
    }
    if (abs_err > r.max_abs) r.max_abs = abs_err;
    if (rel_err > r.max_rel && (abs_err > atol || bad)) r.max_rel = rel_err;
    // The worst element: failing before passing, then the larger relative error, then the
    // larger absolute one (a passing comparison still reports where it came closest to failing).
    const bool worse = r.n_seen == 0 || bad > r.worst_bad ||
                       (bad == r.worst_bad && (rel_err > r.worst_rel ||
                                               (rel_err == r.worst_rel && abs_err > r.worst_abs)));
    if (worse) {
      r.worst = i; r.got = g; r.ref = f;
      r.worst_bad = bad; r.worst_rel = rel_err; r.worst_abs = abs_err;
    }
    r.n_seen = 1;
    if (bad) { ++r.failed; r.ok = false; }
  }
  return r;
}

template <class G, class R>
CompareResult compare_exact(const G* got, const R* ref, size_t n) {
  CompareResult r;
  r.n = n;
  r.exact = true;
  for (size_t i = 0; i < n; ++i) {
    if (got[i] == ref[i]) continue;
    // Floats compare bit for bit here only through equal values; NaN never equals.
    if (r.ok) { r.worst = i; r.got = (double)got[i]; r.ref = (double)ref[i]; }
    r.ok = false;
    ++r.failed;
    const double d = std::fabs((double)got[i] - (double)ref[i]);
    if (d > r.max_abs) r.max_abs = d;
  }
  return r;
}

}  // namespace kdt
