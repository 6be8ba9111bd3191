// json_lexer.h: the minimal JSON lexer behind the strict safetensors / KDTR reader
// (kdtr_reader.cpp, its only includer).
//
// The header is read in two passes over the same bytes, neither of which builds a tree:
//  1. check(): the whole header must be well-formed JSON, at most kMaxJsonDepth deep, with at
//     most max_values values and no array longer than max_array (allocates nothing);
//  2. SafetensorsFile::open walks the (now known to be well-formed) header with the schema in
//     mind, storing each tensor straight into a TensorInfo, and refuses a shape as soon as it
//     is longer than kMaxRank, before allocating more.
// Memory is therefore the header plus O(tensors * kMaxRank), and time is linear in the header.
#pragma once

#include <cstddef>
#include <cstring>
#include <string>

#include "kdtree/kdtr.hpp"

namespace kdt {
namespace json {

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

}  // namespace json
}  // namespace kdt
