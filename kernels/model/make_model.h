#pragma once
/// Writes random-weight GGUF files of every architecture Tandem loads (`tandem make-model`, and tests).
#include <cstdint>
#include <string>

#include "kernels/tensor.h"

namespace tandem {

struct make_model_options {
  /// "tiny-15m" (288 dim, 6 layers, 6 heads), "small-110m" (768 dim, 12 layers, 12 heads),
  /// "micro" (64 dim, 2 layers, 4 heads, 2 KV heads: grouped-query attention; for tests), or
  /// "llama-1b" (Llama-3.2-1B: 2048 dim, 16 layers, 32 heads, 8 KV heads; for benchmarks).
  std::string preset = "tiny-15m";
  /// general.architecture of the file: "llama", "qwen2" (adds Q/K/V biases), "qwen3" (adds
  /// per-head q/k norms), "gemma2" (post norms, soft-capping, sliding window) or "deepseek2"
  /// (latent attention with q LoRA, 8 experts of which 2 are routed plus 1 shared, one leading
  /// dense layer); the same preset width, layers and heads with that architecture's keys and
  /// tensors.
  std::string arch = "llama";
  /// gemma2 only: `gemma2.attention.sliding_window`, small so that tests cross it.
  int32_t sliding_window = 32;
  /// Type of the matrices (norms stay f32): f32, f16, bf16, q8_0, q4_0, q4_K, q5_K or q6_K
  /// (a k-quant falls back to q8_0 where 256 does not divide a row; see quant_mix.h).
  ggml_type dtype = ggml_type::f32;
  bool q4_k_m = false;  ///< llama.cpp's Q4_K_M mix of q4_K and q6_K instead of `dtype` (quant_mix.h)
  uint64_t seed = 1;
  bool tied_output = true;           ///< false writes a separate output.weight
  /// llama only: write `rope_freqs.weight` with Llama 3.1's rope scaling factors (factor 8,
  /// low/high frequency factors 1 and 4, original context 8192), as llama.cpp's converter does.
  bool llama3_rope = false;
  /// YaRN RoPE scaling keys: factor 4 over an original context of a quarter of the preset's,
  /// and for deepseek2 DeepSeek-V2's yarn_log_multiplier (0.1 x mscale_all_dim 0.707, as
  /// llama.cpp's converter writes it).
  bool yarn_rope = false;
  /// Written as `tokenizer.chat_template` when not empty (a Jinja chat template).
  std::string chat_template;
  /// Written as `tokenizer.ggml.fim_pre/suf/mid_token_id` when >= 0 (fill-in-the-middle
  /// tokens, for tests of completions `suffix`: any ids of the vocabulary).
  int32_t fim_pre = -1, fim_suf = -1, fim_mid = -1;
};

/// Writes the model to `path`. Throws tandem::error naming the bad preset/arch/dtype or I/O error.
void write_random_llama(const make_model_options& opt, const std::string& path);

}  // namespace tandem
