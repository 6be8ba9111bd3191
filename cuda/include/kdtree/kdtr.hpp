// kdtr.hpp: a strict, bounds-checked reader for safetensors files: KDTR test bundles
// (ARCHITECTURE.md "KDTR bundles") and the engine's weights.
//
// File layout (safetensors): u64 little-endian header length H, then H bytes of UTF-8 JSON
// (an object: tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
// "__metadata__" object of string -> string), then the data section. Offsets are relative to the
// data section; tensors must tile it exactly (sorted by offset: the first starts at 0, each
// starts where the previous ended, the last ends at the end of the file), as the safetensors
// library itself requires.
//
// Every defect is an error that names the file and the defect (truncated file, header length
// too large, malformed JSON, unknown dtype, shape / byte-count mismatch, offsets out of range,
// overlapping or leaving gaps, duplicate names, a limit below exceeded); nothing crashes or
// throws. Tensor data is read on demand (the header is parsed once), so weight files of any size
// can be opened.
//
// A header is untrusted input (ARCHITECTURE.md "Trust boundary"): opening one takes time linear
// in its size (names are hashed; the tensors are sorted once) and memory bounded by the header
// plus the limits below, whatever the header holds.
//
//   kdt::SafetensorsFile f;
//   if (f.open(path) != KDT_OK) { fprintf(stderr, "%s\n", f.error().c_str()); ... }
//   const kdt::TensorInfo* t = f.find("top_logp");      // dtype, shape, nbytes
//   std::vector<float> lp; f.read_f32("top_logp", &lp);   // F32, or BF16 / F16 widened to F32
//   std::vector<int64_t> ids; f.read_as("top_ids", kdt::DType::I64, &ids);
//   std::string kernel = f.meta("kernel");
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "kdtree/kdtree.h"

namespace kdt {

// Limits of the reader (a file over one is refused with an error naming the limit). Generous:
// a DeepSeek-V3 shard holds ~1-2 thousand tensors of rank <= 3; a KDTR bundle holds ~20 tensors
// and 5 metadata keys.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the safetensors library's own limit
constexpr size_t kMaxTensors = 65536;               // tensors in one file
constexpr size_t kMaxRank = 8;                      // dimensions of one tensor
constexpr size_t kMaxMetadataKeys = 4096;           // keys of __metadata__
constexpr int kMaxJsonDepth = 16;                   // nesting (a valid header needs 3)

enum class DType { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };

// "F32" -> DType::F32; returns false for an unknown name.
KDT_API bool dtype_from_name(const std::string& name, DType* out);
KDT_API const char* dtype_name(DType d);
KDT_API size_t dtype_size(DType d);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // row-major; [] is a scalar (one element)
  uint64_t begin = 0, end = 0; // byte offsets in the data section
  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= (uint64_t)d;
    return n;
  }
  uint64_t nbytes() const { return end - begin; }
};

class KDT_API SafetensorsFile {
 public:
  SafetensorsFile() = default;

  // Reads and validates the header. KDT_ERR_IO when the file cannot be opened or read,
  // KDT_ERR_FORMAT for a malformed file; error() then says which file and what is wrong.
  kdt_status open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }
  // Tensors in data-section order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The metadata string for key, or fallback when absent.
  std::string meta(const std::string& key, const std::string& fallback = "") const;
  bool has_meta(const std::string& key) const { return metadata_.count(key) != 0; }
  // The integer `key` of a KDTR bundle's `case` metadata (a JSON object); KDT_ERR_FORMAT, with
  // error() naming the file and the key, when `case` is not a JSON object or the key is absent
  // or not an integer in [-2^63, 2^63).
  kdt_status case_int(const std::string& key, int64_t* out);
  // For KDTR bundles: checks format == "kdtr", version == "1" and kernel == `kernel`; the
  // error says how to regenerate a stale bundle.
  kdt_status check_kdtr(const std::string& kernel);

  // Copies a tensor's raw bytes into dst (dst_bytes must equal its nbytes).
  kdt_status read_raw(const std::string& name, void* dst, size_t dst_bytes);
  // Reads a tensor whose dtype must be `want` (an error names both dtypes otherwise) into out,
  // which must have the element size of `want`.
  template <class T>
  kdt_status read_as(const std::string& name, DType want, std::vector<T>* out) {
    const TensorInfo* t = lookup(name, want, sizeof(T));
    if (!t) return KDT_ERR_FORMAT;
    out->resize((size_t)t->numel());
    return read_raw(name, out->data(), out->size() * sizeof(T));
  }
  // Reads an F32, BF16 or F16 tensor as float32 (BF16 and F16 widen exactly).
  kdt_status read_f32(const std::string& name, std::vector<float>* out);

 private:
  kdt_status open_header();
  const TensorInfo* lookup(const std::string& name, DType want, size_t elem_size);
  kdt_status fail(kdt_status s, const std::string& what);

  std::string path_, error_;
  uint64_t file_size_ = 0, data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

}  // namespace kdt
