#pragma once
/// GGUF (spec v3, also reads v2) reader and writer.
/// The reader validates every length and offset against the file size, so it can be
/// fed hostile bytes (see `file::parse`, the fuzz entry point).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/tensor.h"

namespace tandem::gguf {

/// GGUF metadata value types (numbering from the spec).
enum class value_type : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};

struct value;
/// A metadata array; `elem_type` is the declared element type.
struct array_value {
  value_type elem_type = value_type::u8;
  std::vector<value> items;
};

/// One metadata value.
struct value {
  value_type type = value_type::u8;
  std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<array_value>> v;

  /// Numeric accessors convert between integer types; they throw gguf::error on
  /// a type that is not numeric (or a negative value read as unsigned).
  uint64_t as_u64() const;
  int64_t as_i64() const;
  double as_f64() const;
  bool as_bool() const;
  const std::string& as_string() const;
  const array_value& as_array() const;
};

/// Thrown for malformed or truncated files and for missing/mistyped keys; the message
/// names the file, the key or tensor, the offset where relevant, and what to do.
class error : public tandem::error {
 public:
  explicit error(const std::string& m) : tandem::error(error_kind::failed, m) {}
};

/// One tensor of the file. `data` points into the file's bytes.
struct tensor_info {
  std::string name;
  std::vector<int64_t> dims;  ///< ne[0] first (innermost)
  ggml_type type = ggml_type::f32;
  uint64_t offset = 0;        ///< relative to the start of the data section
  const void* data = nullptr;
  size_t nbytes = 0;

  /// A view for the kernels (throws if the type is not supported for compute).
  tensor_view view() const;
};

/// Limits applied while parsing so hostile input cannot make us allocate without bound.
struct parse_limits {
  uint64_t max_kv = 1u << 16;
  uint64_t max_tensors = 1u << 16;
  uint64_t max_string_bytes = 1u << 20;
  uint64_t max_array_items = 1u << 24;
  uint32_t max_array_depth = 4;
};

/// A parsed GGUF file. Move-only; owns its mmap when opened from a path.
class file {
 public:
  /// mmaps and parses `path`. Throws gguf::error.
  static file open(const std::string& path, const parse_limits& lim = {});
  /// Parses bytes owned by the caller (they must outlive the file). Throws gguf::error.
  static file parse(std::span<const uint8_t> bytes, const parse_limits& lim = {},
                    std::string name = "<memory>");

  file(file&&) noexcept;
  file& operator=(file&&) noexcept;
  ~file();

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& name() const { return name_; }

  /// Metadata in file order.
  const std::vector<std::pair<std::string, value>>& metadata() const { return kv_; }
  /// nullptr if absent.
  const value* find(std::string_view key) const;
  /// Typed getters: throw gguf::error naming the key if absent or mistyped.
  uint64_t get_u64(std::string_view key) const;
  uint32_t get_u32(std::string_view key) const;
  float get_f32(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const array_value& get_array(std::string_view key) const;
  /// Getters with a default when the key is absent (still throw if mistyped).
  uint64_t get_u64_or(std::string_view key, uint64_t def) const;
  float get_f32_or(std::string_view key, float def) const;

  const std::vector<tensor_info>& tensors() const { return tensors_; }
  /// nullptr if absent.
  const tensor_info* find_tensor(std::string_view name) const;
  /// Throws gguf::error naming the tensor if absent.
  const tensor_info& tensor(std::string_view name) const;

 private:
  file() = default;
  struct mapping;
  std::unique_ptr<mapping> map_;
  std::string name_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<std::pair<std::string, value>> kv_;
  std::vector<tensor_info> tensors_;
  friend class parser;
};

/// Builds a GGUF v3 file in memory and writes it.
class writer {
 public:
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_string(const std::string& key, const std::string& v);
  void set_array_string(const std::string& key, const std::vector<std::string>& v);
  void set_array_f32(const std::string& key, const std::vector<float>& v);
  void set_array_i32(const std::string& key, const std::vector<int32_t>& v);
  /// Any value, including nested arrays (replaces an existing key, keeping its position).
  /// Setting `general.alignment` (u32 power of two) also changes the data alignment.
  void set_value(const std::string& key, value v);
  /// `dims` innermost first; `data` must hold row_bytes(type, dims[0]) * rows bytes.
  void add_tensor(const std::string& name, ggml_type type, std::vector<int64_t> dims,
                  std::vector<uint8_t> data);
  /// Writes the file (throws tandem::error on I/O failure).
  void write(const std::string& path) const;
  /// The serialized bytes.
  std::vector<uint8_t> bytes() const;

 private:
  struct entry { std::string key; value val; };
  struct tensor_entry { std::string name; ggml_type type; std::vector<int64_t> dims; std::vector<uint8_t> data; };
  std::vector<entry> kv_;
  std::vector<tensor_entry> tensors_;
  uint64_t alignment_ = 32;
};

}  // namespace tandem::gguf
