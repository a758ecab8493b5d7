#pragma once
/// Tensor element types (numbered like GGML so GGUF files map 1:1) and block sizes.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tandem {

/// GGML tensor type ids as stored in GGUF tensor infos.
enum class ggml_type : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  bf16 = 30,
};

/// Q8_0: blocks of 32 int8 values with one f16 scale (34 bytes).
inline constexpr int q8_0_block = 32;
struct block_q8_0 {
  uint16_t d;  ///< scale, IEEE half bits
  int8_t qs[q8_0_block];
};
static_assert(sizeof(block_q8_0) == 34);

/// Name of a type ("f32", "q8_0", ...), "unknown" for unsupported ids.
constexpr std::string_view to_string(ggml_type t) {
  switch (t) {
    case ggml_type::f32: return "f32";
    case ggml_type::f16: return "f16";
    case ggml_type::q4_0: return "q4_0";
    case ggml_type::q4_1: return "q4_1";
    case ggml_type::q5_0: return "q5_0";
    case ggml_type::q5_1: return "q5_1";
    case ggml_type::q8_0: return "q8_0";
    case ggml_type::bf16: return "bf16";
  }
  return "unknown";
}

/// True for the types Tandem can compute with (f32, f16, bf16, q8_0).
constexpr bool is_supported(ggml_type t) {
  return t == ggml_type::f32 || t == ggml_type::f16 || t == ggml_type::bf16 || t == ggml_type::q8_0;
}

/// Bytes needed for `n` elements of type `t` (n must be a multiple of the block size
/// for block types); 0 for unsupported types.
constexpr size_t row_bytes(ggml_type t, int64_t n) {
  switch (t) {
    case ggml_type::f32: return size_t(n) * 4;
    case ggml_type::f16:
    case ggml_type::bf16: return size_t(n) * 2;
    case ggml_type::q8_0: return size_t(n / q8_0_block) * sizeof(block_q8_0);
    default: return 0;
  }
}

/// A read-only view of a weight tensor (usually pointing into an mmapped GGUF).
/// ne[0] is the innermost (contiguous) dimension, as in GGML.
struct tensor_view {
  ggml_type type = ggml_type::f32;
  int64_t ne[4] = {1, 1, 1, 1};
  int n_dims = 0;
  const void* data = nullptr;
  size_t nbytes = 0;

  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  int64_t cols() const { return ne[0]; }
  const uint8_t* row(int64_t i) const {
    return static_cast<const uint8_t*>(data) + size_t(i) * row_bytes(type, ne[0]);
  }
};

}  // namespace tandem
