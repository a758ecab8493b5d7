#include "kernels/cpu/llama_cpu.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/aligned_vector.h"
#include "kernels/cpu/batch_check.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/weight_check.h"

namespace tandem {

namespace {

using cpu::check_weight;

/// y[r][i] += b[i] for rows of n (no-op when b is empty). Elementwise, so any batch gives the
/// same bits.
void add_bias(float* y, const std::vector<float>& b, int64_t rows, int64_t n) {
  if (b.empty()) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) y[r * n + i] += b[size_t(i)];
}

class cpu_llama final : public llama_model {
 public:
  cpu_llama(const llama_weights& w, const cpu_options& opt)
      : w_(w), opt_(opt), isa_(cpu::resolve_isa(opt.isa)), pool_(opt.threads) {
    const model_config& c = w_.config;
    if (opt.threads < 1 || opt.threads > 1024)
      throw tandem::error(fmt::format("cpu threads {} is out of range; use 1 to 1024", opt.threads));
    if (c.n_embd <= 0 || c.n_layer <= 0 || c.n_head <= 0 || c.n_head_kv <= 0 || c.n_ff <= 0 || c.n_vocab <= 0 ||
        c.head_dim <= 0 || c.head_dim % 2 != 0 || c.n_head % c.n_head_kv != 0)
      throw tandem::error(fmt::format(
          "invalid model config: n_embd={} n_layer={} n_head={} n_head_kv={} n_ff={} n_vocab={} head_dim={}",
          c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.n_ff, c.n_vocab, c.head_dim));
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
    output_norm_ = cpu::vector_weight(w_.output_norm, "output_norm.weight", e);
    for (int32_t l = 0; l < c.n_layer; ++l) {
      const auto& L = w_.layers[size_t(l)];
      auto n = [l](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
      check_weight(L.attn_q, n("attn_q"), e, qd);
      check_weight(L.attn_k, n("attn_k"), e, kd);
      check_weight(L.attn_v, n("attn_v"), e, kd);
      check_weight(L.attn_output, n("attn_output"), qd, e);
      check_weight(L.ffn_gate, n("ffn_gate"), e, c.n_ff);
      check_weight(L.ffn_up, n("ffn_up"), e, c.n_ff);
      check_weight(L.ffn_down, n("ffn_down"), c.n_ff, e);
      attn_norm_.push_back(cpu::vector_weight(L.attn_norm, n("attn_norm"), e));
      ffn_norm_.push_back(cpu::vector_weight(L.ffn_norm, n("ffn_norm"), e));
      extras_.push_back(layer_extras{
          .q_bias = cpu::optional_vector_weight(L.attn_q_bias, fmt::format("blk.{}.attn_q.bias", l), qd),
          .k_bias = cpu::optional_vector_weight(L.attn_k_bias, fmt::format("blk.{}.attn_k.bias", l), kd),
          .v_bias = cpu::optional_vector_weight(L.attn_v_bias, fmt::format("blk.{}.attn_v.bias", l), kd),
          .q_norm = cpu::optional_vector_weight(L.attn_q_norm, n("attn_q_norm"), c.head_dim),
          .k_norm = cpu::optional_vector_weight(L.attn_k_norm, n("attn_k_norm"), c.head_dim),
          .attn_post_norm = cpu::optional_vector_weight(L.attn_post_norm, n("post_attention_norm"), e),
          .ffn_post_norm = cpu::optional_vector_weight(L.ffn_post_norm, n("post_ffw_norm"), e)});
      // A half-present pair would silently run a different model.
      if (extras_.back().q_norm.empty() != extras_.back().k_norm.empty())
        throw tandem::error(fmt::format("model layer {} has only one of attn_q_norm / attn_k_norm; both or neither",
                                        l));
    }
    rope_freqs_ = cpu::optional_vector_weight(w_.rope_freqs, "rope_freqs.weight", c.head_dim / 2);
    if (!(c.rope_freq_scale > 0.0f && std::isfinite(c.rope_freq_scale)))
      throw tandem::error(fmt::format("invalid rope frequency scale {}", c.rope_freq_scale));
    if (c.rope_freq_scale != 1.0f) {  // linear scaling folded into the per-pair divisors
      rope_freqs_.resize(size_t(c.head_dim / 2), 1.0f);
      for (float& f : rope_freqs_) f /= c.rope_freq_scale;
    }
    // Every matmul weight prepared once for the kernel path (on amx: copied into the tile
    // layout, which adds the model's f16/bf16 weight bytes in memory).
    std::vector<tensor_view> views;
    for (const auto& L : w_.layers)
      for (const tensor_view* t : {&L.attn_q, &L.attn_k, &L.attn_v, &L.attn_output, &L.ffn_gate, &L.ffn_up, &L.ffn_down})
        views.push_back(*t);
    views.push_back(w_.output);
    std::vector<cpu::packed_weight> p = cpu::pack_weights(views, isa_, &pool_);
    for (size_t l = 0; l < w_.layers.size(); ++l) {
      const cpu::packed_weight* b = p.data() + l * 7;
      packed_.push_back(packed_layer{b[0], b[1], b[2], b[3], b[4], b[5], b[6]});
    }
    output_ = p.back();
  }

  const model_config& config() const override { return w_.config; }

  kv_layout layout(int32_t page_size) const override { return model_kv_layout(w_.config, page_size, opt_.kv); }

  void forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) override;

 private:
  llama_weights w_;
  cpu_options opt_;
  cpu_isa isa_;  // resolved once: a path this CPU runs
  cpu::thread_pool pool_;
  std::vector<float> output_norm_;
  std::vector<std::vector<float>> attn_norm_, ffn_norm_;
  struct layer_extras {
    std::vector<float> q_bias, k_bias, v_bias, q_norm, k_norm;  ///< empty when absent
    std::vector<float> attn_post_norm, ffn_post_norm;          ///< empty when absent
  };
  std::vector<layer_extras> extras_;
  std::vector<float> rope_freqs_;  ///< empty: no frequency factors
  // Scratch reused across calls (one model serves one executor thread).
  // Activations start on a cache line: the matmuls read their rows 64 bytes at a time.
  cpu::aligned_vector<float> x_, xn_, q_, k_, v_, att_, tmp_, gate_, up_;
  std::vector<float> mm_scratch_;
  cpu::rope_table rope_;
  struct packed_layer {
    cpu::packed_weight attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down;
  };
  std::vector<packed_layer> packed_;
  cpu::packed_weight output_;  ///< the angles of the positions of the current forward pass
  std::vector<int32_t> tok_, pos_;
  std::vector<cpu::attention_seq> attn_;
};

void cpu_llama::forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) {
  const model_config& c = w_.config;
  const kv_layout L = pool.layout();
  if (!(L == layout(L.page_size)))
    throw tandem::error(fmt::format("KV pool layout {} does not match the model's {}", L.describe(),
                                    layout(L.page_size).describe()));
  const int32_t ps = L.page_size;
  const size_t n_logits = cpu::check_batch(batch, c, pool, tok_, pos_);
  logits.assign(n_logits * size_t(c.n_vocab), 0.0f);
  const int64_t T = int64_t(tok_.size());
  if (T == 0) return;
  const int64_t e = c.n_embd, hd = c.head_dim, qd = int64_t(c.n_head) * hd, kd = int64_t(c.n_head_kv) * hd;
  x_.resize(size_t(T * e));
  xn_.resize(size_t(T * e));
  q_.resize(size_t(T * qd));
  k_.resize(size_t(T * kd));
  v_.resize(size_t(T * kd));
  att_.resize(size_t(T * qd));
  tmp_.resize(size_t(T * e));
  gate_.resize(size_t(T * c.n_ff));
  up_.resize(size_t(T * c.n_ff));
  cpu::get_rows(w_.token_embd, tok_, x_.data());
  if (c.scale_embeddings) {
    const float s = std::sqrt(float(e));
    for (float& v : x_) v *= s;
  }
  // The same angles for every layer.
  rope_.build(pos_.data(), T, int(hd), c.rope_freq_base, c.rope == rope_kind::neox,
              rope_freqs_.empty() ? nullptr : rope_freqs_.data(), &c.yarn, yarn_rope_magnitude(c.yarn, false));

  for (int32_t l = 0; l < c.n_layer; ++l) {
    const packed_layer& W = packed_[size_t(l)];
    cpu::rms_norm(x_.data(), attn_norm_[size_t(l)].data(), xn_.data(), T, e, c.rms_eps, &pool_);
    // Q, K and V (and below gate and up) read the same input: one fork-join for all three.
    const cpu::packed_weight* qkv_w[] = {&W.attn_q, &W.attn_k, &W.attn_v};
    float* const qkv_y[] = {q_.data(), k_.data(), v_.data()};
    cpu::matmul_many(qkv_w, xn_.data(), T, qkv_y, mm_scratch_, &pool_);
    const layer_extras& X = extras_[size_t(l)];
    add_bias(q_.data(), X.q_bias, T, qd);
    add_bias(k_.data(), X.k_bias, T, kd);
    add_bias(v_.data(), X.v_bias, T, kd);
    if (!X.q_norm.empty()) {  // per-head RMSNorm: rows of head_dim
      cpu::rms_norm(q_.data(), X.q_norm.data(), q_.data(), T * c.n_head, hd, c.rms_eps, &pool_);
      cpu::rms_norm(k_.data(), X.k_norm.data(), k_.data(), T * c.n_head_kv, hd, c.rms_eps, &pool_);
    }
    cpu::rope(q_.data(), rope_, c.n_head, &pool_);
    cpu::rope(k_.data(), rope_, c.n_head_kv, &pool_);
    // Gemma 2 scales q itself (as llama.cpp does: with soft-capping the rounding of q * scale
    // versus (q.k) * scale shows); the kernel then multiplies by 1.
    if (c.attn_scale > 0.0f)
      for (int64_t i = 0; i < T * qd; ++i) q_[size_t(i)] *= c.attn_scale;
    int64_t t0 = 0;
    attn_.clear();
    for (const batch_seq& b : batch) {
      const int64_t n = int64_t(b.tokens.size());
      auto store = [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t p = b.pos + i;
          const int32_t page = b.pages[size_t(p / ps)];
          const size_t slot = size_t(p % ps) * size_t(kd);
          const float* kr = k_.data() + (t0 + i) * kd;
          const float* vr = v_.data() + (t0 + i) * kd;
          if (L.dtype == kv_dtype::f16) {
            cpu::fp32_to_fp16_row(kr, pool.k16(page, l) + slot, kd);
            cpu::fp32_to_fp16_row(vr, pool.v16(page, l) + slot, kd);
          } else {
            std::memcpy(pool.k(page, l) + slot, kr, size_t(kd) * sizeof(float));
            std::memcpy(pool.v(page, l) + slot, vr, size_t(kd) * sizeof(float));
          }
        }
      };
      // A prefill chunk's K and V (3 MB per layer for 512 tokens of 768 floats) on both cores.
      cpu::parallel_for_if(&pool_, n, n * kd, store);
      if (n > 0)
        attn_.push_back(cpu::attention_seq{
            .q = q_.data() + t0 * qd, .n_tokens = n, .pos0 = b.pos, .pages = b.pages, .out = att_.data() + t0 * qd});
      t0 += n;
    }
    // Every sequence's attention in one fork-join (decode batches are many short rows).
    const cpu::attention_params ap{.scale = c.attn_scale > 0.0f ? 1.0f : 0.0f,
                                   .softcap = c.attn_softcap,
                                   .window = c.is_swa_layer(l) ? c.sliding_window : 0};
    cpu::paged_attention_batch(attn_, c.n_head, pool, l, &pool_, isa_, ap);
    cpu::matmul(W.attn_output, att_.data(), T, tmp_.data(), mm_scratch_, &pool_);
    if (!X.attn_post_norm.empty())
      cpu::rms_norm(tmp_.data(), X.attn_post_norm.data(), tmp_.data(), T, e, c.rms_eps, &pool_);
    cpu::add_inplace(x_.data(), tmp_.data(), T * e, &pool_);

    cpu::rms_norm(x_.data(), ffn_norm_[size_t(l)].data(), xn_.data(), T, e, c.rms_eps, &pool_);
    const cpu::packed_weight* gate_up_w[] = {&W.ffn_gate, &W.ffn_up};
    float* const gate_up_y[] = {gate_.data(), up_.data()};
    cpu::matmul_many(gate_up_w, xn_.data(), T, gate_up_y, mm_scratch_, &pool_);
    if (c.ffn == ffn_kind::gelu)
      cpu::geglu(gate_.data(), up_.data(), gate_.data(), size_t(T * c.n_ff), &pool_);
    else
      cpu::swiglu(gate_.data(), up_.data(), gate_.data(), size_t(T * c.n_ff), &pool_, isa_);
    cpu::matmul(W.ffn_down, gate_.data(), T, tmp_.data(), mm_scratch_, &pool_);
    if (!X.ffn_post_norm.empty())
      cpu::rms_norm(tmp_.data(), X.ffn_post_norm.data(), tmp_.data(), T, e, c.rms_eps, &pool_);
    cpu::add_inplace(x_.data(), tmp_.data(), T * e, &pool_);
  }

  // Last new token of each sequence that wants logits.
  if (n_logits == 0) return;
  int64_t t0 = 0, r = 0;
  for (const batch_seq& b : batch) {
    t0 += int64_t(b.tokens.size());
    if (b.want_logits) {
      std::memcpy(xn_.data() + r * e, x_.data() + (t0 - 1) * e, size_t(e) * sizeof(float));
      ++r;
    }
  }
  cpu::rms_norm(xn_.data(), output_norm_.data(), xn_.data(), r, e, c.rms_eps);
  cpu::matmul(output_, xn_.data(), r, logits.data(), mm_scratch_, &pool_);
  if (c.final_softcap > 0.0f) cpu::softcap(logits.data(), logits.size(), c.final_softcap);
}

}  // namespace

std::unique_ptr<llama_model> make_cpu_llama(const llama_weights& w, const cpu_options& opt) {
  return std::make_unique<cpu_llama>(w, opt);
}

}  // namespace tandem
