// verify_attention_cpu.cpp: the CPU backend of kdt_verify_attention (C++17, one thread).
//
// Accumulation is in double: scores (a 576-term dot product), the softmax sums and the
// weighted sum of c_kv rows. The CPU backend doubles as a second, independent check of the
// CUDA kernels on hosts without numpy, so it is kept within a few float32 ulps of the float64
// reference (the result is rounded to float32 once, at the end); double costs little here
// because the loop is bound by reading the cache, not by arithmetic.
//
// Loop order, per request: the cache is walked once in tiles of kTile rows (converted to double
// once per tile), and every (node, head) row of the request absorbs the tile into its own
// online-softmax state, so the prefix is read once per request, not once per query row.
// The rows of a request are split over up to hardware_concurrency() threads (each walks the
// cache with its own tile buffer); results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "common.h"
#include "kdtree/attention_state.cuh"
#include "verify_attention.h"

namespace kdt {
namespace {

constexpr int kTile = 64;

inline double load(const float* p, int64_t i) { return double(p[i]); }
inline double load(const uint16_t* p, int64_t i) { return double(bf16_bits_to_float(p[i])); }

// Rows [r_begin, r_end) of request b (row = node * H + head).
template <typename T>
void run_rows(const VerifyAttentionArgs& a, int32_t b, int64_t r_begin, int64_t r_end) {
  const int64_t H = a.num_heads, Dl = a.d_latent, Dr = a.d_rope, Dk = Dl + Dr;
  const int64_t q0 = a.q_indptr[b], n = a.q_indptr[b + 1] - q0;
  const int64_t kv0 = a.kv_indptr[b], kv_len = a.kv_indptr[b + 1] - kv0;
  const int64_t P = kv_len - n;  // prefix rows; tree node j is cache row kv0 + P + j
  const T* q_lat = static_cast<const T*>(a.q_lat);
  const T* q_pe = static_cast<const T*>(a.q_pe);
  const T* kv = static_cast<const T*>(a.kv_cache);

  // q [rows, Dk] in double: q_lat then q_pe, the same order as a cache row.
  const int64_t rows = r_end - r_begin;
  std::vector<double> q(size_t(rows * Dk));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = q0 * H + r_begin + r;  // global (query, head) row
    for (int64_t k = 0; k < Dl; ++k) q[r * Dk + k] = load(q_lat, g * Dl + k);
    for (int64_t k = 0; k < Dr; ++k) q[r * Dk + Dl + k] = load(q_pe, g * Dr + k);
  }
  std::vector<double> o(size_t(rows * Dl), 0.0);  // unnormalised outputs [rows, Dl]
  std::vector<SoftmaxState<double>> st(static_cast<size_t>(rows));
  for (auto& s : st) s.init();

  std::vector<double> tile(size_t(kTile * Dk));
  double scores[kTile];
  const double scale = double(a.softmax_scale);
  for (int64_t t0 = 0; t0 < kv_len; t0 += kTile) {
    const int64_t tn = std::min<int64_t>(kTile, kv_len - t0);
    for (int64_t j = 0; j < tn; ++j)
      for (int64_t k = 0; k < Dk; ++k) tile[j * Dk + k] = load(kv, (kv0 + t0 + j) * Dk + k);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t node = (r_begin + r) / H;
      const uint32_t* vis = a.visibility + (q0 + node) * a.vis_words;
      const double* qr = &q[r * Dk];
      double block_max = att_neg_inf<double>();
      for (int64_t j = 0; j < tn; ++j) {
        const int64_t c = t0 + j;  // row within the request's cache range
        const bool visible = c < P || ((vis[(c - P) >> 5] >> ((c - P) & 31)) & 1u);
        if (!visible) {
          scores[j] = att_neg_inf<double>();
          continue;
        }
        const double* kr = &tile[j * Dk];
        double s0 = 0.0, s1 = 0.0;  // two chains for instruction-level parallelism
        int64_t k = 0;
        for (; k + 1 < Dk; k += 2) {
          s0 += qr[k] * kr[k];
          s1 += qr[k + 1] * kr[k + 1];
        }
        if (k < Dk) s0 += qr[k] * kr[k];
        scores[j] = (s0 + s1) * scale;
        block_max = std::max(block_max, scores[j]);
      }
      if (block_max == att_neg_inf<double>()) continue;  // nothing visible in this tile
      double* orow = &o[r * Dl];
      const double f = st[r].rescale(block_max);
      if (f != 1.0)
        for (int64_t k = 0; k < Dl; ++k) orow[k] *= f;
      for (int64_t j = 0; j < tn; ++j) {
        const double w = st[r].weight(scores[j]);
        if (w == 0.0) continue;
        st[r].d += w;
        const double* vr = &tile[j * Dk];  // the value is the latent c_kv (first Dl entries)
        for (int64_t k = 0; k < Dl; ++k) orow[k] += w * vr[k];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = q0 * H + r_begin + r;
    const double inv = st[r].inv_d();
    for (int64_t k = 0; k < Dl; ++k) a.out[g * Dl + k] = float(o[r * Dl + k] * inv);
    a.lse[g] = float(st[r].lse());
  }
}

template <typename T>
void run_request(const VerifyAttentionArgs& a, int32_t b) {
  const int64_t rows = int64_t(a.q_indptr[b + 1] - a.q_indptr[b]) * a.num_heads;
  if (rows == 0) return;
  // Enough rows per thread that each tile conversion is amortised over many rows.
  const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(hw, rows / 32));
  if (threads == 1) {
    run_rows<T>(a, b, 0, rows);
    return;
  }
  std::vector<std::thread> pool;
  std::exception_ptr error;
  std::mutex error_mu;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t lo = rows * t / threads, hi = rows * (t + 1) / threads;
    pool.emplace_back([&, lo, hi] {
      try {
        run_rows<T>(a, b, lo, hi);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

kdt_status verify_attention_cpu(const VerifyAttentionArgs& a) {
  try {
    for (int32_t b = 0; b < a.bs; ++b) {
      if (a.dtype == KDT_DTYPE_F32)
        run_request<float>(a, b);
      else
        run_request<uint16_t>(a, b);
    }
  } catch (const std::bad_alloc&) {
    return set_error(KDT_ERR_OUT_OF_MEMORY, "kdt_verify_attention",
                     "the CPU backend could not allocate its per-request buffers");
  } catch (const std::system_error& e) {
    return set_error(KDT_ERR_INTERNAL, "kdt_verify_attention",
                     "the CPU backend could not start its threads: %s", e.what());
  }
  return KDT_OK;
}

}  // namespace kdt
