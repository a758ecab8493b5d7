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
  q4_K = 12,
  q5_K = 13,
  q6_K = 14,
  bf16 = 30,
};

/// Q8_0: blocks of 32 int8 values with one f16 scale (34 bytes).
inline constexpr int q8_0_block = 32;
struct block_q8_0 {
  uint16_t d;  ///< scale, IEEE half bits
  int8_t qs[q8_0_block];
};
static_assert(sizeof(block_q8_0) == 34);

/// Q4_0: blocks of 32 4-bit values q with one f16 scale d: x = d * (q - 8). qs[j] holds
/// element j in its low nibble and element j + 16 in its high nibble (18 bytes).
inline constexpr int q4_0_block = 32;
struct block_q4_0 {
  uint16_t d;  ///< scale, IEEE half bits
  uint8_t qs[q4_0_block / 2];
};
static_assert(sizeof(block_q4_0) == 18);

/// Elements per super-block of the k-quants (ggml's QK_K).
inline constexpr int qk_k = 256;

/// Q4_K: super-blocks of 256 in 8 sub-blocks of 32, each with a 6-bit scale sc and min m:
/// x = d * sc * q - dmin * m for 4-bit q (144 bytes). scales packs the 8 (sc, m) pairs
/// (ggml's get_scale_min_k4); qs[32 g + l] holds element 64 g + l in its low nibble and
/// 64 g + 32 + l in its high nibble.
struct block_q4_K {
  uint16_t d;     ///< super-block scale of the scales, IEEE half bits
  uint16_t dmin;  ///< super-block scale of the mins, IEEE half bits
  uint8_t scales[12];
  uint8_t qs[qk_k / 2];
};
static_assert(sizeof(block_q4_K) == 144);

/// Q5_K: Q4_K with a fifth bit per value: bit 2g (element 64 g + l) and bit 2g + 1 (element
/// 64 g + 32 + l) of qh[l] add 16 to q (176 bytes).
struct block_q5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[qk_k / 8];
  uint8_t qs[qk_k / 2];
};
static_assert(sizeof(block_q5_K) == 176);

/// Q6_K: super-blocks of 256 in 16 sub-blocks of 16 with int8 scales: x = d * sc * (q - 32)
/// for 6-bit q (210 bytes). In half h (128 elements), with l < 32: ql[64 h + l] holds
/// elements 128 h + l (low nibble) and + 64 (high), ql[64 h + 32 + l] elements + 32 and + 96;
/// qh[32 h + l] bits 0-1, 2-3, 4-5, 6-7 are the top two bits of + 0, + 32, + 64, + 96.
struct block_q6_K {
  uint8_t ql[qk_k / 2];
  uint8_t qh[qk_k / 4];
  int8_t scales[qk_k / 16];
  uint16_t d;
};
static_assert(sizeof(block_q6_K) == 210);

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
    case ggml_type::q4_K: return "q4_K";
    case ggml_type::q5_K: return "q5_K";
    case ggml_type::q6_K: return "q6_K";
    case ggml_type::bf16: return "bf16";
  }
  return "unknown";
}

/// True for the types Tandem can compute with (f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K).
constexpr bool is_supported(ggml_type t) {
  switch (t) {
    case ggml_type::f32:
    case ggml_type::f16:
    case ggml_type::bf16:
    case ggml_type::q8_0:
    case ggml_type::q4_0:
    case ggml_type::q4_K:
    case ggml_type::q5_K:
    case ggml_type::q6_K: return true;
    default: return false;
  }
}

/// The supported types as a list for messages.
inline constexpr std::string_view supported_types_list = "f32, f16, bf16, q8_0, q4_0, q4_K, q5_K, q6_K";

/// Elements per block of a supported type (1 for f32/f16/bf16; 0 for unsupported types).
constexpr int64_t block_elems(ggml_type t) {
  switch (t) {
    case ggml_type::f32:
    case ggml_type::f16:
    case ggml_type::bf16: return 1;
    case ggml_type::q8_0:
    case ggml_type::q4_0: return 32;
    case ggml_type::q4_K:
    case ggml_type::q5_K:
    case ggml_type::q6_K: return qk_k;
    default: return 0;
  }
}

/// Bytes needed for `n` elements of type `t` (n must be a multiple of the block size
/// for block types); 0 for unsupported types.
constexpr size_t row_bytes(ggml_type t, int64_t n) {
  switch (t) {
    case ggml_type::f32: return size_t(n) * 4;
    case ggml_type::f16:
    case ggml_type::bf16: return size_t(n) * 2;
    case ggml_type::q8_0: return size_t(n / q8_0_block) * sizeof(block_q8_0);
    case ggml_type::q4_0: return size_t(n / q4_0_block) * sizeof(block_q4_0);
    case ggml_type::q4_K: return size_t(n / qk_k) * sizeof(block_q4_K);
    case ggml_type::q5_K: return size_t(n / qk_k) * sizeof(block_q5_K);
    case ggml_type::q6_K: return size_t(n / qk_k) * sizeof(block_q6_K);
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
