#pragma once
/// The DeepSeek-V2/V3 model (llama.cpp's `deepseek2`): multi-head latent attention whose KV
/// cache holds only the compressed latent (kv_lora_rank normalised values + rope_dims roped key
/// values per token and layer), absorbed at every step (q_nope goes through W_UK into latent
/// space, the attention output through W_UV back out), and a mixture-of-experts FFN after
/// n_dense_lead dense layers, with shared experts. A step reads only the experts its tokens
/// were routed to.
#include <memory>
#include <vector>

#include "kernels/backend/backend.h"
#include "kernels/model/llama.h"
#include "kernels/tensor.h"

namespace tandem {

/// Every weight of a deepseek2 model as views (GGUF names in comments; shapes as ggml's ne,
/// columns first). Optional views have data == nullptr when absent.
struct deepseek2_weights {
  struct layer {
    tensor_view attn_norm;       ///< attn_norm [n_embd]
    /// With q LoRA (q_lora_rank > 0): attn_q_a [n_embd, q_lora_rank], attn_q_a_norm
    /// [q_lora_rank], attn_q_b [q_lora_rank, n_head * head_dim]; without: attn_q [n_embd, n_head * head_dim].
    tensor_view attn_q_a, attn_q_a_norm, attn_q_b, attn_q;
    tensor_view attn_kv_a_mqa;   ///< [n_embd, kv_lora_rank + rope_dims]
    tensor_view attn_kv_a_norm;  ///< [kv_lora_rank]
    tensor_view attn_k_b;        ///< [nope, kv_lora_rank, n_head]: W_UK per head
    tensor_view attn_v_b;        ///< [kv_lora_rank, v_head_dim, n_head]: W_UV per head
    tensor_view attn_output;     ///< [n_head * v_head_dim, n_embd]
    tensor_view ffn_norm;        ///< [n_embd]
    /// Dense layers (l < n_dense_lead): ffn_gate/up [n_embd, n_ff], ffn_down [n_ff, n_embd].
    tensor_view ffn_gate, ffn_up, ffn_down;
    /// MoE layers: ffn_gate_inp [n_embd, n_expert] (the router), the stacked experts
    /// ffn_{gate,up}_exps [n_embd, n_ff_exp, n_expert] and ffn_down_exps [n_ff_exp, n_embd,
    /// n_expert], the shared experts ffn_{gate,up}_shexp [n_embd, n_ff_exp * n_expert_shared]
    /// and ffn_down_shexp, and V3's optional selection bias exp_probs_b.bias [n_expert].
    tensor_view ffn_gate_inp, ffn_gate_exps, ffn_up_exps, ffn_down_exps;
    tensor_view ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp, exp_probs_b;
  };
  model_config config;
  tensor_view token_embd, output_norm, output;  ///< output absent = tied to token_embd
  std::vector<layer> layers;

  /// Calls f(view) for every weight view, present or not (the loader's unused-tensor check).
  template <class F>
  void for_each_view(F&& f) const {
    for (const tensor_view* t : {&token_embd, &output_norm, &output}) f(*t);
    for (const layer& L : layers)
      for (const tensor_view* t :
           {&L.attn_norm, &L.attn_q_a, &L.attn_q_a_norm, &L.attn_q_b, &L.attn_q, &L.attn_kv_a_mqa, &L.attn_kv_a_norm,
            &L.attn_k_b, &L.attn_v_b, &L.attn_output, &L.ffn_norm, &L.ffn_gate, &L.ffn_up, &L.ffn_down,
            &L.ffn_gate_inp, &L.ffn_gate_exps, &L.ffn_up_exps, &L.ffn_down_exps, &L.ffn_gate_shexp, &L.ffn_up_shexp,
            &L.ffn_down_shexp, &L.exp_probs_b})
        f(*t);
  }
};

/// Builds the model on backend `ops` (the KV layout is model_kv_layout's latent one, so `kv`
/// must be f32). Throws tandem::error naming the tensor whose shape or type does not match the
/// config, or the config value that is out of range. Its forward pass is written once against
/// the backend op table.
std::unique_ptr<llama_model> make_deepseek2_model(const deepseek2_weights& w, kv_dtype kv,
                                                  std::unique_ptr<backend::ops> ops);

/// make_deepseek2_model on the CPU backend of `opt`.
std::unique_ptr<llama_model> make_cpu_deepseek2(const deepseek2_weights& w, const cpu_options& opt = {});

}  // namespace tandem
