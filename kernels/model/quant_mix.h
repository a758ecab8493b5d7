#pragma once
/// Which ggml type each weight of a make-model file gets: one type for every matrix, or
/// llama.cpp's Q4_K_M mix; with llama.cpp's fallback for rows the block does not divide.
#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace tandem {

/// The type of matrix `name` ("blk.3.attn_v.weight", "output.weight", ...) with rows of
/// `ne0` values in a model of `n_layer` layers (`has_output`: a separate output.weight).
/// With `q4_k_m`, as llama.cpp's llama_tensor_get_type picks for LLAMA_FTYPE_MOSTLY_Q4_K_M:
/// q6_K for output.weight (or token_embd.weight when the output is tied to it) and for the
/// attn_v and ffn_down of layers where use_more_bits(i, n) holds (the first and last eighth
/// of the layers and every third one between), q4_K elsewhere (token_embd included).
/// Otherwise `dtype` everywhere. A k-quant whose block does not divide ne0 falls back to
/// q8_0 (llama.cpp takes q5_0 / q5_1 for q4_K / q5_K, which Tandem does not compute; q8_0 for
/// q6_K as llama.cpp), or f16 when 32 does not divide it either.
ggml_type weight_type(ggml_type dtype, bool q4_k_m, const std::string& name, int64_t ne0, int n_layer,
                      bool has_output);

/// llama.cpp's general.file_type (LLAMA_FTYPE_*) for a file of these weights: q4_K alone is
/// MOSTLY_Q4_K_S, q5_K MOSTLY_Q5_K_S.
uint32_t llama_file_type(ggml_type dtype, bool q4_k_m);

}  // namespace tandem
