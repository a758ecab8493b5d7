#pragma once
/// The dense decoder (llama, qwen2, qwen3, gemma2) built from tensor views, so it can be fed by a
/// GGUF file (llama_model::load) or by weights held in memory (tests, converters); its forward
/// pass is written once against the backend op table (kernels/backend/backend.h).
#include <memory>
#include <vector>

#include "kernels/backend/backend.h"
#include "kernels/model/llama.h"
#include "kernels/tensor.h"

namespace tandem {

/// Every weight of a Llama model as views; the memory they point to must outlive the model.
struct llama_weights {
  struct layer {
    tensor_view attn_norm, attn_q, attn_k, attn_v, attn_output;
    tensor_view ffn_norm, ffn_gate, ffn_up, ffn_down;
    /// Optional (data == nullptr when the architecture has none): Q/K/V biases (Qwen2),
    /// per-head RMSNorm weights of q and k applied before RoPE (Qwen3), each [head_dim].
    tensor_view attn_q_bias, attn_k_bias, attn_v_bias;
    tensor_view attn_q_norm, attn_k_norm;
    /// Optional [n_embd] RMSNorm weights applied to the attention and FFN outputs before
    /// their residual adds (Gemma 2's post_attention_norm / post_ffw_norm).
    tensor_view attn_post_norm, ffn_post_norm;
  };
  model_config config;
  tensor_view token_embd;   ///< [n_vocab][n_embd]
  tensor_view output_norm;  ///< [n_embd]
  tensor_view output;       ///< [n_vocab][n_embd]; data == nullptr means tied to token_embd
  /// Optional [head_dim / 2] RoPE frequency divisors (`rope_freqs.weight`, Llama 3.1+ rope
  /// scaling): pair i turns at pos * base^(-2i/head_dim) / rope_freqs[i].
  tensor_view rope_freqs;
  std::vector<layer> layers;

  /// Calls f(view) for every weight view, present or not (the loader's unused-tensor check).
  template <class F>
  void for_each_view(F&& f) const {
    for (const tensor_view* t : {&token_embd, &output_norm, &output, &rope_freqs}) f(*t);
    for (const layer& L : layers)
      for (const tensor_view* t : {&L.attn_norm, &L.attn_q, &L.attn_k, &L.attn_v, &L.attn_output, &L.ffn_norm,
                                   &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.attn_q_bias, &L.attn_k_bias, &L.attn_v_bias,
                                   &L.attn_q_norm, &L.attn_k_norm, &L.attn_post_norm, &L.ffn_post_norm})
        f(*t);
  }
};

/// Builds the model on backend `ops` with a KV cache of `kv` elements. Throws tandem::error
/// naming the tensor whose shape or type does not match the config.
std::unique_ptr<llama_model> make_dense_model(const llama_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops);

/// make_dense_model on the CPU backend of `opt`.
std::unique_ptr<llama_model> make_cpu_llama(const llama_weights& w, const cpu_options& opt = {});

}  // namespace tandem
