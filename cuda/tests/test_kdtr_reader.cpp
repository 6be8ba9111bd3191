// test_kdtr_reader: the strict safetensors / KDTR reader (kdtree/kdtr.hpp). Valid files read
// back exactly (BF16 and F16 widen to F32 exactly); each defect gives an error naming the file
// and the defect; a fuzz loop over corrupted files never crashes; and every bundle under
// --bundles DIR opens and passes check_kdtr for its kernel folder.
//   test_kdtr_reader [--bundles DIR] [--seed S]
#include <fstream>

#include "_harness.hpp"

using namespace kdt_test;
namespace fs = std::filesystem;

namespace {

struct Entry {
  std::string name, dtype, shape;  // shape as JSON, e.g. "[2,3]"
  std::string bytes;
};

// Serialises a safetensors file: entries placed back to back in the given order.
std::string make_file(const std::vector<Entry>& entries, const std::string& meta_json) {
  std::string header = "{";
  if (!meta_json.empty()) header += "\"__metadata__\":" + meta_json;
  size_t off = 0;
  std::string data;
  for (const Entry& e : entries) {
    if (header.size() > 1) header += ",";
    header += "\"" + e.name + "\":{\"dtype\":\"" + e.dtype + "\",\"shape\":" + e.shape +
              ",\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + e.bytes.size()) + "]}";
    off += e.bytes.size();
    data += e.bytes;
  }
  header += "}";
  while (header.size() % 8) header += ' ';  // the safetensors writer pads with spaces
  std::string out(8, '\0');
  uint64_t h = header.size();
  for (int k = 0; k < 8; ++k) out[k] = (char)((h >> (8 * k)) & 0xFF);
  return out + header + data;
}

std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t h = header.size();
  for (int k = 0; k < 8; ++k) out[k] = (char)((h >> (8 * k)) & 0xFF);
  return out + header + data;
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

void write(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary).write(s.data(), (std::streamsize)s.size());
}

// n zero-size tensors and m metadata keys: the largest valid file the reader's limits allow
// when n == kMaxTensors and m == kMaxMetadataKeys.
std::string many_zero_tensors(size_t n, size_t m) {
  std::string meta = "{";
  for (size_t k = 0; k < m; ++k) meta += (k ? ",\"k" : "\"k") + std::to_string(k) + "\":\"v\"";
  meta += "}";
  std::vector<Entry> entries;
  for (size_t i = 0; i < n; ++i) entries.push_back({"t" + std::to_string(i), "U8", "[0,7]", ""});
  return make_file(entries, m ? meta : "");
}

const char* kMeta = "{\"format\":\"kdtr\",\"version\":\"1\",\"kernel\":\"tree_build\",\"case\":\"{}\"}";

std::string valid_file() {
  return make_file({{"a", "F32", "[2,3]", bytes_of(std::vector<float>{1, 2, 3, 4, 5, 6.5f})},
                    {"ids", "I64", "[3]", bytes_of(std::vector<int64_t>{-1, 7, 1LL << 40})},
                    {"h", "BF16", "[4]", bytes_of(std::vector<uint16_t>{0x3F80, 0xC020, 0x0000, 0x7F80})},
                    {"f", "F16", "[3]", bytes_of(std::vector<uint16_t>{0x3C00, 0x0001, 0xC000})},
                    {"s", "I32", "[]", bytes_of(std::vector<int32_t>{42})},
                    {"z", "U32", "[0,4]", ""}},
                   kMeta);
}

std::string check_valid(const fs::path& dir) {
  const fs::path p = dir / "valid.kdtr";
  write(p, valid_file());
  kdt::SafetensorsFile f;
  if (f.open(p.string()) != KDT_OK) return f.error();
  if (f.check_kdtr("tree_build") != KDT_OK) return f.error();
  if (f.tensors().size() != 6) return "expected 6 tensors, got " + std::to_string(f.tensors().size());
  const kdt::TensorInfo* a = f.find("a");
  if (!a || a->dtype != kdt::DType::F32 || a->shape != std::vector<int64_t>{2, 3} || a->nbytes() != 24)
    return "tensor a: wrong info";
  std::vector<float> fa, fh, ff;
  std::vector<int64_t> ids;
  std::vector<int32_t> s;
  std::vector<uint32_t> z;
  if (f.read_f32("a", &fa) || f.read_as("ids", kdt::DType::I64, &ids) || f.read_f32("h", &fh) ||
      f.read_f32("f", &ff) || f.read_as("s", kdt::DType::I32, &s) || f.read_as("z", kdt::DType::U32, &z))
    return f.error();
  if (same("a", fa, {1, 2, 3, 4, 5, 6.5f}).size() + same("ids", ids, {-1, 7, 1LL << 40}).size() +
          same("h", fh, {1.0f, -2.5f, 0.0f, INFINITY}).size() +
          same("f", ff, {1.0f, 5.9604644775390625e-08f, -2.0f}).size() + same("s", s, {42}).size() +
          same("z", z, {}).size())
    return "values read back differ";
  if (f.meta("kernel") != "tree_build" || f.meta("nope", "x") != "x") return "metadata wrong";
  // Wrong-dtype reads are errors naming both dtypes.
  if (f.read_as("a", kdt::DType::I32, &s) != KDT_ERR_FORMAT || f.error().find("F32") == std::string::npos)
    return "reading F32 as I32: '" + f.error() + "'";
  if (f.read_f32("ids", &fa) != KDT_ERR_FORMAT) return "read_f32 of I64 did not fail";
  if (f.check_kdtr("tree_accept") != KDT_ERR_FORMAT) return "check_kdtr accepted the wrong kernel";
  int64_t v = 0;
  if (f.case_int("bs", &v) != KDT_ERR_FORMAT || f.error().find("no key \"bs\"") == std::string::npos)
    return "case_int on an empty case: '" + f.error() + "'";
  const fs::path c = dir / "case.kdtr";
  write(c, make_file({{"a", "F32", "[1]", bytes_of(std::vector<float>{1})}},
                     "{\"case\":\"{\\\"name\\\":\\\"x\\\",\\\"l\\\":[1,2],\\\"bs\\\":17,"
                     "\\\"neg\\\":-3,\\\"f\\\":1.5}\"}"));
  if (f.open(c.string()) != KDT_OK) return f.error();
  if (f.case_int("bs", &v) != KDT_OK || v != 17) return "case_int(bs): " + f.error();
  if (f.case_int("neg", &v) != KDT_OK || v != -3) return "case_int(neg): " + f.error();
  if (f.case_int("f", &v) != KDT_ERR_FORMAT || f.error().find("not an integer") == std::string::npos)
    return "case_int(f) of 1.5: '" + f.error() + "'";
  if (f.case_int("name", &v) != KDT_ERR_FORMAT) return "case_int(name) of a string did not fail";
  return "";
}

// The reader's limits, reached exactly, are accepted, and opening is linear: the largest file
// the limits allow (65536 tensors, 4096 metadata keys, rank 8) opens in well under a second
// (the reader was quadratic in the tensor count: 40k tensors took seconds).
std::string check_limits(const fs::path& dir) {
  const fs::path p = dir / "limits.kdtr";
  write(p, many_zero_tensors(kdt::kMaxTensors, kdt::kMaxMetadataKeys));
  kdt::SafetensorsFile f;
  const auto t0 = std::chrono::steady_clock::now();
  if (f.open(p.string()) != KDT_OK) return f.error();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (f.tensors().size() != kdt::kMaxTensors || f.metadata().size() != kdt::kMaxMetadataKeys)
    return "the file at the limits read back wrong";
  const kdt::TensorInfo* t = f.find("t65535");
  if (!t || t->name != "t65535" || t->shape != std::vector<int64_t>{0, 7}) return "find(t65535) failed";
  std::printf("limits: %zu tensors and %zu metadata keys opened in %.3f s\n", f.tensors().size(),
              f.metadata().size(), secs);
  if (secs > 1.0) return "opening the file at the limits took " + std::to_string(secs) + " s (quadratic?)";
  write(p, make_file({{"a", "F32", "[1,1,1,1,1,1,1,2]", bytes_of(std::vector<float>{1, 2})}}, ""));
  if (f.open(p.string()) != KDT_OK) return "rank 8: " + f.error();
  return "";
}

std::string check_defects(const fs::path& dir) {
  const std::string f32 = bytes_of(std::vector<float>{1, 2});
  struct Defect { const char* name; std::string content; const char* needle; };
  std::string deep(40, '[');
  const std::vector<Defect> defects = {
      {"short", std::string("\x05\x00\x00", 3), "truncated"},
      {"huge_header", std::string("\x00\x00\x00\x00\x00\x01\x00\x00", 8) + "{}", "100 MB limit"},
      {"header_past_end", std::string("\x40\x00\x00\x00\x00\x00\x00\x00", 8) + "{}", "exceeds"},
      {"bad_json", raw_file("{\"a\": [1, 2", ""), "malformed JSON"},
      {"json_garbage", raw_file("{\"a\":{\"dtype\":\"F32\",,}}", ""), "malformed JSON"},
      {"not_object", raw_file("[1,2]   ", ""), "not an object"},
      {"deep", raw_file(deep, ""), "nesting"},
      {"unknown_dtype", make_file({{"a", "F128", "[2]", f32}}, ""), "unknown dtype"},
      {"shape_mismatch", make_file({{"a", "F32", "[3]", f32}}, ""), "give 12 bytes"},
      {"negative_dim", make_file({{"a", "F32", "[-2]", f32}}, ""), "non-negative"},
      {"huge_shape", make_file({{"a", "F32", "[4611686018427387904,8]", f32}}, ""), "overflow"},
      {"out_of_range", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", f32),
       "past the data section"},
      {"backwards", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", f32),
       "backwards"},
      {"overlap", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                           "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", f32),
       "overlap"},
      {"gap", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", f32), "gap"},
      {"trailing", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", f32),
       "trailing bytes"},
      {"duplicate", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                             "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", f32),
       "twice"},
      {"missing_field", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", f32), "missing data_offsets"},
      {"extra_field", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", f32),
       "unknown field"},
      {"meta_not_string", make_file({{"a", "F32", "[2]", f32}}, "{\"k\":3}"), "is not a string"},
      {"rank9", make_file({{"a", "F32", "[1,1,1,1,1,1,1,1,2]", f32}}, ""), "8 dimensions"},
      {"field_twice", raw_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"shape\":[2],\"data_offsets\":[0,8]}}", f32),
       "\"shape\" appears twice"},
      {"metadata_twice", raw_file("{\"__metadata__\":{},\"__metadata__\":{}}", ""), "__metadata__ appears twice"},
      {"too_many_tensors", many_zero_tensors(kdt::kMaxTensors + 1, 0), "65536 tensors"},
      {"too_many_metadata_keys", many_zero_tensors(1, kdt::kMaxMetadataKeys + 1), "4096 keys"},
  };
  for (const Defect& d : defects) {
    const fs::path p = dir / (std::string(d.name) + ".kdtr");
    write(p, d.content);
    kdt::SafetensorsFile f;
    const kdt_status s = f.open(p.string());
    if (s != KDT_ERR_FORMAT) return std::string(d.name) + ": status " + std::to_string((int)s) + ", expected 5";
    if (f.error().find(d.needle) == std::string::npos || f.error().find(p.string()) == std::string::npos)
      return std::string(d.name) + ": error '" + f.error() + "' lacks the path or '" + d.needle + "'";
  }
  kdt::SafetensorsFile f;
  const std::string missing = (dir / "does_not_exist.kdtr").string();
  if (f.open(missing) != KDT_ERR_IO || f.error().find(missing) == std::string::npos)
    return "missing file: '" + f.error() + "'";
  const fs::path stale = dir / "stale.kdtr";
  write(stale, make_file({{"a", "F32", "[2]", f32}}, "{\"format\":\"kdtr\",\"version\":\"0\",\"kernel\":\"x\"}"));
  if (f.open(stale.string()) != KDT_OK) return f.error();
  if (f.check_kdtr("x") != KDT_ERR_FORMAT || f.error().find("regenerate") == std::string::npos)
    return "stale version: '" + f.error() + "'";
  return "";
}

// Random corruptions of a valid file: open must return OK or an error with a message, and a
// file that opens must read back every tensor without crashing.
std::string fuzz(const fs::path& dir, std::mt19937_64& rng, int iterations) {
  const std::string good = valid_file();
  const fs::path p = dir / "fuzz.kdtr";
  int opened = 0;
  for (int it = 0; it < iterations; ++it) {
    std::string s = good;
    switch (rng() % 5) {
      case 0: s.resize(rng() % s.size()); break;  // truncate
      case 1: for (int k = 0, m = 1 + (int)(rng() % 8); k < m; ++k) s[rng() % s.size()] = (char)(rng() & 0xFF); break;
      case 2: for (int k = 0, m = 1 + (int)(rng() % 4); k < m; ++k) {  // flip header characters to JSON-ish ones
                const char pool[] = "{}[]\",:0123456789-eE. \\u";
                s[8 + rng() % (s.size() > 8 ? std::min<size_t>(s.size() - 8, 400) : 1)] = pool[rng() % (sizeof pool - 1)];
              } break;
      case 3: for (int k = 0; k < 8; ++k) s[k] = (char)(rng() & 0xFF); break;  // header length
      case 4: s.insert(8 + rng() % 300, std::string(1 + rng() % 5, "0123456789"[rng() % 10])); break;
    }
    write(p, s);
    kdt::SafetensorsFile f;
    const kdt_status st = f.open(p.string());
    if (st != KDT_OK) {
      if (f.error().empty()) return "iteration " + std::to_string(it) + ": failure without a message";
      continue;
    }
    ++opened;
    for (const kdt::TensorInfo& t : f.tensors()) {
      std::vector<char> buf((size_t)t.nbytes());
      if (f.read_raw(t.name, buf.data(), buf.size()) != KDT_OK)
        return "iteration " + std::to_string(it) + ": opened but read_raw(" + t.name + ") failed: " + f.error();
      std::vector<float> fl;
      f.read_f32(t.name, &fl);  // may refuse a non-float dtype; must not crash
    }
  }
  std::printf("fuzz: %d of %d corrupted files still opened (harmless mutations)\n", opened, iterations);
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  Harness h(argc, argv);
  const fs::path dir = fs::temp_directory_path() / ("kdt_reader_test_" + std::to_string(h.seed));
  fs::create_directories(dir);
  std::mt19937_64 rng(h.seed);
  h.run("valid_file", [&] { return check_valid(dir); });
  h.run("defects_named", [&] { return check_defects(dir); });
  h.run("limits_accepted_linear_time", [&] { return check_limits(dir); });
  h.run("fuzz_corrupted_files", [&] { return fuzz(dir, rng, 1500); });
  if (h.bundles.empty()) {
    h.skip("bundles_open", "no --bundles DIR given");
  } else {
    std::error_code ec;
    int count = 0;
    for (const auto& kd : fs::directory_iterator(h.bundles, ec)) {
      if (!kd.is_directory()) continue;
      const std::string kernel = kd.path().filename().string();
      for (const auto& e : fs::directory_iterator(kd.path(), ec)) {
        if (e.path().extension() != ".kdtr") continue;
        ++count;
        h.run("bundle/" + kernel + "/" + stem(e.path().string()), [&] {
          kdt::SafetensorsFile f;
          if (f.open(e.path().string()) != KDT_OK || f.check_kdtr(kernel) != KDT_OK) return f.error();
          for (const kdt::TensorInfo& t : f.tensors()) {
            std::vector<char> buf((size_t)t.nbytes());
            if (f.read_raw(t.name, buf.data(), buf.size()) != KDT_OK) return f.error();
          }
          return std::string();
        });
      }
    }
    if (count == 0)
      h.run("bundles_open", [&] { return "no *.kdtr files under " + h.bundles + " (python -m engine.kdtr generate --out DIR)"; });
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  return h.finish();
}
