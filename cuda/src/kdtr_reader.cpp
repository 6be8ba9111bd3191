// kdtr_reader.cpp: the strict safetensors / KDTR reader declared in kdtree/kdtr.hpp.
// The JSON header is checked by a small recursive-descent lexer (depth-limited, so hostile
// nesting cannot overflow the stack; see Lexer for the two passes and their bounds).
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

// ---- a minimal JSON lexer -----------------------------------------------------------------
// The header is read in two passes over the same bytes, neither of which builds a tree:
//  1. check(): the whole header must be well-formed JSON, at most kMaxJsonDepth deep, with at
//     most max_values values and no array longer than max_array (allocates nothing);
//  2. SafetensorsFile::open walks the (now known to be well-formed) header with the schema in
//     mind, storing each tensor straight into a TensorInfo, and refuses a shape as soon as it
//     is longer than kMaxRank, before allocating more.
// Memory is therefore the header plus O(tensors * kMaxRank), and time is linear in the header.
class Lexer {
 public:
  Lexer(const char* s, size_t n, size_t max_values, size_t max_array)
      : s_(s), n_(n), max_values_(max_values), max_array_(max_array) {}

  bool check(std::string* err) {
    if (!skip_value(0)) { *err = err_; return false; }
    ws();
    if (i_ != n_) { *err = at("trailing characters after the JSON object"); return false; }
    return true;
  }
  const std::string& error() const { return err_; }

  void ws() { while (i_ < n_ && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_; }
  // Skips whitespace; true when the next character is c.
  bool peek(char c) { ws(); return i_ < n_ && s_[i_] == c; }
  bool eat(char c) {
    if (!peek(c)) return fail(std::string("expected '") + c + "'");
    ++i_;
    return true;
  }
  // A string (the next character must be '"') into out, or skipped when out is null.
  bool string(std::string* out) {
    if (!peek('"')) return fail("expected a string");
    ++i_;  // opening quote
    if (out) out->clear();
    auto put = [out](char c) { if (out) out->push_back(c); };
    while (i_ < n_) {
      const unsigned char c = (unsigned char)s_[i_++];
      if (c == '"') return true;
      if (c < 0x20) return fail("control character inside a string");
      if (c != '\\') { put((char)c); continue; }
      if (i_ >= n_) break;
      const char e = s_[i_++];
      switch (e) {
        case '"': put('"'); break;
        case '\\': put('\\'); break;
        case '/': put('/'); break;
        case 'b': put('\b'); break;
        case 'f': put('\f'); break;
        case 'n': put('\n'); break;
        case 'r': put('\r'); break;
        case 't': put('\t'); break;
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
          if (cp < 0x80) put((char)cp);
          else if (cp < 0x800) { put((char)(0xC0 | (cp >> 6))); put((char)(0x80 | (cp & 0x3F))); }
          else { put((char)(0xE0 | (cp >> 12))); put((char)(0x80 | ((cp >> 6) & 0x3F))); put((char)(0x80 | (cp & 0x3F))); }
          break;
        }
        default: return fail(std::string("bad escape '\\") + e + "'");
      }
    }
    return fail("unterminated string");
  }
  // Skips one value of any kind; *text is its source text (for numbers: the number itself).
  bool value_text(std::string* text) {
    ws();
    const size_t b = i_;
    if (!skip_value(0)) return false;
    text->assign(s_ + b, i_ - b);
    return true;
  }
  // Skips one value, validating it (see check()).
  bool skip_value(int depth) {
    if (depth > kMaxJsonDepth) return fail("nesting deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    if (max_values_ && ++values_ > max_values_)
      return over_limit("more than " + std::to_string(max_values_) + " JSON values (" +
                  std::to_string(kMaxTensors) + " tensors of rank <= " + std::to_string(kMaxRank) +
                  " need fewer)");
    ws();
    if (i_ >= n_) return fail("unexpected end of header");
    const char c = s_[i_];
    if (c == '{') return skip_object(depth);
    if (c == '[') return skip_array(depth);
    if (c == '"') return string(nullptr);
    if (c == 't') return lit("true");
    if (c == 'f') return lit("false");
    if (c == 'n') return lit("null");
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    return fail(std::string("unexpected character '") + c + "'");
  }
  std::string at(const std::string& what) const {
    return "malformed JSON header at byte " + std::to_string(i_) + ": " + what;
  }

 private:
  bool fail(const std::string& what) { err_ = at(what); return false; }
  // A limit of the reader, not a syntax error.
  bool over_limit(const std::string& what) {
    err_ = "header refused at byte " + std::to_string(i_) + ": " + what;
    return false;
  }
  bool lit(const char* w) {
    const size_t k = std::strlen(w);
    if (n_ - i_ < k || std::memcmp(s_ + i_, w, k) != 0) return fail("unexpected token");
    i_ += k;
    return true;
  }
  bool number() {
    const size_t b = i_;
    if (s_[i_] == '-') ++i_;
    while (i_ < n_ && ((s_[i_] >= '0' && s_[i_] <= '9') || s_[i_] == '.' || s_[i_] == 'e' ||
                       s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
    if (i_ == b || (i_ == b + 1 && s_[b] == '-')) return fail("malformed number");
    return true;
  }
  bool skip_array(int depth) {
    ++i_;
    ws();
    if (i_ < n_ && s_[i_] == ']') { ++i_; return true; }
    for (size_t count = 1;; ++count) {
      if (max_array_ && count > max_array_)
        return over_limit("an array longer than " + std::to_string(max_array_) +
                    " elements (a shape has at most " + std::to_string(kMaxRank) +
                    " dimensions, data_offsets 2 entries)");
      if (!skip_value(depth + 1)) return false;
      ws();
      if (i_ >= n_) return fail("unterminated array");
      if (s_[i_] == ',') { ++i_; continue; }
      if (s_[i_] == ']') { ++i_; return true; }
      return fail("expected ',' or ']' in an array");
    }
  }
  bool skip_object(int depth) {
    ++i_;
    ws();
    if (i_ < n_ && s_[i_] == '}') { ++i_; return true; }
    for (;;) {
      ws();
      if (i_ >= n_ || s_[i_] != '"') return fail("expected a string key in an object");
      if (!string(nullptr)) return false;
      ws();
      if (i_ >= n_ || s_[i_] != ':') return fail("expected ':' after a key");
      ++i_;
      if (!skip_value(depth + 1)) return false;
      ws();
      if (i_ >= n_) return fail("unterminated object");
      if (s_[i_] == ',') { ++i_; continue; }
      if (s_[i_] == '}') { ++i_; return true; }
      return fail("expected ',' or '}' in an object");
    }
  }

  const char* s_;
  size_t n_, i_ = 0;
  size_t max_values_, max_array_, values_ = 0;
  std::string err_;
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
  if (!Lexer(header.data(), header.size(), kMaxHeaderValues, kMaxRank).check(&err))
    return fail(KDT_ERR_FORMAT, err);

  // Pass 2: the schema. The JSON is well-formed now, so a failed eat() or string() below cannot
  // happen; they still return an error rather than trust pass 1.
  Lexer p(header.data(), header.size(), 0, 0);
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
  if (!Lexer(c.data(), c.size(), 1u << 16, 0).check(&err))
    return fail(KDT_ERR_FORMAT, where + " is not JSON: " + err);
  Lexer p(c.data(), c.size(), 0, 0);
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
