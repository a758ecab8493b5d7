#include "kernels/model/arch/dense_forward.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/backend/cpu_backend.h"
#include "kernels/base/error.h"
#include "kernels/model/arch/checks.h"
#include "kernels/model/arch/forward_common.h"

namespace tandem {

namespace {

using arch::check_weight;
using arch::optional_vector_weight;
using arch::vector_weight;

/// The dense decoder's forward pass, written once against the backend op table.
class dense_model final : public arch::layered_model {
 public:
  dense_model(const llama_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops);

 private:
  struct layer {
    backend::weight_id attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down;
    std::vector<float> attn_norm, ffn_norm;
    std::vector<float> q_bias, k_bias, v_bias, q_norm, k_norm;  ///< empty when absent
    std::vector<float> attn_post_norm, ffn_post_norm;          ///< empty when absent
  };
  void build_rope(int64_t T) override;
  const float* attn_norm(int32_t l) const override { return layers_[size_t(l)].attn_norm.data(); }
  const float* ffn_norm(int32_t l) const override { return layers_[size_t(l)].ffn_norm.data(); }
  void attention(int32_t l, const arch::layer_kv& kv, int64_t T) override;
  void ffn(int32_t l, int64_t T) override;

  llama_weights w_;
  std::vector<layer> layers_;
  std::vector<float> rope_freqs_;  ///< empty: no frequency factors
  std::unique_ptr<backend::buffer> q_, k_, v_, att_, gate_, up_;
  std::vector<backend::attention_seq> attn_;
};

dense_model::dense_model(const llama_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops)
    : layered_model(w.config, kv, std::move(ops)), w_(w) {
  const model_config& c = config_;
  if (c.n_embd <= 0 || c.n_layer <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 || c.n_ff <= 0 || c.n_vocab <= 0 ||
      c.head_dim <= 0 || c.head_dim % 2 != 0 || c.n_head % c.n_head_kv != 0)
    throw tandem::error(fmt::format(
        "invalid model config: n_embd={} n_layer={} n_head={} n_head_kv={} n_ff={} n_vocab={} head_dim={}", c.n_embd,
        c.n_layer, c.n_head, c.n_head_kv, c.n_ff, c.n_vocab, c.head_dim));
  if (c.sliding_window < 0 || c.swa_pattern < 0 || !(c.attn_softcap >= 0.0f) || !(c.final_softcap >= 0.0f) ||
      !(c.attn_scale >= 0.0f) || !std::isfinite(c.attn_softcap + c.final_softcap + c.attn_scale))
    throw tandem::error(fmt::format("invalid model config: sliding_window={} swa_pattern={} attn_softcap={} "
                                    "final_softcap={} attn_scale={}",
                                    c.sliding_window, c.swa_pattern, c.attn_softcap, c.final_softcap, c.attn_scale));
  if (c.kv_lora_rank > 0 || c.n_expert > 0)
    throw tandem::error("the dense forward pass has no latent attention or experts; this config needs an MLA/MoE model");
  if (int32_t(w_.layers.size()) != c.n_layer)
    throw tandem::error(fmt::format("model has {} layers of weights but n_layer={}", w_.layers.size(), c.n_layer));
  const int64_t e = c.n_embd, qd = int64_t(c.n_head) * c.head_dim, kd = int64_t(c.n_head_kv) * c.head_dim;
  check_weight(w_.token_embd, "token_embd.weight", e, c.n_vocab);
  if (w_.output.data == nullptr) w_.output = w_.token_embd;  // tied embeddings
  check_weight(w_.output, "output.weight", e, c.n_vocab);
  output_norm_ = vector_weight(w_.output_norm, "output_norm.weight", e);
  std::vector<tensor_view> views;
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const auto& W = w_.layers[size_t(l)];
    auto n = [l](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
    check_weight(W.attn_q, n("attn_q"), e, qd);
    check_weight(W.attn_k, n("attn_k"), e, kd);
    check_weight(W.attn_v, n("attn_v"), e, kd);
    check_weight(W.attn_output, n("attn_output"), qd, e);
    check_weight(W.ffn_gate, n("ffn_gate"), e, c.n_ff);
    check_weight(W.ffn_up, n("ffn_up"), e, c.n_ff);
    check_weight(W.ffn_down, n("ffn_down"), c.n_ff, e);
    layer L{.attn_norm = vector_weight(W.attn_norm, n("attn_norm"), e),
            .ffn_norm = vector_weight(W.ffn_norm, n("ffn_norm"), e),
            .q_bias = optional_vector_weight(W.attn_q_bias, fmt::format("blk.{}.attn_q.bias", l), qd),
            .k_bias = optional_vector_weight(W.attn_k_bias, fmt::format("blk.{}.attn_k.bias", l), kd),
            .v_bias = optional_vector_weight(W.attn_v_bias, fmt::format("blk.{}.attn_v.bias", l), kd),
            .q_norm = optional_vector_weight(W.attn_q_norm, n("attn_q_norm"), c.head_dim),
            .k_norm = optional_vector_weight(W.attn_k_norm, n("attn_k_norm"), c.head_dim),
            .attn_post_norm = optional_vector_weight(W.attn_post_norm, n("post_attention_norm"), e),
            .ffn_post_norm = optional_vector_weight(W.ffn_post_norm, n("post_ffw_norm"), e)};
    // A half-present pair would silently run a different model.
    if (L.q_norm.empty() != L.k_norm.empty())
      throw tandem::error(fmt::format("model layer {} has only one of attn_q_norm / attn_k_norm; both or neither", l));
    layers_.push_back(std::move(L));
    for (const tensor_view* t : {&W.attn_q, &W.attn_k, &W.attn_v, &W.attn_output, &W.ffn_gate, &W.ffn_up, &W.ffn_down})
      views.push_back(*t);
  }
  rope_freqs_ = optional_vector_weight(w_.rope_freqs, "rope_freqs.weight", c.head_dim / 2);
  if (!(c.rope_freq_scale > 0.0f && std::isfinite(c.rope_freq_scale)))
    throw tandem::error(fmt::format("invalid rope frequency scale {}", c.rope_freq_scale));
  if (c.rope_freq_scale != 1.0f) {  // linear scaling folded into the per-pair divisors
    rope_freqs_.resize(size_t(c.head_dim / 2), 1.0f);
    for (float& f : rope_freqs_) f /= c.rope_freq_scale;
  }
  // Every matmul weight prepared once (on amx: copied into the tile layout, which adds the
  // model's f16/bf16 weight bytes in memory).
  views.push_back(w_.output);
  const std::vector<backend::weight_id> ids = ops_->prepare(views);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const backend::weight_id* b = ids.data() + l * 7;
    layer& L = layers_[l];
    L.attn_q = b[0], L.attn_k = b[1], L.attn_v = b[2], L.attn_output = b[3];
    L.ffn_gate = b[4], L.ffn_up = b[5], L.ffn_down = b[6];
  }
  output_ = ids.back();
  token_embd_ = w_.token_embd;
  if (c.scale_embeddings) embed_scale_ = std::sqrt(float(e));
  final_softcap_ = c.final_softcap;
  for (auto* buf : {&q_, &k_, &v_, &att_, &gate_, &up_}) *buf = ops_->make_buffer();
}

void dense_model::build_rope(int64_t T) {
  const model_config& c = config_;
  rope_.build(plan_.positions.data(), T, c.head_dim, c.rope_freq_base, c.rope == rope_kind::neox,
              rope_freqs_.empty() ? nullptr : rope_freqs_.data(), &c.yarn, yarn_rope_magnitude(c.yarn, false));
}

void dense_model::attention(int32_t l, const arch::layer_kv& kv, int64_t T) {
  const model_config& c = config_;
  const layer& L = layers_[size_t(l)];
  backend::ops& o = *ops_;
  const int64_t hd = c.head_dim, qd = int64_t(c.n_head) * hd, kd = int64_t(c.n_head_kv) * hd;
  float* q = q_->floats(size_t(T * qd));
  float* k = k_->floats(size_t(T * kd));
  float* v = v_->floats(size_t(T * kd));
  float* att = att_->floats(size_t(T * qd));
  // Q, K and V read the same input: one call for all three.
  const backend::weight_id qkv_w[] = {L.attn_q, L.attn_k, L.attn_v};
  float* const qkv_y[] = {q, k, v};
  o.matmul_many(qkv_w, xn_->floats(0), T, qkv_y);
  if (!L.q_bias.empty()) o.add_bias(q, L.q_bias.data(), T, qd);
  if (!L.k_bias.empty()) o.add_bias(k, L.k_bias.data(), T, kd);
  if (!L.v_bias.empty()) o.add_bias(v, L.v_bias.data(), T, kd);
  if (!L.q_norm.empty()) {  // per-head RMSNorm: rows of head_dim
    o.rms_norm(q, L.q_norm.data(), q, T * c.n_head, hd, c.rms_eps);
    o.rms_norm(k, L.k_norm.data(), k, T * c.n_head_kv, hd, c.rms_eps);
  }
  o.rope(q, rope_, c.n_head);
  o.rope(k, rope_, c.n_head_kv);
  // Gemma 2 scales q itself (as llama.cpp does: with soft-capping the rounding of q * scale
  // versus (q.k) * scale shows); the kernel then multiplies by 1.
  if (c.attn_scale > 0.0f) o.scale(q, T * qd, c.attn_scale);
  // K and V of every new position into its page slot, then every sequence's attention at once.
  o.kv_write(kv.pool, kv.layer, 0, plan_.slots[kv.index], k, kd);
  o.kv_write(kv.pool, kv.layer, 1, plan_.slots[kv.index], v, kd);
  attn_.clear();
  for (const auto& [t0, b] : plan_.starts)
    attn_.push_back(backend::attention_seq{.q = q + t0 * qd,
                                           .n_tokens = int64_t(b->tokens.size()),
                                           .pos0 = b->pos,
                                           .pages = b->pages_of(kv.index),
                                           .out = att + t0 * qd});
  const backend::attention_params ap{.scale = c.attn_scale > 0.0f ? 1.0f : 0.0f,
                                     .softcap = c.attn_softcap,
                                     .window = c.is_swa_layer(l) ? c.sliding_window : 0};
  o.attention(attn_, c.n_head, kv.pool, kv.layer, ap);
  float* tmp = tmp_->floats(size_t(T * c.n_embd));
  o.matmul(L.attn_output, att, T, tmp);
  if (!L.attn_post_norm.empty()) o.rms_norm(tmp, L.attn_post_norm.data(), tmp, T, c.n_embd, c.rms_eps);
}

void dense_model::ffn(int32_t l, int64_t T) {
  const model_config& c = config_;
  const layer& L = layers_[size_t(l)];
  float* tmp = tmp_->floats(size_t(T * c.n_embd));
  arch::gated_ffn(*ops_, L.ffn_gate, L.ffn_up, L.ffn_down, xn_->floats(0), T, c.n_ff, c.ffn, *gate_, *up_, tmp);
  if (!L.ffn_post_norm.empty()) ops_->rms_norm(tmp, L.ffn_post_norm.data(), tmp, T, c.n_embd, c.rms_eps);
}

}  // namespace

std::unique_ptr<llama_model> make_dense_model(const llama_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops) {
  return std::make_unique<dense_model>(w, kv, std::move(ops));
}

std::unique_ptr<llama_model> make_cpu_llama(const llama_weights& w, const cpu_options& opt) {
  return make_dense_model(w, opt.kv, opt.make_backend ? opt.make_backend() : backend::make_cpu_backend(opt));
}

}  // namespace tandem
