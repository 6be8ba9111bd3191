// kdtr_reader.cpp: the strict safetensors / KDTR reader declared in kdtree/kdtr.hpp.
// The JSON header is checked by a small recursive-descent lexer (depth-limited, so hostile
// nesting cannot overflow the stack; see json_lexer.h for the two passes and their bounds).
#include "kdtree/kdtr.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common.h"
#include "json_lexer.h"

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

// Every value a valid header can hold: per tensor its object, dtype, shape and its dims, the
// offsets and their two numbers; plus __metadata__ and its strings. More is refused unread.
constexpr size_t kMaxHeaderValues =
    1 + kMaxTensors * (1 + 1 + (1 + kMaxRank) + 3) + 1 + kMaxMetadataKeys;

// A non-negative integer that fits in int64 (shape dims, offsets), from a number's source text;
// false otherwise.
bool as_u63(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 19) return false;
  uint64_t x = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    x = x * 10 + (uint64_t)(c - '0');
  }
  if (x > (uint64_t)INT64_MAX) return false;
  *out = x;
  return true;
}

// At most 40 characters of a value's text, for messages.
std::string excerpt(const std::string& s) { return s.size() <= 40 ? s : s.substr(0, 37) + "..."; }

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
  const kdt_status s = open_header();
  if (s != KDT_OK) {  // a refused file leaves nothing half-read behind
    tensors_.clear();
    index_.clear();
    metadata_.clear();
  }
  return s;
}

kdt_status SafetensorsFile::open_header() {
  tensors_.clear();
  index_.clear();
  metadata_.clear();
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path_.c_str(), "rb"));
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
  if (hlen > kMaxHeaderBytes)
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

  // Pass 1: well-formed, shallow, and small enough for the limits (nothing is allocated).
  std::string err;
  if (!json::Lexer(header.data(), header.size(), kMaxHeaderValues, kMaxRank).check(&err))
    return fail(KDT_ERR_FORMAT, err);

  // Pass 2: the schema. The JSON is well-formed now, so a failed eat() or string() below cannot
  // happen; they still return an error rather than trust pass 1.
  json::Lexer p(header.data(), header.size(), 0, 0);
  auto malformed = [&] { return fail(KDT_ERR_FORMAT, p.error()); };
  if (!p.peek('{')) return fail(KDT_ERR_FORMAT, "the JSON header is not an object");
  p.eat('{');
  bool seen_metadata = false;
  std::string name, field, text;
  if (p.peek('}')) p.eat('}');
  else for (;;) {
    if (!p.string(&name) || !p.eat(':')) return malformed();
    if (name == "__metadata__") {
      if (seen_metadata) return fail(KDT_ERR_FORMAT, "__metadata__ appears twice in the header");
      seen_metadata = true;
      if (!p.peek('{')) return fail(KDT_ERR_FORMAT, "__metadata__ is not an object");
      p.eat('{');
      if (p.peek('}')) p.eat('}');
      else for (;;) {
        std::string key, value;
        if (!p.string(&key) || !p.eat(':')) return malformed();
        if (!p.peek('"')) return fail(KDT_ERR_FORMAT, "__metadata__[\"" + key + "\"] is not a string");
        if (!p.string(&value)) return malformed();
        if (metadata_.size() == kMaxMetadataKeys)
          return fail(KDT_ERR_FORMAT, "__metadata__ has more than " + std::to_string(kMaxMetadataKeys) +
                                          " keys (the reader's limit)");
        if (!metadata_.emplace(key, std::move(value)).second)
          return fail(KDT_ERR_FORMAT, "__metadata__ has the key \"" + key + "\" twice");
        if (p.peek(',')) { p.eat(','); continue; }
        if (!p.eat('}')) return malformed();
        break;
      }
    } else {
      const std::string where = "tensor \"" + name + "\": ";
      if (tensors_.size() == kMaxTensors)
        return fail(KDT_ERR_FORMAT, "more than " + std::to_string(kMaxTensors) +
                                        " tensors (the reader's limit)");
      if (!index_.emplace(name, tensors_.size()).second)
        return fail(KDT_ERR_FORMAT, where + "appears twice in the header");
      if (!p.peek('{')) return fail(KDT_ERR_FORMAT, where + "entry is not an object");
      p.eat('{');
      TensorInfo t;
      t.name = name;
      bool has_dtype = false, has_shape = false, has_offsets = false;
      if (p.peek('}')) p.eat('}');
      else for (;;) {
        if (!p.string(&field) || !p.eat(':')) return malformed();
        bool* seen = field == "dtype" ? &has_dtype : field == "shape" ? &has_shape
                   : field == "data_offsets" ? &has_offsets : nullptr;
        if (!seen) return fail(KDT_ERR_FORMAT, where + "unknown field \"" + field + "\"");
        if (*seen) return fail(KDT_ERR_FORMAT, where + "field \"" + field + "\" appears twice");
        *seen = true;
        if (field == "dtype") {
          if (!p.peek('"')) return fail(KDT_ERR_FORMAT, where + "dtype is not a string");
          if (!p.string(&text)) return malformed();
          if (!dtype_from_name(text, &t.dtype))
            return fail(KDT_ERR_FORMAT, where + "unknown dtype \"" + excerpt(text) + "\"");
        } else if (field == "shape") {
          if (!p.peek('[')) return fail(KDT_ERR_FORMAT, where + "shape is not an array");
          p.eat('[');
          if (p.peek(']')) p.eat(']');
          else for (;;) {
            if (t.shape.size() == kMaxRank)  // pass 1 already refuses longer arrays
              return fail(KDT_ERR_FORMAT, where + "shape has more than " + std::to_string(kMaxRank) +
                                              " dimensions (the reader's limit)");
            uint64_t dim;
            if (!p.value_text(&text)) return malformed();
            if (!as_u63(text, &dim))
              return fail(KDT_ERR_FORMAT, where + "shape entry \"" + excerpt(text) +
                                              "\" is not a non-negative integer");
            t.shape.push_back((int64_t)dim);
            if (p.peek(',')) { p.eat(','); continue; }
            if (!p.eat(']')) return malformed();
            break;
          }
        } else {  // data_offsets
          bool ok = p.peek('[');
          std::string a, b;
          if (ok) {
            p.eat('[');
            ok = p.value_text(&a) && p.peek(',') && p.eat(',') && p.value_text(&b) && p.peek(']') &&
                 p.eat(']') && as_u63(a, &t.begin) && as_u63(b, &t.end);
          }
          if (!ok)
            return fail(KDT_ERR_FORMAT, where + "data_offsets is not [begin, end] of non-negative integers");
        }
        if (p.peek(',')) { p.eat(','); continue; }
        if (!p.eat('}')) return malformed();
        break;
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
      tensors_.push_back(std::move(t));
    }
    if (p.peek(',')) { p.eat(','); continue; }
    if (!p.eat('}')) return malformed();
    break;
  }

  // The tensors must tile the data section: no overlap, no gap, nothing left over.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
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
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

kdt_status SafetensorsFile::case_int(const std::string& key, int64_t* out) {
  const std::string where = "metadata case";
  const std::string c = meta("case");
  std::string err;
  // The case is a small flat object; its arrays (e.g. prefix_lens) may be longer than a shape.
  if (!json::Lexer(c.data(), c.size(), 1u << 16, 0).check(&err))
    return fail(KDT_ERR_FORMAT, where + " is not JSON: " + err);
  json::Lexer p(c.data(), c.size(), 0, 0);
  if (!p.peek('{')) return fail(KDT_ERR_FORMAT, where + " is not a JSON object");
  p.eat('{');
  std::string k, text;
  if (!p.peek('}')) for (;;) {
    if (!p.string(&k) || !p.eat(':') || !p.value_text(&text)) return fail(KDT_ERR_FORMAT, where + ": " + p.error());
    if (k == key) {
      const bool neg = !text.empty() && text[0] == '-';
      uint64_t mag;
      if (!as_u63(neg ? text.substr(1) : text, &mag))
        return fail(KDT_ERR_FORMAT, where + "[\"" + key + "\"] = " + excerpt(text) + " is not an integer");
      *out = neg ? -(int64_t)mag : (int64_t)mag;
      return KDT_OK;
    }
    if (p.peek(',')) { p.eat(','); continue; }
    break;
  }
  return fail(KDT_ERR_FORMAT, where + " has no key \"" + key + "\"");
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
