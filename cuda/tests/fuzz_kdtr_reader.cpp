// fuzz_kdtr_reader: a self-contained mutational fuzzer for the KDTR / safetensors reader
// (kdtree/kdtr.hpp), meant to be built with -fsanitize=address,undefined (no libFuzzer: g++
// has none). tests/test_kdtr_fuzz.py builds and runs it; cuda/build.sh builds a plain copy,
// whose --open mode the regression tests time.
//
//   fuzz_kdtr_reader --seeds DIR [--iterations N] [--seed S] [--work DIR] [--max-seed-bytes B]
//   fuzz_kdtr_reader --open FILE
//
// --seeds: every *.kdtr / *.safetensors under DIR (the golden bundles, at most B bytes each,
// default 256 KiB) plus a small built-in file are the seeds. Each iteration takes a seed and
// applies byte mutations (flips, header length edits, truncation, JSON-ish characters) or a
// structural one on the parsed header (a tensor given twice, huge or negative dims, long shape
// lists, offsets out of range, overlaps, deep nesting, many tensors, bad escapes, metadata
// defects), writes it and opens it. Required of every outcome: no sanitizer report and no crash;
// a refusal is KDT_ERR_FORMAT with a message that starts with the path; a file that opens obeys
// the reader's contract (limits, tensors tiling the data section, find() by name, read_raw
// returning exactly the file's bytes). Prints the counts (tried, accepted, refused by reason)
// and exits 0, or prints the violation with the seed to rerun and exits 1.
//
// --open: opens one file, prints "ok <tensors> tensors in <s> s" or "refused in <s> s: <error>";
// exit 0 either way (2 on bad usage).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kdtree/kdtr.hpp"

namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void spit(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(s.data(), (std::streamsize)s.size());
}

std::string le64(uint64_t h) {
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k) out[k] = (char)((h >> (8 * k)) & 0xFF);
  return out;
}

std::string quote(const std::string& s) {  // a JSON string (the names here are ASCII)
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

// A header as editable JSON fragments: tensors in data order, each field's raw JSON text.
struct Entry {
  std::string key, dtype, shape, offsets, extra;  // extra: raw ",\"k\":v" text inside the object
};
struct Doc {
  std::string meta;  // raw JSON of __metadata__, or "" for none
  std::vector<Entry> entries;
  std::string data;
  std::string tail;  // raw text after the last entry, inside the top-level object
};

std::string assemble(const Doc& d) {
  std::string h = "{";
  if (!d.meta.empty()) h += "\"__metadata__\":" + d.meta;
  for (const Entry& e : d.entries) {
    if (h.size() > 1) h += ",";
    h += e.key + ":{";
    std::string body;
    if (!e.dtype.empty()) body += "\"dtype\":" + e.dtype;
    if (!e.shape.empty()) body += std::string(body.empty() ? "" : ",") + "\"shape\":" + e.shape;
    if (!e.offsets.empty()) body += std::string(body.empty() ? "" : ",") + "\"data_offsets\":" + e.offsets;
    h += body + e.extra + "}";
  }
  h += d.tail + "}";
  while (h.size() % 8) h += ' ';
  return le64(h.size()) + h + d.data;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::string offsets_text(uint64_t b, uint64_t e) {
  return "[" + std::to_string(b) + "," + std::to_string(e) + "]";
}

// The seed parsed by the reader itself (seeds are valid files), as a Doc.
bool to_doc(const fs::path& p, const std::string& bytes, Doc* d) {
  kdt::SafetensorsFile f;
  if (f.open(p.string()) != KDT_OK) return false;
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | (unsigned char)bytes[k];
  d->data = bytes.substr(8 + hlen);
  if (!f.metadata().empty()) {
    d->meta = "{";
    for (const auto& kv : f.metadata()) d->meta += (d->meta.size() > 1 ? "," : "") + quote(kv.first) + ":" + quote(kv.second);
    d->meta += "}";
  }
  for (const kdt::TensorInfo& t : f.tensors())
    d->entries.push_back({quote(t.name), quote(kdt::dtype_name(t.dtype)), shape_text(t.shape),
                          offsets_text(t.begin, t.end), ""});
  return true;
}

std::string nest(size_t depth, bool objects) {
  std::string s;
  for (size_t k = 0; k < depth; ++k) s += objects ? "{\"a\":" : "[";
  s += "1";
  for (size_t k = 0; k < depth; ++k) s += objects ? "}" : "]";
  return s;
}

// One structural mutation of d; returns its name.
std::string mutate_doc(Doc* d, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return (size_t)(rng() % std::max<size_t>(n, 1)); };
  const char* numbers[] = {"0", "1", "-1", "-0", "007", "1.5", "1e3", "+1", "9223372036854775807",
                           "9223372036854775808", "18446744073709551616", "4611686018427387904",
                           "99999999999999999999999999", "2147483648", "\"3\"", "true", "null", "[]", "{}"};
  const size_t n_numbers = sizeof numbers / sizeof *numbers;
  if (d->entries.empty()) d->entries.push_back({"\"x\"", "\"U8\"", "[0]", "[0,0]", ""});
  Entry& e = d->entries[pick(d->entries.size())];
  const uint64_t D = d->data.size();
  switch (rng() % 16) {
    case 0: d->entries.push_back(e); return "tensor twice";
    case 1: {  // same name, fresh bytes appended: only the name is wrong
      Entry c = e;
      d->data += std::string(4, 'x');
      c.dtype = "\"F32\""; c.shape = "[1]"; c.offsets = offsets_text(D, D + 4);
      d->entries.push_back(c);
      return "name twice";
    }
    case 2: {  // one dim replaced by an odd number
      std::string s = e.shape.size() > 2 ? e.shape.substr(1, e.shape.size() - 2) : "";
      e.shape = "[" + std::string(numbers[pick(n_numbers)]) + (s.empty() ? "" : "," + s) + "]";
      return "odd dim";
    }
    case 3: {  // a long shape list
      const size_t lens[] = {8, 9, 64, 100000};
      const size_t n = lens[pick(4)];
      std::string s = "[";
      for (size_t k = 0; k < n; ++k) s += k ? ",1" : "1";
      e.shape = s + "]";
      return "long shape";
    }
    case 4: {  // offsets out of range, backwards, overlapping, odd numbers
      const std::string vals[] = {"0", std::to_string(D), std::to_string(D + 1), std::to_string(D / 2),
                                  "18446744073709551615", numbers[pick(n_numbers)]};
      e.offsets = "[" + vals[pick(6)] + "," + vals[pick(6)] + "]";
      if (rng() % 4 == 0) e.offsets = rng() % 2 ? "[0]" : "[0,1,2]";
      return "offsets";
    }
    case 5: {  // deep nesting somewhere
      const size_t depths[] = {14, 15, 16, 17, 40, 5000};
      const std::string v = nest(depths[pick(6)], rng() % 2);
      switch (rng() % 5) {
        case 0: e.shape = v; break;
        case 1: e.dtype = v; break;
        case 2: d->meta = "{\"k\":" + v + "}"; break;
        case 3: e.offsets = v; break;
        default: d->tail = ",\"deep\":" + v; break;
      }
      return "deep nesting";
    }
    case 6: {  // many zero-size tensors at the end of the data section
      // up to the limit exactly (none when a first mutation already passed it: an unsigned
      // difference would wrap and push entries until memory runs out), and one past it
      const size_t have = d->entries.size();
      const size_t room = have < kdt::kMaxTensors ? kdt::kMaxTensors - have : 0;
      const size_t counts[] = {10, 1000, room, kdt::kMaxTensors + 1};
      const size_t n = counts[rng() % 20 == 0 ? 2 + pick(2) : pick(2)];
      for (size_t k = 0; k < n; ++k)
        d->entries.push_back({quote("z" + std::to_string(k)), "\"U8\"", "[0]", offsets_text(D, D), ""});
      return "many tensors";
    }
    case 7: {
      const char* dts[] = {"\"F128\"", "\"f32\"", "\"\"", "1", "null", "\"BOOL\"", "\"F8_E4M3\"", "\"U64\""};
      e.dtype = dts[pick(8)];
      return "dtype";
    }
    case 8:
      switch (rng() % 4) {
        case 0: e.dtype.clear(); break;
        case 1: e.shape.clear(); break;
        case 2: e.offsets.clear(); break;
        default: e.extra = rng() % 2 ? ",\"x\":1" : ",\"shape\":" + (e.shape.empty() ? "[]" : e.shape); break;
      }
      return "fields";
    case 9: {  // metadata defects
      const std::string ms[] = {"{\"k\":3}", "{\"k\":\"a\",\"k\":\"b\"}", "[]", "\"x\"", "{}",
                                "{\"format\":\"kdtr\",\"case\":\"{\\\"bs\\\":1}\"}"};
      d->meta = ms[pick(6)];
      if (rng() % 3 == 0) d->tail = ",\"__metadata__\":{}";
      return "metadata";
    }
    case 10: {  // many metadata keys
      const size_t n = rng() % 2 ? 100 : kdt::kMaxMetadataKeys + 1;
      d->meta = "{";
      for (size_t k = 0; k < n; ++k) d->meta += (k ? ",\"m" : "\"m") + std::to_string(k) + "\":\"v\"";
      d->meta += "}";
      return "many metadata keys";
    }
    case 11: {  // escapes and odd characters in a name
      const std::string names[] = {"\"a\\u0000b\"", "\"\\ud800\"", "\"\\x\"", "\"a\\", "\"tab\there\"",
                                   "\"\\u12\"", "\"\\\"q\\\"\"", "\"\xff\xfe\""};
      e.key = names[pick(8)];
      return "escapes";
    }
    case 12: {  // a huge dim times zero, and overflowing products
      const std::string shapes[] = {"[0,9223372036854775807]", "[4294967296,4294967296]",
                                    "[3037000500,3037000500]", "[9223372036854775807,0,2]"};
      e.shape = shapes[pick(4)];
      return "huge shape";
    }
    case 13:  // trailing or missing pieces of the top-level object
      d->tail = rng() % 2 ? ",\"t\":{}" : ",";
      return "tail";
    case 14:  // entries that are not objects
      e.key += ":1,\"y\"";
      return "not an object";
    default:  // drop or swap data
      if (!d->data.empty()) d->data.resize(pick(d->data.size()));
      return "data size";
  }
}

// One byte-level mutation of s.
void mutate_bytes(std::string* s, std::mt19937_64& rng) {
  if (s->empty()) { *s = std::string(8, '\0'); return; }
  const size_t hspan = s->size() > 8 ? std::min<size_t>(s->size() - 8, 4096) : 1;
  switch (rng() % 6) {
    case 0: s->resize(rng() % s->size()); break;
    case 1:
      for (int k = 0, m = 1 + (int)(rng() % 8); k < m; ++k) (*s)[rng() % s->size()] ^= (char)(1u << (rng() % 8));
      break;
    case 2: {
      const char pool[] = "{}[]\",:0123456789-eE. \\u";
      for (int k = 0, m = 1 + (int)(rng() % 4); k < m && s->size() > 8; ++k)
        (*s)[8 + rng() % hspan] = pool[rng() % (sizeof pool - 1)];
      break;
    }
    case 3: {  // header length: random, off by a little, huge
      uint64_t h = 0;
      for (int k = 7; k >= 0 && s->size() >= 8; --k) h = (h << 8) | (unsigned char)(*s)[k];
      const uint64_t vals[] = {rng(), h + 1, h - 1, h + 8, 0, 1, 2, kdt::kMaxHeaderBytes, kdt::kMaxHeaderBytes + 1,
                               (uint64_t)s->size(), ~0ull};
      const std::string b = le64(vals[rng() % 11]);
      if (s->size() < 8) s->resize(8);
      s->replace(0, 8, b);
      break;
    }
    case 4: s->insert(std::min(s->size(), (size_t)(8 + rng() % hspan)), std::string(1 + rng() % 5, "0123456789"[rng() % 10])); break;
    default: s->erase(std::min(s->size(), (size_t)(8 + rng() % hspan)), 1 + rng() % 16); break;
  }
}

// The reader's contract for a file that opened; "" or the violation.
std::string check_accepted(kdt::SafetensorsFile& f, const std::string& bytes) {
  uint64_t hlen = 0;
  for (int k = 7; k >= 0; --k) hlen = (hlen << 8) | (unsigned char)bytes[k];
  const uint64_t data_start = 8 + hlen, data_size = bytes.size() - data_start;
  if (hlen > kdt::kMaxHeaderBytes || data_start > bytes.size()) return "opened with a bad header length";
  if (f.tensors().size() > kdt::kMaxTensors) return "more tensors than the limit";
  if (f.metadata().size() > kdt::kMaxMetadataKeys) return "more metadata keys than the limit";
  uint64_t expect = 0;
  std::set<std::string> names;
  for (const kdt::TensorInfo& t : f.tensors()) {
    if (t.shape.size() > kdt::kMaxRank) return "tensor " + t.name + ": rank over the limit";
    if (!names.insert(t.name).second) return "tensor " + t.name + " listed twice";
    if (t.begin != expect || t.end < t.begin) return "tensor " + t.name + ": does not tile the data section";
    expect = t.end;
    unsigned __int128 n = kdt::dtype_size(t.dtype);
    for (int64_t dim : t.shape) {
      if (dim < 0) return "tensor " + t.name + ": negative dim";
      n *= (uint64_t)dim;  // < 2^127: saturated at 2^64 below
      if (n > ((unsigned __int128)1 << 64)) n = (unsigned __int128)1 << 64;
    }
    if (n != t.nbytes()) return "tensor " + t.name + ": nbytes differs from the shape";
    if (f.find(t.name) != &t) return "find(" + t.name + ") does not return the tensor";
    std::string buf((size_t)t.nbytes(), '\0');
    if (f.read_raw(t.name, buf.data(), buf.size()) != KDT_OK) return "read_raw(" + t.name + "): " + f.error();
    if (buf != bytes.substr((size_t)(data_start + t.begin), (size_t)t.nbytes())) return "read_raw(" + t.name + ") bytes differ";
    std::vector<float> fl;
    const kdt_status s = f.read_f32(t.name, &fl);
    const bool floaty = t.dtype == kdt::DType::F32 || t.dtype == kdt::DType::BF16 || t.dtype == kdt::DType::F16;
    if ((s == KDT_OK) != floaty) return "read_f32(" + t.name + ") status " + std::to_string((int)s);
  }
  if (expect != data_size) return "tensors do not cover the data section";
  if (f.find("\x01no such tensor") != nullptr) return "find() of an absent name";
  return "";
}

// A refusal's reason with numbers, quoted names and characters blanked, for the counts.
std::string reason(const std::string& err, const std::string& path) {
  std::string r = err.substr(std::min(err.size(), path.size() + 2)), out;
  if (r.rfind("tensor \"", 0) == 0 && r.find("\": ") != std::string::npos) r = "tensor: " + r.substr(r.find("\": ") + 3);
  char quote_char = 0;
  for (size_t i = 0; i < r.size() && out.size() < 70; ++i) {
    const char c = r[i];
    if (quote_char) { if (c == quote_char) quote_char = 0; continue; }
    if (c == '"' || c == '\'') { quote_char = c; out += c; out += '_'; out += c; continue; }
    if (c >= '0' && c <= '9') { if (out.empty() || out.back() != 'N') out += 'N'; continue; }
    if (c == '(') break;
    out += c;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

std::string builtin_seed() {
  Doc d;
  d.meta = "{\"format\":\"kdtr\",\"version\":\"1\",\"kernel\":\"tree_build\",\"case\":\"{\\\"bs\\\":1}\"}";
  const float f[3] = {1.f, 2.f, 3.f};
  d.data.assign(reinterpret_cast<const char*>(f), sizeof f);
  d.data += std::string("\x80\x3f\x00\x40", 4) + std::string(8, '\x07');
  d.entries = {{"\"a\"", "\"F32\"", "[3]", "[0,12]", ""},
               {"\"h\"", "\"BF16\"", "[2,1]", "[12,16]", ""},
               {"\"i\"", "\"I64\"", "[]", "[16,24]", ""},
               {"\"z\"", "\"U8\"", "[0,5]", "[24,24]", ""}};
  return assemble(d);
}

int open_one(const char* path) {
  kdt::SafetensorsFile f;
  const auto t0 = std::chrono::steady_clock::now();
  const kdt_status s = f.open(path);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s == KDT_OK) std::printf("ok %zu tensors in %.3f s\n", f.tensors().size(), secs);
  else std::printf("refused in %.3f s: %s\n", secs, f.error().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string seeds_dir, work, open_path;
  uint64_t seed = ((uint64_t)std::random_device{}() << 32) ^ std::random_device{}();
  long iterations = 3000;
  size_t max_seed_bytes = 256 << 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has = i + 1 < argc;
    if (a == "--seeds" && has) seeds_dir = argv[++i];
    else if (a == "--iterations" && has) iterations = std::strtol(argv[++i], nullptr, 10);
    else if (a == "--seed" && has) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--work" && has) work = argv[++i];
    else if (a == "--max-seed-bytes" && has) max_seed_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--open" && has) open_path = argv[++i];
    else {
      std::fprintf(stderr, "error: fuzz_kdtr_reader: unknown argument '%s' (see the header of "
                           "cuda/tests/fuzz_kdtr_reader.cpp)\n", a.c_str());
      return 2;
    }
  }
  if (!open_path.empty()) return open_one(open_path.c_str());

  const fs::path dir = work.empty() ? fs::temp_directory_path() / ("kdt_fuzz_" + std::to_string(seed)) : fs::path(work);
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path file = dir / "mutant.kdtr";
  std::vector<std::pair<std::string, std::string>> seeds;  // name, bytes
  seeds.emplace_back("builtin", builtin_seed());
  size_t too_big = 0;
  if (!seeds_dir.empty())
    for (const auto& e : fs::recursive_directory_iterator(seeds_dir, ec)) {
      const auto ext = e.path().extension();
      if (!e.is_regular_file() || (ext != ".kdtr" && ext != ".safetensors")) continue;
      if (e.file_size() > max_seed_bytes) { ++too_big; continue; }
      seeds.emplace_back(e.path().string(), slurp(e.path()));
    }
  std::sort(seeds.begin() + 1, seeds.end());
  std::vector<Doc> docs(seeds.size());
  std::vector<bool> parsed(seeds.size());
  for (size_t k = 0; k < seeds.size(); ++k) {
    spit(file, seeds[k].second);
    parsed[k] = to_doc(file, seeds[k].second, &docs[k]);
    if (!parsed[k]) {
      std::printf("FAIL: seed file %s does not open\n", seeds[k].first.c_str());
      return 1;
    }
  }
  std::printf("fuzz_kdtr_reader: seed %llu, %ld iterations, %zu seed files (%zu over %zu bytes left out)\n"
              "  rerun: fuzz_kdtr_reader --seeds %s --iterations %ld --seed %llu\n",
              (unsigned long long)seed, iterations, seeds.size(), too_big, max_seed_bytes,
              seeds_dir.empty() ? "DIR" : seeds_dir.c_str(), iterations, (unsigned long long)seed);
  std::fflush(stdout);

  std::mt19937_64 rng(seed);
  long accepted = 0, refused = 0;
  std::map<std::string, long> reasons, kinds_ok, kinds_refused;
  const auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iterations; ++it) {
    const size_t k = rng() % seeds.size();
    std::string bytes, kind;
    if (rng() % 2) {
      Doc d = docs[k];
      kind = mutate_doc(&d, rng);
      if (rng() % 3 == 0) kind += " + " + mutate_doc(&d, rng);
      bytes = assemble(d);
      if (rng() % 4 == 0) { mutate_bytes(&bytes, rng); kind += " + bytes"; }
    } else {
      bytes = seeds[k].second;
      kind = "bytes";
      for (int m = 0, n = 1 + (int)(rng() % 3); m < n; ++m) mutate_bytes(&bytes, rng);
    }
    spit(file, bytes);
    kdt::SafetensorsFile f;
    const kdt_status s = f.open(file.string());
    std::string bad;
    if (s == KDT_OK) {
      ++accepted;
      ++kinds_ok[kind];
      bad = check_accepted(f, bytes);
    } else {
      ++refused;
      ++kinds_refused[kind];
      if (s != KDT_ERR_FORMAT) bad = "refused with status " + std::to_string((int)s) + ", expected KDT_ERR_FORMAT";
      else if (f.error().rfind(file.string() + ": ", 0) != 0) bad = "error does not start with the path: '" + f.error() + "'";
      else if (!f.tensors().empty() || !f.metadata().empty()) bad = "a refused file left tensors or metadata behind";
      else ++reasons[reason(f.error(), file.string())];
    }
    if (!bad.empty()) {
      const fs::path keep = dir / ("failure_" + std::to_string(it) + ".kdtr");
      spit(keep, bytes);
      std::printf("FAIL: iteration %ld (%s, seed file %s): %s\n  the file: %s\n  rerun: --seed %llu --iterations %ld\n",
                  it, kind.c_str(), seeds[k].first.c_str(), bad.c_str(), keep.string().c_str(),
                  (unsigned long long)seed, iterations);
      return 1;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fs::remove(file, ec);
  if (work.empty()) fs::remove_all(dir, ec);
  std::printf("fuzz_kdtr_reader: %ld files tried in %.1f s: %ld accepted, %ld refused\n", iterations, secs,
              accepted, refused);
  std::vector<std::pair<long, std::string>> byn;
  for (const auto& r : reasons) byn.emplace_back(r.second, r.first);
  std::sort(byn.rbegin(), byn.rend());
  for (const auto& r : byn) std::printf("  refused %6ld  %s\n", r.first, r.second.c_str());
  for (const auto& m : kinds_ok) std::printf("  accepted %5ld  mutation: %s\n", m.second, m.first.c_str());
  std::printf("FUZZ_RESULT tried=%ld accepted=%ld refused=%ld seconds=%.1f\n", iterations, accepted, refused, secs);
  return 0;
}
