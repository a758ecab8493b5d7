#include "kernels/cpu/deepseek2_cpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/aligned_vector.h"
#include "kernels/cpu/batch_check.h"
#include "kernels/cpu/mla_attention.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cpu/weight_check.h"

namespace tandem {

namespace {

using cpu::check_weight;
using cpu::packed_weight;

class cpu_deepseek2 final : public llama_model {
 public:
  cpu_deepseek2(const deepseek2_weights& w, const cpu_options& opt);

  const model_config& config() const override { return w_.config; }
  kv_layout layout(int32_t page_size) const override { return model_kv_layout(w_.config, page_size, opt_.kv); }
  void forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) override;

 private:
  /// One layer's weights prepared for the kernels, and its vector weights as f32.
  struct layer {
    packed_weight q_a, q_b, q, kv_a, wo;
    std::vector<packed_weight> k_b, v_b;  ///< per head
    bool moe = false;
    packed_weight gate, up, down;  ///< the dense FFN, or the shared experts (present when has_shared)
    bool has_shared = false;
    packed_weight router;
    std::vector<packed_weight> exp_gate, exp_up, exp_down;  ///< per expert
    std::vector<float> attn_norm, q_a_norm, kv_a_norm, ffn_norm, probs_bias;
  };
  void attention(int32_t l, std::span<const batch_seq> batch, kv_pool& pool, int64_t T);
  void ffn(const layer& L, int64_t T);
  /// y = down(silu(gate x) * up x) for `rows` rows of xn-shaped input `x`.
  void swiglu_ffn(const packed_weight& gate, const packed_weight& up, const packed_weight& down, const float* x,
                  int64_t rows, int64_t width, float* y);

  deepseek2_weights w_;
  cpu_options opt_;
  cpu_isa isa_;
  cpu::thread_pool pool_;
  std::vector<layer> layers_;
  packed_weight output_;
  std::vector<float> output_norm_;
  std::vector<float> rope_freqs_;  ///< empty: no frequency factors
  float kq_scale_ = 1.0f;
  float rope_magnitude_ = 1.0f;  ///< YaRN's cos/sin magnitude (1 without YaRN)
  // Scratch reused across calls (one model serves one executor thread). Per-head buffers are
  // head-major ([head][token][...]) so each head's absorbed matmul and attention read
  // contiguous rows.
  cpu::aligned_vector<float> x_, xn_, qa_, q_, kva_, lat_, kpe_, qpe_, qlat_, olat_, ov_, tmp_, gate_, up_, head_in_,
      head_out_, router_, moe_in_, moe_out_;
  std::vector<float> mm_scratch_;
  std::vector<float> route_w_;
  std::vector<int32_t> route_e_, expert_rows_;
  cpu::rope_table rope_;
  std::vector<int32_t> tok_, pos_;
  std::vector<std::pair<int64_t, const batch_seq*>> seq_start_;
};

cpu_deepseek2::cpu_deepseek2(const deepseek2_weights& w, const cpu_options& opt)
    : w_(w), opt_(opt), isa_(cpu::resolve_isa(opt.isa)), pool_(opt.threads) {
  const model_config& c = w_.config;
  if (opt.threads < 1 || opt.threads > 1024)
    throw tandem::error(fmt::format("cpu threads {} is out of range; use 1 to 1024", opt.threads));
  const int32_t nope = c.head_dim - c.rope_dims;
  if (c.n_embd <= 0 || c.n_layer <= 0 || c.n_head <= 0 || c.n_vocab <= 0 || c.kv_lora_rank <= 0 || c.rope_dims <= 0 ||
      c.rope_dims % 2 != 0 || nope <= 0 || c.v_head_dim <= 0 || c.q_lora_rank < 0 || c.n_dense_lead < 0 ||
      c.n_dense_lead > c.n_layer)
    throw tandem::error(fmt::format("invalid deepseek2 config: n_embd={} n_layer={} n_head={} n_vocab={} "
                                    "kv_lora_rank={} rope_dims={} head_dim={} v_head_dim={} q_lora_rank={} "
                                    "n_dense_lead={}",
                                    c.n_embd, c.n_layer, c.n_head, c.n_vocab, c.kv_lora_rank, c.rope_dims, c.head_dim,
                                    c.v_head_dim, c.q_lora_rank, c.n_dense_lead));
  const bool any_moe = c.n_dense_lead < c.n_layer;
  if (any_moe && (c.n_expert <= 0 || c.n_expert_used <= 0 || c.n_expert_used > c.n_expert || c.n_ff_exp <= 0 ||
                  c.n_expert_shared < 0))
    throw tandem::error(fmt::format("invalid deepseek2 MoE config: {} experts, {} used, {} shared, {} wide",
                                    c.n_expert, c.n_expert_used, c.n_expert_shared, c.n_ff_exp));
  if (c.n_dense_lead > 0 && c.n_ff <= 0) throw tandem::error("invalid deepseek2 config: dense layers need n_ff > 0");
  if (int32_t(w_.layers.size()) != c.n_layer)
    throw tandem::error(fmt::format("model has {} layers of weights but n_layer={}", w_.layers.size(), c.n_layer));
  (void)layout(16);  // refuses a cache type the latent layout does not have, before any work
  const int64_t e = c.n_embd, H = c.n_head, kvr = c.kv_lora_rank, qd = H * c.head_dim;
  check_weight(w_.token_embd, "token_embd.weight", e, c.n_vocab);
  if (w_.output.data == nullptr) w_.output = w_.token_embd;
  check_weight(w_.output, "output.weight", e, c.n_vocab);
  output_norm_ = cpu::vector_weight(w_.output_norm, "output_norm.weight", e);

  // Every matmul weight, packed at once (on amx their tile copies share one buffer); the
  // per-head and per-expert matrices are slices of their stacked tensors.
  layers_.resize(size_t(c.n_layer));
  std::vector<tensor_view> views;
  std::vector<packed_weight*> targets;
  auto add = [&](packed_weight& p, const tensor_view& t) {
    views.push_back(t);
    targets.push_back(&p);
  };
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const auto& W = w_.layers[size_t(l)];
    layer& L = layers_[size_t(l)];
    auto n = [l](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
    L.attn_norm = cpu::vector_weight(W.attn_norm, n("attn_norm"), e);
    if (c.q_lora_rank > 0) {
      check_weight(W.attn_q_a, n("attn_q_a"), e, c.q_lora_rank);
      L.q_a_norm = cpu::vector_weight(W.attn_q_a_norm, n("attn_q_a_norm"), c.q_lora_rank);
      check_weight(W.attn_q_b, n("attn_q_b"), c.q_lora_rank, qd);
      add(L.q_a, W.attn_q_a);
      add(L.q_b, W.attn_q_b);
    } else {
      check_weight(W.attn_q, n("attn_q"), e, qd);
      add(L.q, W.attn_q);
    }
    check_weight(W.attn_kv_a_mqa, n("attn_kv_a_mqa"), e, kvr + c.rope_dims);
    add(L.kv_a, W.attn_kv_a_mqa);
    L.kv_a_norm = cpu::vector_weight(W.attn_kv_a_norm, n("attn_kv_a_norm"), kvr);
    check_weight(W.attn_k_b, n("attn_k_b"), nope, kvr, H);
    check_weight(W.attn_v_b, n("attn_v_b"), kvr, c.v_head_dim, H);
    L.k_b.resize(size_t(H));
    L.v_b.resize(size_t(H));
    for (int64_t h = 0; h < H; ++h) {
      add(L.k_b[size_t(h)], cpu::expert_slice(W.attn_k_b, h));
      add(L.v_b[size_t(h)], cpu::expert_slice(W.attn_v_b, h));
    }
    check_weight(W.attn_output, n("attn_output"), H * c.v_head_dim, e);
    add(L.wo, W.attn_output);
    L.ffn_norm = cpu::vector_weight(W.ffn_norm, n("ffn_norm"), e);
    L.moe = l >= c.n_dense_lead;
    if (!L.moe) {
      check_weight(W.ffn_gate, n("ffn_gate"), e, c.n_ff);
      check_weight(W.ffn_up, n("ffn_up"), e, c.n_ff);
      check_weight(W.ffn_down, n("ffn_down"), c.n_ff, e);
      add(L.gate, W.ffn_gate);
      add(L.up, W.ffn_up);
      add(L.down, W.ffn_down);
      continue;
    }
    const int64_t ne = c.n_expert, fe = c.n_ff_exp;
    check_weight(W.ffn_gate_inp, n("ffn_gate_inp"), e, ne);
    add(L.router, W.ffn_gate_inp);
    check_weight(W.ffn_gate_exps, n("ffn_gate_exps"), e, fe, ne);
    check_weight(W.ffn_up_exps, n("ffn_up_exps"), e, fe, ne);
    check_weight(W.ffn_down_exps, n("ffn_down_exps"), fe, e, ne);
    L.exp_gate.resize(size_t(ne));
    L.exp_up.resize(size_t(ne));
    L.exp_down.resize(size_t(ne));
    for (int64_t x = 0; x < ne; ++x) {
      add(L.exp_gate[size_t(x)], cpu::expert_slice(W.ffn_gate_exps, x));
      add(L.exp_up[size_t(x)], cpu::expert_slice(W.ffn_up_exps, x));
      add(L.exp_down[size_t(x)], cpu::expert_slice(W.ffn_down_exps, x));
    }
    L.has_shared = c.n_expert_shared > 0;
    if (L.has_shared) {
      const int64_t fs = fe * c.n_expert_shared;
      check_weight(W.ffn_gate_shexp, n("ffn_gate_shexp"), e, fs);
      check_weight(W.ffn_up_shexp, n("ffn_up_shexp"), e, fs);
      check_weight(W.ffn_down_shexp, n("ffn_down_shexp"), fs, e);
      add(L.gate, W.ffn_gate_shexp);
      add(L.up, W.ffn_up_shexp);
      add(L.down, W.ffn_down_shexp);
    }
    L.probs_bias = cpu::optional_vector_weight(W.exp_probs_b, fmt::format("blk.{}.exp_probs_b.bias", l), ne);
  }
  add(output_, w_.output);
  std::vector<packed_weight> packed = cpu::pack_weights(views, isa_, &pool_);
  for (size_t i = 0; i < packed.size(); ++i) *targets[i] = std::move(packed[i]);

  if (!(c.rope_freq_scale > 0.0f && std::isfinite(c.rope_freq_scale)))
    throw tandem::error(fmt::format("invalid rope frequency scale {}", c.rope_freq_scale));
  if (c.rope_freq_scale != 1.0f) rope_freqs_.assign(size_t(c.rope_dims / 2), 1.0f / c.rope_freq_scale);
  // llama.cpp's kq_scale for deepseek2: 1 / sqrt(nope + rope dims), with YaRN times the square
  // of DeepSeek's mscale (its RoPE then keeps a magnitude of about 1).
  float mscale = 1.0f;
  if (c.yarn.on()) {
    const float inv = 1.0f / (1.0f / c.yarn.factor);
    const float attn_factor_org = yarn_attn_factor(c.yarn, true) * (1.0f + 0.1f * std::log(inv));
    mscale = attn_factor_org * (1.0f + 0.1f * c.yarn.log_mul * std::log(inv));
  }
  kq_scale_ = mscale * mscale / std::sqrt(float(c.head_dim));
  rope_magnitude_ = yarn_rope_magnitude(c.yarn, true);
}

void cpu_deepseek2::swiglu_ffn(const packed_weight& gate, const packed_weight& up, const packed_weight& down,
                               const float* x, int64_t rows, int64_t width, float* y) {
  gate_.resize(size_t(rows * width));
  up_.resize(size_t(rows * width));
  const packed_weight* ws[] = {&gate, &up};
  float* const ys[] = {gate_.data(), up_.data()};
  cpu::matmul_many(ws, x, rows, ys, mm_scratch_, &pool_);
  cpu::swiglu(gate_.data(), up_.data(), gate_.data(), size_t(rows * width), &pool_, isa_);
  cpu::matmul(down, gate_.data(), rows, y, mm_scratch_, &pool_);
}

void cpu_deepseek2::attention(int32_t l, std::span<const batch_seq> batch, kv_pool& pool, int64_t T) {
  const model_config& c = w_.config;
  const layer& L = layers_[size_t(l)];
  const int64_t e = c.n_embd, H = c.n_head, hd = c.head_dim, rd = c.rope_dims, kvr = c.kv_lora_rank,
                nope = hd - rd, vd = c.v_head_dim, lat_w = kvr + rd;
  q_.resize(size_t(T * H * hd));
  kva_.resize(size_t(T * lat_w));
  if (c.q_lora_rank > 0) {
    qa_.resize(size_t(T * c.q_lora_rank));
    // The q LoRA down-projection and the KV latent read the same input: one fork-join.
    const packed_weight* ws[] = {&L.q_a, &L.kv_a};
    float* const ys[] = {qa_.data(), kva_.data()};
    cpu::matmul_many(ws, xn_.data(), T, ys, mm_scratch_, &pool_);
    cpu::rms_norm(qa_.data(), L.q_a_norm.data(), qa_.data(), T, c.q_lora_rank, c.rms_eps, &pool_);
    cpu::matmul(L.q_b, qa_.data(), T, q_.data(), mm_scratch_, &pool_);
  } else {
    const packed_weight* ws[] = {&L.q, &L.kv_a};
    float* const ys[] = {q_.data(), kva_.data()};
    cpu::matmul_many(ws, xn_.data(), T, ys, mm_scratch_, &pool_);
  }
  // The latent: normalised compressed KV, then the roped shared key part.
  lat_.resize(size_t(T * lat_w));
  kpe_.resize(size_t(T * rd));
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(lat_.data() + t * lat_w, kva_.data() + t * lat_w, size_t(kvr) * sizeof(float));
    std::memcpy(kpe_.data() + t * rd, kva_.data() + t * lat_w + kvr, size_t(rd) * sizeof(float));
  }
  for (int64_t t = 0; t < T; ++t)  // rows of kvr at stride lat_w, in place
    cpu::rms_norm(lat_.data() + t * lat_w, L.kv_a_norm.data(), lat_.data() + t * lat_w, 1, kvr, c.rms_eps);
  cpu::rope(kpe_.data(), rope_, 1, &pool_);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(lat_.data() + t * lat_w + kvr, kpe_.data() + t * rd, size_t(rd) * sizeof(float));
  // Store each new position's latent row.
  const int32_t ps = pool.layout().page_size;
  for (const auto& [t0, b] : seq_start_)
    for (size_t i = 0; i < b->tokens.size(); ++i) {
      const int64_t p = b->pos + int64_t(i);
      float* dst = reinterpret_cast<float*>(pool.component(b->pages[size_t(p / ps)], l, 0)) + (p % ps) * lat_w;
      std::memcpy(dst, lat_.data() + (t0 + int64_t(i)) * lat_w, size_t(lat_w) * sizeof(float));
    }
  // Per head: q_pe roped, q_nope absorbed into latent space through W_UK (head-major).
  qpe_.resize(size_t(H * T * rd));
  qlat_.resize(size_t(H * T * kvr));
  head_in_.resize(size_t(T * std::max(nope, kvr)));
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < T; ++t) {
      const float* qh = q_.data() + (t * H + h) * hd;
      std::memcpy(head_in_.data() + t * nope, qh, size_t(nope) * sizeof(float));
      std::memcpy(qpe_.data() + (h * T + t) * rd, qh + nope, size_t(rd) * sizeof(float));
    }
    cpu::rope(qpe_.data() + h * T * rd, rope_, 1);
    cpu::matmul(L.k_b[size_t(h)], head_in_.data(), T, qlat_.data() + h * T * kvr, mm_scratch_, &pool_);
  }
  // Attention in latent space, one (sequence, head) pair per unit of work.
  olat_.resize(size_t(H * T * kvr));
  const int64_t n_seq = int64_t(seq_start_.size());
  cpu::parallel_for_if(&pool_, n_seq * H, T * H * kvr * 4, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const auto& [t0, b] = seq_start_[size_t(u / H)];
      const int64_t h = u % H, off = h * T + t0;
      cpu::mla_attention(qlat_.data() + off * kvr, qpe_.data() + off * rd, int64_t(b->tokens.size()), b->pos, 1,
                         int32_t(kvr), int32_t(rd), kq_scale_, pool, l, b->pages, olat_.data() + off * kvr, isa_);
    }
  });
  // Per head: back out of latent space through W_UV, then the output projection.
  ov_.resize(size_t(T * H * vd));
  head_out_.resize(size_t(T * vd));
  for (int64_t h = 0; h < H; ++h) {
    cpu::matmul(L.v_b[size_t(h)], olat_.data() + h * T * kvr, T, head_out_.data(), mm_scratch_, &pool_);
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(ov_.data() + (t * H + h) * vd, head_out_.data() + t * vd, size_t(vd) * sizeof(float));
  }
  tmp_.resize(size_t(T * e));
  cpu::matmul(L.wo, ov_.data(), T, tmp_.data(), mm_scratch_, &pool_);
}

void cpu_deepseek2::ffn(const layer& L, int64_t T) {
  const model_config& c = w_.config;
  const int64_t e = c.n_embd;
  tmp_.resize(size_t(T * e));
  if (!L.moe) {
    swiglu_ffn(L.gate, L.up, L.down, xn_.data(), T, c.n_ff, tmp_.data());
    return;
  }
  // Route every token, then run each expert once on the rows routed to it: a step reads only
  // the experts its tokens chose.
  const int64_t k = c.n_expert_used;
  router_.resize(size_t(T * c.n_expert));
  cpu::matmul(L.router, xn_.data(), T, router_.data(), mm_scratch_, &pool_);
  route_e_.resize(size_t(T * k));
  route_w_.resize(size_t(T * k));
  const cpu::moe_routing r{.n_expert = c.n_expert,
                           .n_used = c.n_expert_used,
                           .gating = cpu::moe_gating(c.expert_gating),
                           .norm_weights = c.expert_weights_norm,
                           .weights_scale = c.expert_weights_scale,
                           .selection_bias = L.probs_bias.empty() ? nullptr : L.probs_bias.data()};
  cpu::moe_route(router_.data(), T, r, route_e_.data(), route_w_.data());
  moe_out_.resize(size_t(T * k * e));  // [token][choice][n_embd]
  for (int32_t x = 0; x < c.n_expert; ++x) {
    expert_rows_.clear();  // (token * k + choice) of every row routed to x, in token order
    for (int64_t i = 0; i < T * k; ++i)
      if (route_e_[size_t(i)] == x) expert_rows_.push_back(int32_t(i));
    const int64_t m = int64_t(expert_rows_.size());
    if (m == 0) continue;
    moe_in_.resize(size_t(m * e));
    for (int64_t j = 0; j < m; ++j)
      std::memcpy(moe_in_.data() + j * e, xn_.data() + (expert_rows_[size_t(j)] / k) * e, size_t(e) * sizeof(float));
    head_out_.resize(size_t(m * e));
    swiglu_ffn(L.exp_gate[size_t(x)], L.exp_up[size_t(x)], L.exp_down[size_t(x)], moe_in_.data(), m, c.n_ff_exp,
               head_out_.data());
    for (int64_t j = 0; j < m; ++j)
      std::memcpy(moe_out_.data() + int64_t(expert_rows_[size_t(j)]) * e, head_out_.data() + j * e,
                  size_t(e) * sizeof(float));
  }
  // Weighted sum in choice order (as llama.cpp adds them), plus the shared experts.
  if (L.has_shared) swiglu_ffn(L.gate, L.up, L.down, xn_.data(), T, c.n_ff_exp * c.n_expert_shared, tmp_.data());
  for (int64_t t = 0; t < T; ++t) {
    float* y = tmp_.data() + t * e;
    for (int64_t i = 0; i < e; ++i) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const float v = moe_out_[size_t((t * k + j) * e + i)] * route_w_[size_t(t * k + j)];
        acc = j == 0 ? v : acc + v;
      }
      y[i] = L.has_shared ? acc + y[i] : acc;
    }
  }
}

void cpu_deepseek2::forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) {
  const model_config& c = w_.config;
  const kv_layout PL = pool.layout();
  if (!(PL == layout(PL.page_size)))
    throw tandem::error(fmt::format("KV pool layout {} does not match the model's {}", PL.describe(),
                                    layout(PL.page_size).describe()));
  const size_t n_logits = cpu::check_batch(batch, c, pool, tok_, pos_);
  logits.assign(n_logits * size_t(c.n_vocab), 0.0f);
  const int64_t T = int64_t(tok_.size());
  if (T == 0) return;
  seq_start_.clear();
  int64_t t0 = 0;
  for (const batch_seq& b : batch) {
    if (!b.tokens.empty()) seq_start_.emplace_back(t0, &b);
    t0 += int64_t(b.tokens.size());
  }
  const int64_t e = c.n_embd;
  x_.resize(size_t(T * e));
  xn_.resize(size_t(T * e));
  cpu::get_rows(w_.token_embd, tok_, x_.data());
  rope_.build(pos_.data(), T, c.rope_dims, c.rope_freq_base, false, rope_freqs_.empty() ? nullptr : rope_freqs_.data(),
              &c.yarn, rope_magnitude_);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const layer& L = layers_[size_t(l)];
    cpu::rms_norm(x_.data(), L.attn_norm.data(), xn_.data(), T, e, c.rms_eps, &pool_);
    attention(l, batch, pool, T);
    cpu::add_inplace(x_.data(), tmp_.data(), T * e, &pool_);
    cpu::rms_norm(x_.data(), L.ffn_norm.data(), xn_.data(), T, e, c.rms_eps, &pool_);
    ffn(L, T);
    cpu::add_inplace(x_.data(), tmp_.data(), T * e, &pool_);
  }
  if (n_logits == 0) return;
  int64_t r = 0;
  t0 = 0;
  for (const batch_seq& b : batch) {
    t0 += int64_t(b.tokens.size());
    if (b.want_logits) std::memcpy(xn_.data() + (r++) * e, x_.data() + (t0 - 1) * e, size_t(e) * sizeof(float));
  }
  cpu::rms_norm(xn_.data(), output_norm_.data(), xn_.data(), r, e, c.rms_eps);
  cpu::matmul(output_, xn_.data(), r, logits.data(), mm_scratch_, &pool_);
}

}  // namespace

std::unique_ptr<llama_model> make_cpu_deepseek2(const deepseek2_weights& w, const cpu_options& opt) {
  return std::make_unique<cpu_deepseek2>(w, opt);
}

}  // namespace tandem
