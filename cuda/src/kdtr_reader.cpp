// kdtr_reader.cpp: the strict safetensors / KDTR reader declared in kdtree/kdtr.hpp.
// The JSON header is parsed by a small recursive-descent parser (depth-limited, so hostile
// nesting cannot overflow the stack) that keeps only what safetensors headers contain.
#include "kdtree/kdtr.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common.h"

namespace kdt {

namespace {

struct DTypeName {
  DType d;
  const char* name;
  size_t size;
};
constexpr DTypeName kDTypes[] = {
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},   {DType::I8, "I8", 1},
    {DType::F8_E5M2, "F8_E5M2", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::I16, "I16", 2},
    {DType::U16, "U16", 2},   {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::I32, "I32", 4},   {DType::U32, "U32", 4}, {DType::F32, "F32", 4},
    {DType::I64, "I64", 8},   {DType::U64, "U64", 8}, {DType::F64, "F64", 8},
};

constexpr uint64_t kMaxHeader = 100ull << 20;  // the safetensors library's own limit (100 MB)
constexpr int kMaxDepth = 16;

// ---- a minimal JSON value and parser ------------------------------------------------------
struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  std::string str;                                   // String; Number keeps its source text
  std::vector<Json> items;                           // Array
  std::vector<std::pair<std::string, Json>> fields;  // Object, in file order
};

class Parser {
 public:
  Parser(const char* s, size_t n) : s_(s), n_(n) {}
  bool parse(Json* out, std::string* err) {
    if (!value(out, 0)) { *err = err_; return false; }
    ws();
    if (i_ != n_) { *err = at("trailing characters after the JSON object"); return false; }
    return true;
  }

 private:
  std::string at(const std::string& what) const {
    return "malformed JSON header at byte " + std::to_string(i_) + ": " + what;
  }
  bool fail(const std::string& what) { err_ = at(what); return false; }
  void ws() { while (i_ < n_ && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_; }
  bool lit(const char* w) {
    const size_t k = std::strlen(w);
    if (n_ - i_ < k || std::memcmp(s_ + i_, w, k) != 0) return fail("unexpected token");
    i_ += k;
    return true;
  }
  bool value(Json* v, int depth) {
    if (depth > kMaxDepth) return fail("nesting deeper than 16 levels");
    ws();
    if (i_ >= n_) return fail("unexpected end of header");
    const char c = s_[i_];
    if (c == '{') return object(v, depth);
    if (c == '[') return array(v, depth);
    if (c == '"') { v->kind = Json::String; return string(&v->str); }
    if (c == 't') { v->kind = Json::Bool; v->str = "true"; return lit("true"); }
    if (c == 'f') { v->kind = Json::Bool; v->str = "false"; return lit("false"); }
    if (c == 'n') { v->kind = Json::Null; return lit("null"); }
    if (c == '-' || (c >= '0' && c <= '9')) return number(v);
    return fail(std::string("unexpected character '") + c + "'");
  }
  bool number(Json* v) {
    const size_t b = i_;
    if (s_[i_] == '-') ++i_;
    while (i_ < n_ && ((s_[i_] >= '0' && s_[i_] <= '9') || s_[i_] == '.' || s_[i_] == 'e' ||
                       s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
    if (i_ == b || (i_ == b + 1 && s_[b] == '-')) return fail("malformed number");
    v->kind = Json::Number;
    v->str.assign(s_ + b, i_ - b);
    return true;
  }
  bool string(std::string* out) {
    ++i_;  // opening quote
    out->clear();
    while (i_ < n_) {
      const unsigned char c = (unsigned char)s_[i_++];
      if (c == '"') return true;
      if (c < 0x20) return fail("control character inside a string");
      if (c != '\\') { out->push_back((char)c); continue; }
      if (i_ >= n_) break;
      const char e = s_[i_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          if (n_ - i_ < 4) return fail("truncated \\u escape");
          unsigned cp = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            cp <<= 4;
            if (h >= '0' && h <= '9') cp |= (unsigned)(h - '0');
            else if (h >= 'a' && h <= 'f') cp |= (unsigned)(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') cp |= (unsigned)(h - 'A' + 10);
            else return fail("bad hex digit in \\u escape");
          }
          // Encode as UTF-8 (surrogate pairs are kept as two 3-byte sequences: names and
          // metadata of our files are ASCII; this only has to be safe, not pretty).
          if (cp < 0x80) out->push_back((char)cp);
          else if (cp < 0x800) { out->push_back((char)(0xC0 | (cp >> 6))); out->push_back((char)(0x80 | (cp & 0x3F))); }
          else { out->push_back((char)(0xE0 | (cp >> 12))); out->push_back((char)(0x80 | ((cp >> 6) & 0x3F))); out->push_back((char)(0x80 | (cp & 0x3F))); }
          break;
        }
        default: return fail(std::string("bad escape '\\") + e + "'");
      }
    }
    return fail("unterminated string");
  }
  bool array(Json* v, int depth) {
    v->kind = Json::Array;
    ++i_;
    ws();
    if (i_ < n_ && s_[i_] == ']') { ++i_; return true; }
    for (;;) {
      v->items.emplace_back();
      if (!value(&v->items.back(), depth + 1)) return false;
      ws();
      if (i_ >= n_) return fail("unterminated array");
      if (s_[i_] == ',') { ++i_; continue; }
      if (s_[i_] == ']') { ++i_; return true; }
      return fail("expected ',' or ']' in an array");
    }
  }
  bool object(Json* v, int depth) {
    v->kind = Json::Object;
    ++i_;
    ws();
    if (i_ < n_ && s_[i_] == '}') { ++i_; return true; }
    for (;;) {
      ws();
      if (i_ >= n_ || s_[i_] != '"') return fail("expected a string key in an object");
      std::string key;
      if (!string(&key)) return false;
      ws();
      if (i_ >= n_ || s_[i_] != ':') return fail("expected ':' after a key");
      ++i_;
      v->fields.emplace_back(std::move(key), Json());
      if (!value(&v->fields.back().second, depth + 1)) return false;
      ws();
      if (i_ >= n_) return fail("unterminated object");
      if (s_[i_] == ',') { ++i_; continue; }
      if (s_[i_] == '}') { ++i_; return true; }
      return fail("expected ',' or '}' in an object");
    }
  }

  const char* s_;
  size_t n_, i_ = 0;
  std::string err_;
};

// A non-negative integer that fits in int64 (shape dims, offsets); false otherwise.
bool as_u63(const Json& v, uint64_t* out) {
  if (v.kind != Json::Number || v.str.empty() || v.str.size() > 19) return false;
  uint64_t x = 0;
  for (char c : v.str) {
    if (c < '0' || c > '9') return false;
    x = x * 10 + (uint64_t)(c - '0');
  }
  if (x > (uint64_t)INT64_MAX) return false;
  *out = x;
  return true;
}

struct FileCloser {
  void operator()(std::FILE* f) const { if (f) std::fclose(f); }
};

float bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);  // inf / NaN
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;  // +-0
  else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

bool dtype_from_name(const std::string& name, DType* out) {
  for (const auto& d : kDTypes)
    if (name == d.name) { *out = d.d; return true; }
  return false;
}

const char* dtype_name(DType d) {
  for (const auto& e : kDTypes)
    if (e.d == d) return e.name;
  return "?";
}

size_t dtype_size(DType d) {
  for (const auto& e : kDTypes)
    if (e.d == d) return e.size;
  return 0;
}

kdt_status SafetensorsFile::fail(kdt_status s, const std::string& what) {
  error_ = path_ + ": " + what;
  return set_error(s, "kdtr", "%s", error_.c_str());
}

kdt_status SafetensorsFile::open(const std::string& path) {
  path_ = path;
  error_.clear();
  tensors_.clear();
  metadata_.clear();
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return fail(KDT_ERR_IO, std::string("cannot open: ") + std::strerror(errno));
  if (std::fseek(f.get(), 0, SEEK_END) != 0) return fail(KDT_ERR_IO, "cannot seek to the end");
  const long size = std::ftell(f.get());
  if (size < 0) return fail(KDT_ERR_IO, "cannot tell the file size");
  file_size_ = (uint64_t)size;
  if (file_size_ < 8)
    return fail(KDT_ERR_FORMAT, "truncated: " + std::to_string(file_size_) +
                                    " bytes, shorter than the 8-byte header length");
  std::rewind(f.get());
  unsigned char lenbuf[8];
  if (std::fread(lenbuf, 1, 8, f.get()) != 8) return fail(KDT_ERR_IO, "cannot read the header length");
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | lenbuf[k];  // little-endian
  if (hlen > kMaxHeader)
    return fail(KDT_ERR_FORMAT, "header length " + std::to_string(hlen) +
                                    " is larger than the 100 MB limit (corrupted length?)");
  if (hlen > file_size_ - 8)
    return fail(KDT_ERR_FORMAT, "header length " + std::to_string(hlen) + " exceeds the " +
                                    std::to_string(file_size_ - 8) +
                                    " bytes after the length field (truncated file?)");
  if (hlen < 2) return fail(KDT_ERR_FORMAT, "header length " + std::to_string(hlen) + " is too small for a JSON object");
  std::string header((size_t)hlen, '\0');
  if (std::fread(&header[0], 1, (size_t)hlen, f.get()) != hlen)
    return fail(KDT_ERR_IO, "cannot read the " + std::to_string(hlen) + "-byte header");
  data_start_ = 8 + hlen;
  const uint64_t data_size = file_size_ - data_start_;

  Json root;
  std::string err;
  if (!Parser(header.data(), header.size()).parse(&root, &err)) return fail(KDT_ERR_FORMAT, err);
  if (root.kind != Json::Object) return fail(KDT_ERR_FORMAT, "the JSON header is not an object");

  for (const auto& kv : root.fields) {
    const std::string& name = kv.first;
    const Json& v = kv.second;
    if (name == "__metadata__") {
      if (v.kind != Json::Object) return fail(KDT_ERR_FORMAT, "__metadata__ is not an object");
      for (const auto& m : v.fields) {
        if (m.second.kind != Json::String)
          return fail(KDT_ERR_FORMAT, "__metadata__[\"" + m.first + "\"] is not a string");
        if (!metadata_.emplace(m.first, m.second.str).second)
          return fail(KDT_ERR_FORMAT, "__metadata__ has the key \"" + m.first + "\" twice");
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\": ";
    if (v.kind != Json::Object) return fail(KDT_ERR_FORMAT, where + "entry is not an object");
    TensorInfo t;
    t.name = name;
    bool has_dtype = false, has_shape = false, has_offsets = false;
    for (const auto& fld : v.fields) {
      const Json& x = fld.second;
      if (fld.first == "dtype") {
        if (x.kind != Json::String) return fail(KDT_ERR_FORMAT, where + "dtype is not a string");
        if (!dtype_from_name(x.str, &t.dtype))
          return fail(KDT_ERR_FORMAT, where + "unknown dtype \"" + x.str + "\"");
        has_dtype = true;
      } else if (fld.first == "shape") {
        if (x.kind != Json::Array) return fail(KDT_ERR_FORMAT, where + "shape is not an array");
        for (const Json& d : x.items) {
          uint64_t dim;
          if (!as_u63(d, &dim))
            return fail(KDT_ERR_FORMAT, where + "shape entry \"" + d.str + "\" is not a non-negative integer");
          t.shape.push_back((int64_t)dim);
        }
        has_shape = true;
      } else if (fld.first == "data_offsets") {
        if (x.kind != Json::Array || x.items.size() != 2 || !as_u63(x.items[0], &t.begin) ||
            !as_u63(x.items[1], &t.end))
          return fail(KDT_ERR_FORMAT, where + "data_offsets is not [begin, end] of non-negative integers");
        has_offsets = true;
      } else {
        return fail(KDT_ERR_FORMAT, where + "unknown field \"" + fld.first + "\"");
      }
    }
    if (!has_dtype || !has_shape || !has_offsets)
      return fail(KDT_ERR_FORMAT, where + "missing " +
                                      (!has_dtype ? "dtype" : !has_shape ? "shape" : "data_offsets"));
    if (t.begin > t.end)
      return fail(KDT_ERR_FORMAT, where + "data_offsets [" + std::to_string(t.begin) + ", " +
                                      std::to_string(t.end) + "] run backwards");
    if (t.end > data_size)
      return fail(KDT_ERR_FORMAT, where + "data_offsets end " + std::to_string(t.end) +
                                      " is past the data section (" + std::to_string(data_size) +
                                      " bytes)");
    // numel * element size, with overflow checks (a hostile shape must not wrap around).
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d != 0 && bytes > UINT64_MAX / (uint64_t)d)
        return fail(KDT_ERR_FORMAT, where + "shape overflows 64-bit byte counts");
      bytes *= (uint64_t)d;
    }
    if (bytes != t.nbytes())
      return fail(KDT_ERR_FORMAT, where + "shape and dtype " + dtype_name(t.dtype) + " give " +
                                      std::to_string(bytes) + " bytes but data_offsets span " +
                                      std::to_string(t.nbytes()));
    for (const auto& o : tensors_)
      if (o.name == name) return fail(KDT_ERR_FORMAT, where + "appears twice in the header");
    tensors_.push_back(std::move(t));
  }

  // The tensors must tile the data section: no overlap, no gap, nothing left over.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const auto& t : tensors_) {
    if (t.begin < expect)
      return fail(KDT_ERR_FORMAT, "tensor \"" + t.name + "\": data_offsets [" +
                                      std::to_string(t.begin) + ", " + std::to_string(t.end) +
                                      "] overlap the previous tensor (which ends at " +
                                      std::to_string(expect) + ")");
    if (t.begin > expect)
      return fail(KDT_ERR_FORMAT, "tensor \"" + t.name + "\": data_offsets begin " +
                                      std::to_string(t.begin) + " leaves a gap after byte " +
                                      std::to_string(expect));
    expect = t.end;
  }
  if (expect != data_size)
    return fail(KDT_ERR_FORMAT, "the tensors cover " + std::to_string(expect) +
                                    " bytes of the " + std::to_string(data_size) +
                                    "-byte data section (trailing bytes or a truncated file)");
  return KDT_OK;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::string SafetensorsFile::meta(const std::string& key, const std::string& fallback) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? fallback : it->second;
}

kdt_status SafetensorsFile::check_kdtr(const std::string& kernel) {
  static const char* regen = " (regenerate: python -m engine.kdtr generate --out DIR)";
  if (meta("format") != "kdtr")
    return fail(KDT_ERR_FORMAT, "metadata format is \"" + meta("format") + "\", expected \"kdtr\"" + regen);
  if (meta("version") != "1")
    return fail(KDT_ERR_FORMAT, "metadata version \"" + meta("version") + "\", this reader reads 1" + regen);
  if (meta("kernel") != kernel)
    return fail(KDT_ERR_FORMAT, "metadata kernel \"" + meta("kernel") + "\", expected \"" + kernel + "\"");
  return KDT_OK;
}

const TensorInfo* SafetensorsFile::lookup(const std::string& name, DType want, size_t elem_size) {
  const TensorInfo* t = find(name);
  if (!t) { fail(KDT_ERR_FORMAT, "no tensor \"" + name + "\""); return nullptr; }
  if (t->dtype != want) {
    fail(KDT_ERR_FORMAT, "tensor \"" + name + "\" has dtype " + dtype_name(t->dtype) +
                             ", expected " + dtype_name(want));
    return nullptr;
  }
  if (dtype_size(want) != elem_size) {
    fail(KDT_ERR_INVALID_ARGUMENT, "tensor \"" + name + "\": read_as element size " +
                                       std::to_string(elem_size) + " != size of " + dtype_name(want));
    return nullptr;
  }
  return t;
}

kdt_status SafetensorsFile::read_raw(const std::string& name, void* dst, size_t dst_bytes) {
  const TensorInfo* t = find(name);
  if (!t) return fail(KDT_ERR_FORMAT, "no tensor \"" + name + "\"");
  if (dst_bytes != t->nbytes())
    return fail(KDT_ERR_INVALID_ARGUMENT, "tensor \"" + name + "\" has " +
                                              std::to_string(t->nbytes()) + " bytes, the buffer " +
                                              std::to_string(dst_bytes));
  if (dst_bytes == 0) return KDT_OK;
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path_.c_str(), "rb"));
  if (!f) return fail(KDT_ERR_IO, std::string("cannot reopen: ") + std::strerror(errno));
  // fseek takes a long: fine for files below 8 EB on LP64.
  if (std::fseek(f.get(), (long)(data_start_ + t->begin), SEEK_SET) != 0 ||
      std::fread(dst, 1, dst_bytes, f.get()) != dst_bytes)
    return fail(KDT_ERR_IO, "tensor \"" + name + "\": short read (the file changed since open?)");
  return KDT_OK;
}

kdt_status SafetensorsFile::read_f32(const std::string& name, std::vector<float>* out) {
  const TensorInfo* t = find(name);
  if (!t) return fail(KDT_ERR_FORMAT, "no tensor \"" + name + "\"");
  if (t->dtype == DType::F32) return read_as(name, DType::F32, out);
  if (t->dtype != DType::BF16 && t->dtype != DType::F16)
    return fail(KDT_ERR_FORMAT, "tensor \"" + name + "\" has dtype " + dtype_name(t->dtype) +
                                    ", expected F32, BF16 or F16");
  std::vector<uint16_t> half;
  const kdt_status s = read_as(name, t->dtype, &half);
  if (s != KDT_OK) return s;
  out->resize(half.size());
  const bool bf = t->dtype == DType::BF16;
  for (size_t i = 0; i < half.size(); ++i) (*out)[i] = bf ? bf16_to_f32(half[i]) : f16_to_f32(half[i]);
  return KDT_OK;
}

}  // namespace kdt
