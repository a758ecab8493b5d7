#pragma once
/// Writes random-weight Llama-architecture GGUF files (`tandem make-model`, and tests).
#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace tandem {

struct make_model_options {
  /// "tiny-15m" (288 dim, 6 layers, 6 heads), "small-110m" (768 dim, 12 layers, 12 heads),
  /// or "micro" (64 dim, 2 layers, 4 heads, 2 KV heads: grouped-query attention; for tests).
  std::string preset = "tiny-15m";
  ggml_type dtype = ggml_type::f32;  ///< f32, f16, bf16 or q8_0 for the matrices (norms stay f32)
  uint64_t seed = 1;
  bool tied_output = true;           ///< false writes a separate output.weight
};

/// Writes the model to `path`. Throws tandem::error naming the bad preset/dtype or I/O error.
void write_random_llama(const make_model_options& opt, const std::string& path);

}  // namespace tandem
