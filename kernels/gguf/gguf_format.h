#pragma once
// Wire-format facts of GGUF shared by the reader (gguf.cpp) and the writer (gguf_writer.cpp).
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/gguf/gguf.h"

namespace tandem::gguf::format {

inline constexpr uint32_t gguf_magic = 0x46554747u;  // "GGUF" little-endian
inline constexpr uint32_t max_dims = 4;

inline std::string value_type_name(value_type t) {
  switch (t) {
    case value_type::u8: return "u8";
    case value_type::i8: return "i8";
    case value_type::u16: return "u16";
    case value_type::i16: return "i16";
    case value_type::u32: return "u32";
    case value_type::i32: return "i32";
    case value_type::f32: return "f32";
    case value_type::boolean: return "bool";
    case value_type::string: return "string";
    case value_type::array: return "array";
    case value_type::u64: return "u64";
    case value_type::i64: return "i64";
    case value_type::f64: return "f64";
  }
  return "type " + std::to_string(uint32_t(t));
}

/// Fixed wire size of a scalar type, 0 for string/array/unknown.
inline size_t scalar_size(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::boolean: return 1;
    case value_type::u16:
    case value_type::i16: return 2;
    case value_type::u32:
    case value_type::i32:
    case value_type::f32: return 4;
    case value_type::u64:
    case value_type::i64:
    case value_type::f64: return 8;
    default: return 0;
  }
}

inline bool valid_value_type(uint32_t t) { return t <= uint32_t(value_type::f64); }

inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }


}  // namespace tandem::gguf::format
