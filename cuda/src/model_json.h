// model_json.h: a small strict JSON reader for config.json and safetensors headers.
//
// Only what the engine needs: objects, arrays, strings (with \uXXXX escapes kept as UTF-8),
// numbers (as double), true/false/null. Errors throw JsonError with the byte offset; callers
// inside the engine catch it and turn it into a kdt_status naming the file.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace kdt {
namespace json {

struct JsonError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0.0;
  std::string str;
  std::vector<Value> arr;
  std::map<std::string, Value> obj;

  bool is_null() const { return kind == Null; }
  // Object member or nullptr when absent (or when this is not an object).
  const Value* get(const std::string& key) const {
    if (kind != Object) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &it->second;
  }
};

class Parser {
 public:
  Parser(const char* data, size_t size) : p_(data), begin_(data), end_(data + size) {}

  Value parse_document() {
    Value v = parse_value(0);
    skip_ws();
    if (p_ != end_) fail("trailing characters after the JSON value");
    return v;
  }

 private:
  const char* p_;
  const char* begin_;
  const char* end_;

  [[noreturn]] void fail(const char* what) const {
    throw JsonError(std::string(what) + " at byte " + std::to_string(p_ - begin_));
  }
  void skip_ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t')) ++p_;
  }
  bool consume(char c) {
    skip_ws();
    if (p_ < end_ && *p_ == c) { ++p_; return true; }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail((std::string("expected '") + c + "'").c_str());
  }
  bool literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (size_t(end_ - p_) >= n && std::string(p_, n) == word) { p_ += n; return true; }
    return false;
  }

  Value parse_value(int depth) {
    if (depth > 64) fail("nesting deeper than 64");
    skip_ws();
    if (p_ >= end_) fail("unexpected end of input");
    Value v;
    char c = *p_;
    if (c == '{') {
      ++p_;
      v.kind = Value::Object;
      if (consume('}')) return v;
      do {
        skip_ws();
        if (p_ >= end_ || *p_ != '"') fail("expected a string key");
        std::string key = parse_string();
        expect(':');
        v.obj[key] = parse_value(depth + 1);
      } while (consume(','));
      expect('}');
    } else if (c == '[') {
      ++p_;
      v.kind = Value::Array;
      if (consume(']')) return v;
      do { v.arr.push_back(parse_value(depth + 1)); } while (consume(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Value::String;
      v.str = parse_string();
    } else if (literal("true")) {
      v.kind = Value::Bool; v.b = true;
    } else if (literal("false")) {
      v.kind = Value::Bool; v.b = false;
    } else if (literal("null")) {
      v.kind = Value::Null;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Value::Number;
      v.num = parse_number();
    } else if (literal("NaN") || literal("Infinity") || literal("-Infinity")) {
      fail("NaN / Infinity are not JSON");
    } else {
      fail("unexpected character");
    }
    return v;
  }

  double parse_number() {
    const char* start = p_;
    if (p_ < end_ && *p_ == '-') ++p_;
    while (p_ < end_ && ((*p_ >= '0' && *p_ <= '9') || *p_ == '.' || *p_ == 'e' || *p_ == 'E' ||
                         *p_ == '+' || *p_ == '-'))
      ++p_;
    std::string text(start, p_);
    char* stop = nullptr;
    double d = std::strtod(text.c_str(), &stop);
    if (stop != text.c_str() + text.size() || text.empty()) fail("malformed number");
    return d;
  }

  static void put_utf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += char(cp);
    } else if (cp < 0x800) {
      s += char(0xC0 | (cp >> 6)); s += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += char(0xE0 | (cp >> 12)); s += char(0x80 | ((cp >> 6) & 0x3F));
      s += char(0x80 | (cp & 0x3F));
    } else {
      s += char(0xF0 | (cp >> 18)); s += char(0x80 | ((cp >> 12) & 0x3F));
      s += char(0x80 | ((cp >> 6) & 0x3F)); s += char(0x80 | (cp & 0x3F));
    }
  }
  uint32_t parse_hex4() {
    if (end_ - p_ < 4) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      char h = *p_++;
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') cp |= uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') cp |= uint32_t(h - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return cp;
  }
  std::string parse_string() {
    ++p_;  // opening quote
    std::string s;
    while (true) {
      if (p_ >= end_) fail("unterminated string");
      char c = *p_++;
      if (c == '"') break;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') { s += c; continue; }
      if (p_ >= end_) fail("unterminated escape");
      char e = *p_++;
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {  // surrogate pair
            if (end_ - p_ < 6 || p_[0] != '\\' || p_[1] != 'u') fail("lone high surrogate");
            p_ += 2;
            uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          put_utf8(s, cp);
          break;
        }
        default: fail("unknown escape");
      }
    }
    return s;
  }
};

inline Value parse(const std::string& text) {
  return Parser(text.data(), text.size()).parse_document();
}

}  // namespace json
}  // namespace kdt
