#pragma once
/// Plain reference code for the 4-6 bit block formats (llama.cpp's q4_0, q4_K, q5_K, q6_K,
/// laid out bit for bit as ggml stores them, see kernels/tensor.h): decoding to f32 and
/// quantizing from f32 (make-model). The matmul kernels (quant_matmul.h) never decode to
/// f32; tests check them against these.
#include <cstdint>
#include <vector>

#include "kernels/tensor.h"

namespace tandem::cpu {

/// Whether `t` is one of the 4-6 bit block formats (q4_0, q4_K, q5_K, q6_K).
constexpr bool is_low_bit(ggml_type t) {
  return t == ggml_type::q4_0 || t == ggml_type::q4_K || t == ggml_type::q5_K || t == ggml_type::q6_K;
}

/// Whether quant_matmul computes `t` (integer dot products with int8 activations): the
/// low-bit types and q8_0, as llama.cpp computes them.
constexpr bool int8_matmul(ggml_type t) { return is_low_bit(t) || t == ggml_type::q8_0;
}

/// Scale and min of sub-block j (0..7) of a q4_K / q5_K block's 12 packed bytes
/// (ggml's get_scale_min_k4): 6 bits each.
inline void k4_scale_min(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/// Decodes `n` elements (a multiple of the type's block) of one row of a low-bit type.
void dequantize_row_q4_0(const block_q4_0* b, float* out, int64_t n);
void dequantize_row_q4_K(const block_q4_K* b, float* out, int64_t n);
void dequantize_row_q5_K(const block_q5_K* b, float* out, int64_t n);
void dequantize_row_q6_K(const block_q6_K* b, float* out, int64_t n);

/// Any supported type's row (f32, f16, bf16, q8_0 and the above) decoded one element at a
/// time; tandem::error for another type or a length the block does not divide. The GGUF
/// fuzz target's decoder (kernels/cpu/ops.h's dequantize_row is the fast one).
void dequantize_row_ref(ggml_type t, const void* row, float* out, int64_t n);

/// Quantizes `n` floats (a multiple of the block) into blocks: q4_0 as ggml's reference
/// (scale from the value of largest magnitude, mapped to -8); q4_K and q5_K search each
/// sub-block's scale and min for the least weighted squared error (as ggml's
/// make_qkx2_quants); q6_K picks each sub-block's symmetric scale by a search over nearby
/// scales (as ggml's make_qx_quants). The format is exact; the chosen codes may differ from
/// llama.cpp's in rare ties.
void quantize_row_q4_0(const float* x, block_q4_0* out, int64_t n);
void quantize_row_q4_K(const float* x, block_q4_K* out, int64_t n);
void quantize_row_q5_K(const float* x, block_q5_K* out, int64_t n);
void quantize_row_q6_K(const float* x, block_q6_K* out, int64_t n);
/// q8_0 as ggml's quantize_row_q8_0_ref: d = max|x| / 127, codes round(x / d).
void quantize_row_q8_0(const float* x, block_q8_0* out, int64_t n);

/// Quantizes rows of `cols` floats to type `t` (one of int8_matmul's): row_bytes(t, cols)
/// bytes per row. Throws tandem::error for another type or a row length that is not a
/// multiple of the block.
std::vector<uint8_t> quantize_rows(ggml_type t, const float* x, int64_t rows, int64_t cols);

}  // namespace tandem::cpu
