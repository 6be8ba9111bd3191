// test_attention: kdt_verify_attention against the reference's KDTR bundles
// (DIR/verify_attention/*.kdtr, float64 expectations on the stored inputs) on the CPU backend
// and, when a GPU is present, the CUDA backend; plus argument validation.
//   test_attention --bundles DIR [--seed S]
// Tolerance: element i passes when |got - ref| <= tol * max|ref| or |got - ref| / |ref| <= tol,
// tol = 1e-5 (fp32 accumulation against float64 on the same, possibly bf16-rounded, inputs) for
// the CPU backend and the SIMT path, 1e-2 for the tensor-core paths on bf16 caches (P is
// rounded to bf16); the line "ATTN <case> <backend> out_rel ... lse_rel ..." prints
// max|got - ref| / max|ref| per tensor. The CUDA backend runs once per path that can take the
// bundle (KDT_VERIFY_PATH = simt, auto, and mma for bf16 at 512 + 64).
#include <cmath>
#include <cstdlib>

#include "_harness.hpp"

using namespace kdt_test;

namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kTolBf16TensorCores = 1e-2;

struct Case {
  int32_t bs = 0, H = 0, dl = 0, dr = 0, total_q = 0, total_kv = 0, max_tree = 1, max_kv = 0, W = 0;
  kdt_dtype dtype = KDT_DTYPE_F32;
  std::vector<uint8_t> q_lat, q_pe, kv;  // raw bytes (float32 or bfloat16)
  std::vector<int32_t> qi, ki;
  std::vector<uint32_t> vis;
  float scale = 1.f;
  std::vector<double> out, lse;  // expected
};

std::string raw(kdt::SafetensorsFile& f, const std::string& name, std::vector<uint8_t>* out) {
  out->resize((size_t)f.find(name)->nbytes());  // BundleShapes checked it exists
  return f.read_raw(name, out->data(), out->size()) == KDT_OK ? "" : f.error();
}

std::string load(const std::string& path, Case* c) {
  kdt::SafetensorsFile f;
  if (f.open(path) != KDT_OK || f.check_kdtr("verify_attention") != KDT_OK) return f.error();
  const kdt::TensorInfo* q = f.find("q_lat");
  if (!q) return path + ": tensor q_lat is missing";
  if (q->dtype != kdt::DType::F32 && q->dtype != kdt::DType::BF16)
    return path + ": q_lat is " + kdt::dtype_name(q->dtype) + ", expected F32 or BF16";
  const kdt::DType dt = q->dtype;
  c->dtype = dt == kdt::DType::F32 ? KDT_DTYPE_F32 : KDT_DTYPE_BF16;
  // Every tensor against the case and each other, before anything is read; then the index
  // pointers against the row counts (the kernels index q, kv and visibility rows with them).
  using kdt::DType;
  BundleShapes s(f);
  if (!(s.param("bs", 0, 1 << 20) && s.param("num_heads", 1, 1 << 12) && s.param("d_latent", 1, 1 << 12) &&
        s.param("d_rope", 0, 1 << 12) && s.param("max_tree", 1, 1 << 20) && s.param("max_kv", 0, INT32_MAX) &&
        s.bind("bs + 1", s["bs"] + 1, "bs + 1") && s.bind("dl + dr", s["d_latent"] + s["d_rope"], "d_latent + d_rope") &&
        s.tensor("q_lat", dt, {"total_q", "num_heads", "d_latent"}) &&
        s.tensor("q_pe", dt, {"total_q", "num_heads", "d_rope"}) &&
        s.tensor("kv_cache", dt, {"total_kv", "dl + dr"}) && s.tensor("q_indptr", DType::I32, {"bs + 1"}) &&
        s.tensor("kv_indptr", DType::I32, {"bs + 1"}) && s.tensor("visibility", DType::U32, {"total_q", "W"}) &&
        s.tensor("softmax_scale", DType::F32, {"1"}) &&
        s.tensor("expected.out", DType::F64, {"total_q", "num_heads", "d_latent"}) &&
        s.tensor("expected.lse", DType::F64, {"total_q", "num_heads"})))
    return s.err;
  c->bs = (int32_t)s["bs"];
  c->H = (int32_t)s["num_heads"];
  c->dl = (int32_t)s["d_latent"];
  c->dr = (int32_t)s["d_rope"];
  c->total_q = (int32_t)s["total_q"];
  c->total_kv = (int32_t)s["total_kv"];
  c->W = (int32_t)s["W"];
  std::vector<float> scale;
  for (const std::string& e :
       {raw(f, "q_lat", &c->q_lat), raw(f, "q_pe", &c->q_pe), raw(f, "kv_cache", &c->kv),
        read(f, "q_indptr", kdt::DType::I32, &c->qi), read(f, "kv_indptr", kdt::DType::I32, &c->ki),
        read(f, "visibility", kdt::DType::U32, &c->vis),
        read(f, "softmax_scale", kdt::DType::F32, &scale),
        read(f, "expected.out", kdt::DType::F64, &c->out),
        read(f, "expected.lse", kdt::DType::F64, &c->lse)})
    if (!e.empty()) return e;
  c->scale = scale[0];
  const std::string bad = path + ": inconsistent bundle: ";
  for (const std::string& e : {check_indptr("q_indptr", c->qi, c->total_q), check_indptr("kv_indptr", c->ki, c->total_kv)})
    if (!e.empty()) return bad + e;
  c->max_tree = 1;
  c->max_kv = 0;
  for (int b = 0; b < c->bs; ++b) {
    const int32_t nq = c->qi[b + 1] - c->qi[b], nkv = c->ki[b + 1] - c->ki[b];
    if (nkv < nq)
      return bad + "request " + std::to_string(b) + " has " + std::to_string(nq) + " tree rows but " +
             std::to_string(nkv) + " kv rows (kv holds the prefix and the tree)";
    c->max_tree = std::max(c->max_tree, nq);
    c->max_kv = std::max(c->max_kv, nkv);
  }
  if (c->max_tree != s["max_tree"] || c->max_kv != s["max_kv"])
    return bad + "the index pointers give max_tree " + std::to_string(c->max_tree) + " and max_kv " +
           std::to_string(c->max_kv) + ", the case metadata " + std::to_string(s["max_tree"]) + " and " +
           std::to_string(s["max_kv"]);
  if ((int64_t)c->W * 32 < c->max_tree)
    return bad + "visibility has " + std::to_string(c->W) + " words per row, too few for a tree of " +
           std::to_string(c->max_tree) + " nodes";
  return "";
}

// max|got - ref| / max|ref| over the finite references (inf positions must match).
double norm_rel(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) {
      if (got[i] != ref[i]) return INFINITY;
      continue;
    }
    num = std::max(num, std::fabs(double(got[i]) - ref[i]));
    den = std::max(den, std::fabs(ref[i]));
  }
  return den > 0 ? num / den : num;
}

std::string compare(const std::string& tag, const Case& c, const std::vector<float>& out,
                    const std::vector<float>& lse, double kTol = kTolF32) {
  double mo = 0, ml = 0;
  for (double v : c.out) if (std::isfinite(v)) mo = std::max(mo, std::fabs(v));
  for (double v : c.lse) if (std::isfinite(v)) ml = std::max(ml, std::fabs(v));
  std::printf("ATTN %s out_rel %.3g lse_rel %.3g\n", tag.c_str(), norm_rel(out, c.out), norm_rel(lse, c.lse));
  const auto ro = kdt::compare_close(out.data(), c.out.data(), out.size(), kTol, kTol * mo);
  const auto rl = kdt::compare_close(lse.data(), c.lse.data(), lse.size(), kTol, kTol * ml);
  std::string err;
  if (!ro.ok) err += ro.describe("out");
  if (!rl.ok) err += (err.empty() ? "" : "; ") + rl.describe("lse");
  return err;
}

std::string run_cpu(const Case& c, const std::string& tag) {
  std::vector<float> out(c.out.size()), lse(c.lse.size());
  kdt_status s = kdt_verify_attention(KDT_BACKEND_CPU, nullptr, c.dtype, c.bs, c.H, c.dl, c.dr,
                                      c.total_q, c.total_kv, c.max_tree, c.max_kv, c.qi.data(),
                                      c.ki.data(), c.q_lat.data(), c.q_pe.data(), c.kv.data(),
                                      c.vis.data(), c.W, c.scale, out.data(), lse.data(), nullptr, 0);
  if (s != KDT_OK) return status_message(s, "kdt_verify_attention(cpu)");
  return compare(tag, c, out, lse);
}

std::string run_cuda(const Case& c, const std::string& tag, const std::string& path) {
  DeviceArray<uint8_t> q(c.q_lat), pe(c.q_pe), kv(c.kv);
  DeviceArray<int32_t> qi(c.qi), ki(c.ki);
  DeviceArray<uint32_t> vis(c.vis);
  DeviceArray<float> out(c.out.size()), lse(c.lse.size());
  const size_t ws_bytes = kdt_verify_attention_workspace_size(KDT_BACKEND_CUDA, c.bs, c.H, c.dl,
                                                              c.total_q, c.max_tree, c.max_kv);
  DeviceArray<uint8_t> ws(ws_bytes);
  for (kdt_status st : {q.status, pe.status, kv.status, qi.status, ki.status, vis.status,
                        out.status, lse.status, ws.status})
    if (st != KDT_OK) return status_message(st, "device allocation or copy");
  kdt_status s = kdt_verify_attention(KDT_BACKEND_CUDA, nullptr, c.dtype, c.bs, c.H, c.dl, c.dr,
                                      c.total_q, c.total_kv, c.max_tree, c.max_kv, qi.get(),
                                      ki.get(), q.get(), pe.get(), kv.get(), vis.get(), c.W,
                                      c.scale, out.get(), lse.get(), ws.get(), ws_bytes);
  if (s != KDT_OK) return status_message(s, ("kdt_verify_attention(cuda, " + path + ")").c_str());
  s = kdt_device_synchronize();
  if (s != KDT_OK) return status_message(s, "kdt_device_synchronize");
  const bool tensor_cores = c.dtype == KDT_DTYPE_BF16 && path != "simt";
  return compare(tag, c, out.to_host(), lse.to_host(),
                 tensor_cores ? kTolBf16TensorCores : kTolF32);
}

// Each check: the call must fail with `want` and a message containing `needle`.
std::string expect_error(kdt_status got, kdt_status want, const char* needle) {
  if (got != want)
    return "status " + std::to_string((int)got) + ", expected " + std::to_string((int)want) +
           " (" + kdt_last_error() + ")";
  if (!std::strstr(kdt_last_error(), needle))
    return std::string("message '") + kdt_last_error() + "' lacks '" + needle + "'";
  return "";
}

std::string validation() {
  std::vector<float> q(2 * 3 * 4), pe(2 * 3 * 2), kv(5 * 6), out(2 * 3 * 4), lse(2 * 3);
  std::vector<int32_t> qi = {0, 2}, ki = {0, 5};
  std::vector<uint32_t> vis = {1u, 3u};
  auto call = [&](kdt_backend be, int32_t max_tree, int32_t W, const void* qp, const int32_t* kip) {
    return kdt_verify_attention(be, nullptr, KDT_DTYPE_F32, 1, 3, 4, 2, 2, 5, max_tree, 5,
                                qi.data(), kip, qp, pe.data(), kv.data(), vis.data(), W, 0.5f,
                                out.data(), lse.data(), nullptr, 0);
  };
  std::string e;
  if (call(KDT_BACKEND_CPU, 2, 1, q.data(), ki.data()) != KDT_OK) return std::string("valid call failed: ") + kdt_last_error();
  if (!(e = expect_error(call(KDT_BACKEND_CPU, 2, 1, nullptr, ki.data()), KDT_ERR_INVALID_ARGUMENT, "q_lat is NULL")).empty()) return e;
  if (!(e = expect_error(call(KDT_BACKEND_CPU, 40, 1, q.data(), ki.data()), KDT_ERR_INVALID_ARGUMENT, "vis_words = 1")).empty()) return e;
  if (!(e = expect_error(call(KDT_BACKEND_CPU, 1, 1, q.data(), ki.data()), KDT_ERR_INVALID_ARGUMENT, "exceeds max_tree")).empty()) return e;
  std::vector<int32_t> bad = {0, 1};
  if (!(e = expect_error(call(KDT_BACKEND_CPU, 2, 1, q.data(), bad.data()), KDT_ERR_INVALID_ARGUMENT, "smaller than its tree size")).empty()) return e;
  if (!(e = expect_error(call((kdt_backend)7, 2, 1, q.data(), ki.data()), KDT_ERR_INVALID_ARGUMENT, "backend = 7")).empty()) return e;
  setenv("KDT_VERIFY_PATH", "mma", 1);
  e = expect_error(call(KDT_BACKEND_CPU, 2, 1, q.data(), ki.data()), KDT_ERR_INVALID_ARGUMENT, "forces a CUDA path");
  setenv("KDT_VERIFY_PATH", "fastest", 1);
  if (e.empty()) e = expect_error(call(KDT_BACKEND_CPU, 2, 1, q.data(), ki.data()), KDT_ERR_INVALID_ARGUMENT, "KDT_VERIFY_PATH = 'fastest'");
  unsetenv("KDT_VERIFY_PATH");
  if (!e.empty()) return e;
  if (!kdt_has_cuda() &&
      !(e = expect_error(call(KDT_BACKEND_CUDA, 2, 1, q.data(), ki.data()), KDT_ERR_UNSUPPORTED, "without CUDA")).empty())
    return e;
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  Harness h(argc, argv);
  const std::string no_cuda = cuda_unavailable();
  h.run("validation", validation);
  for (const std::string& path : h.bundle_files("verify_attention")) {
    Case c;
    const std::string err = load(path, &c);
    const std::string name = stem(path);
    if (!err.empty()) {
      h.run(name + "/load", [&] { return err; });
      continue;
    }
    h.run(name + "/cpu", [&] { return run_cpu(c, name + " cpu"); });
    std::vector<std::string> paths = {"simt", "auto"};
    if (c.dtype == KDT_DTYPE_BF16 && c.dl == 512 && c.dr == 64) paths.push_back("mma");
    for (const std::string& p : paths) {
      const std::string tag = name + "/cuda-" + p;
      if (!no_cuda.empty()) {
        h.skip(tag, no_cuda);
        continue;
      }
      setenv("KDT_VERIFY_PATH", p.c_str(), 1);
      h.run(tag, [&] { return run_cuda(c, name + " cuda-" + p, p); });
      unsetenv("KDT_VERIFY_PATH");
    }
  }
  return h.finish();
}
