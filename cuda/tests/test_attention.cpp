// test_attention: kdt_verify_attention against the reference's KDTR bundles
// (DIR/verify_attention/*.kdtr, float64 expectations on the stored inputs) on the CPU backend
// and, when a GPU is present, the CUDA backend; plus argument validation.
//   test_attention --bundles DIR [--seed S]
// Tolerance: element i passes when |got - ref| <= 1e-5 * max|ref| or |got - ref| / |ref| <= 1e-5
// (fp32 accumulation against float64 on the same, possibly bf16-rounded, inputs); the line
// "ATTN <case> <backend> out_rel ... lse_rel ..." prints max|got - ref| / max|ref| per tensor.
#include <cmath>

#include "_harness.hpp"

using namespace kdt_test;

namespace {

constexpr double kTol = 1e-5;

struct Case {
  int32_t bs = 0, H = 0, dl = 0, dr = 0, total_q = 0, total_kv = 0, max_tree = 1, max_kv = 0, W = 0;
  kdt_dtype dtype = KDT_DTYPE_F32;
  std::vector<uint8_t> q_lat, q_pe, kv;  // raw bytes (float32 or bfloat16)
  std::vector<int32_t> qi, ki;
  std::vector<uint32_t> vis;
  float scale = 1.f;
  std::vector<double> out, lse;  // expected
};

std::string raw(kdt::SafetensorsFile& f, const std::string& name, kdt::DType want,
                std::vector<int64_t> shape, std::vector<uint8_t>* out) {
  const kdt::TensorInfo* t = f.find(name);
  if (!t) return f.path() + ": tensor " + name + " is missing";
  if (t->dtype != want)
    return f.path() + ": " + name + " is " + kdt::dtype_name(t->dtype) + ", q_lat is " + kdt::dtype_name(want);
  if (t->shape != shape) return f.path() + ": " + name + " has an unexpected shape";
  out->resize((size_t)t->nbytes());
  return f.read_raw(name, out->data(), out->size()) == KDT_OK ? "" : f.error();
}

std::string load(const std::string& path, Case* c) {
  kdt::SafetensorsFile f;
  if (f.open(path) != KDT_OK || f.check_kdtr("verify_attention") != KDT_OK) return f.error();
  const kdt::TensorInfo* q = f.find("q_lat");
  const kdt::TensorInfo* pe = f.find("q_pe");
  const kdt::TensorInfo* qi = f.find("q_indptr");
  if (!q || q->shape.size() != 3 || !pe || pe->shape.size() != 3 || !qi || qi->shape.size() != 1)
    return path + ": q_lat / q_pe / q_indptr missing or of the wrong rank";
  if (q->dtype != kdt::DType::F32 && q->dtype != kdt::DType::BF16)
    return path + ": q_lat is " + kdt::dtype_name(q->dtype) + ", expected F32 or BF16";
  c->dtype = q->dtype == kdt::DType::F32 ? KDT_DTYPE_F32 : KDT_DTYPE_BF16;
  c->total_q = (int32_t)q->shape[0];
  c->H = (int32_t)q->shape[1];
  c->dl = (int32_t)q->shape[2];
  c->dr = (int32_t)pe->shape[2];
  c->bs = (int32_t)qi->shape[0] - 1;
  const kdt::TensorInfo* kv = f.find("kv_cache");
  const kdt::TensorInfo* vis = f.find("visibility");
  if (!kv || kv->shape.size() != 2 || !vis || vis->shape.size() != 2)
    return path + ": kv_cache / visibility missing or of the wrong rank";
  c->total_kv = (int32_t)kv->shape[0];
  c->W = (int32_t)vis->shape[1];
  std::vector<float> scale;
  for (const std::string& e :
       {raw(f, "q_lat", q->dtype, {c->total_q, c->H, c->dl}, &c->q_lat),
        raw(f, "q_pe", q->dtype, {c->total_q, c->H, c->dr}, &c->q_pe),
        raw(f, "kv_cache", q->dtype, {c->total_kv, c->dl + c->dr}, &c->kv),
        read(f, "q_indptr", kdt::DType::I32, &c->qi), read(f, "kv_indptr", kdt::DType::I32, &c->ki),
        read(f, "visibility", kdt::DType::U32, &c->vis),
        read(f, "softmax_scale", kdt::DType::F32, &scale),
        read(f, "expected.out", kdt::DType::F64, &c->out),
        read(f, "expected.lse", kdt::DType::F64, &c->lse)})
    if (!e.empty()) return e;
  if (scale.size() != 1 || c->ki.size() != c->qi.size()) return path + ": softmax_scale or kv_indptr malformed";
  if (c->out.size() != (size_t)c->total_q * c->H * c->dl || c->lse.size() != (size_t)c->total_q * c->H)
    return path + ": expected.out / expected.lse sizes do not match q_lat";
  c->scale = scale[0];
  for (int b = 0; b < c->bs; ++b) {
    c->max_tree = std::max(c->max_tree, c->qi[b + 1] - c->qi[b]);
    c->max_kv = std::max(c->max_kv, c->ki[b + 1] - c->ki[b]);
  }
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
                    const std::vector<float>& lse) {
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

std::string run_cuda(const Case& c, const std::string& tag) {
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
  if (s != KDT_OK) return status_message(s, "kdt_verify_attention(cuda)");
  s = kdt_device_synchronize();
  if (s != KDT_OK) return status_message(s, "kdt_device_synchronize");
  return compare(tag, c, out.to_host(), lse.to_host());
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
    if (no_cuda.empty()) h.run(name + "/cuda", [&] { return run_cuda(c, name + " cuda"); });
    else h.skip(name + "/cuda", no_cuda);
  }
  return h.finish();
}
