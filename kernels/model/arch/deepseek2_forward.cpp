#include "kernels/model/arch/deepseek2_forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/backend/cpu_backend.h"
#include "kernels/base/error.h"
#include "kernels/cpu/moe.h"
#include "kernels/model/arch/checks.h"
#include "kernels/model/arch/forward_common.h"

namespace tandem {

namespace {

using arch::check_weight;
using arch::optional_vector_weight;
using arch::vector_weight;
using backend::weight_id;

/// DeepSeek-V2/V3's forward pass, written once against the backend op table.
class deepseek2_model final : public arch::layered_model {
 public:
  deepseek2_model(const deepseek2_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops);

 private:
  /// One layer's prepared weights, and its vector weights as f32.
  struct layer {
    weight_id q_a, q_b, q, kv_a, wo;
    std::vector<weight_id> k_b, v_b;  ///< per head
    bool moe = false;
    weight_id gate, up, down;  ///< the dense FFN, or the shared experts (present when has_shared)
    bool has_shared = false;
    weight_id router;
    std::vector<weight_id> exp_gate, exp_up, exp_down;  ///< per expert
    std::vector<float> attn_norm, q_a_norm, kv_a_norm, ffn_norm, probs_bias;
  };
  void build_rope(int64_t T) override;
  const float* attn_norm(int32_t l) const override { return layers_[size_t(l)].attn_norm.data(); }
  const float* ffn_norm(int32_t l) const override { return layers_[size_t(l)].ffn_norm.data(); }
  void attention(int32_t l, const arch::layer_kv& kv, int64_t T) override;
  void ffn(int32_t l, int64_t T) override;

  deepseek2_weights w_;
  std::vector<layer> layers_;
  std::vector<float> rope_freqs_;  ///< empty: no frequency factors
  float kq_scale_ = 1.0f;
  float rope_magnitude_ = 1.0f;  ///< YaRN's cos/sin magnitude (1 without YaRN)
  // Activations in the backend's memory, reused across calls (one model serves one executor
  // thread). Per-head buffers are head-major ([head][token][...]) so each head's absorbed
  // matmul and attention read contiguous rows.
  std::unique_ptr<backend::buffer> qa_, q_, kva_, lat_, kpe_, qpe_, qlat_, olat_, ov_, gate_, up_, head_in_, head_out_,
      router_, moe_in_, moe_out_, shared_;
  std::vector<float> route_w_;
  std::vector<int32_t> route_e_, expert_rows_, moe_dest_;
  /// An expert with rows [first, first + rows) of the gathered MoE input.
  struct expert_group {
    int32_t expert;
    int64_t first, rows;
  };
  std::vector<expert_group> groups_;
  std::vector<backend::mla_seq> calls_;
  std::vector<backend::matmul_task> tasks_;
};

deepseek2_model::deepseek2_model(const deepseek2_weights& w, kv_dtype kv, std::unique_ptr<backend::ops> ops)
    : layered_model(w.config, kv, std::move(ops)), w_(w) {
  const model_config& c = config_;
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
  output_norm_ = vector_weight(w_.output_norm, "output_norm.weight", e);

  // Every matmul weight prepared at once (on amx their tile copies share one buffer); the
  // per-head and per-expert matrices are slices of their stacked tensors.
  layers_.resize(size_t(c.n_layer));
  std::vector<tensor_view> views;
  std::vector<backend::weight_id*> targets;
  auto add = [&](backend::weight_id& p, const tensor_view& t) {
    views.push_back(t);
    targets.push_back(&p);
  };
  for (int32_t l = 0; l < c.n_layer; ++l) {
    const auto& W = w_.layers[size_t(l)];
    layer& L = layers_[size_t(l)];
    auto n = [l](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
    L.attn_norm = vector_weight(W.attn_norm, n("attn_norm"), e);
    if (c.q_lora_rank > 0) {
      check_weight(W.attn_q_a, n("attn_q_a"), e, c.q_lora_rank);
      L.q_a_norm = vector_weight(W.attn_q_a_norm, n("attn_q_a_norm"), c.q_lora_rank);
      check_weight(W.attn_q_b, n("attn_q_b"), c.q_lora_rank, qd);
      add(L.q_a, W.attn_q_a);
      add(L.q_b, W.attn_q_b);
    } else {
      check_weight(W.attn_q, n("attn_q"), e, qd);
      add(L.q, W.attn_q);
    }
    check_weight(W.attn_kv_a_mqa, n("attn_kv_a_mqa"), e, kvr + c.rope_dims);
    add(L.kv_a, W.attn_kv_a_mqa);
    L.kv_a_norm = vector_weight(W.attn_kv_a_norm, n("attn_kv_a_norm"), kvr);
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
    L.ffn_norm = vector_weight(W.ffn_norm, n("ffn_norm"), e);
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
    L.probs_bias = optional_vector_weight(W.exp_probs_b, fmt::format("blk.{}.exp_probs_b.bias", l), ne);
  }
  add(output_, w_.output);
  const std::vector<backend::weight_id> ids = ops_->prepare(views);
  for (size_t i = 0; i < ids.size(); ++i) *targets[i] = ids[i];

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
  token_embd_ = w_.token_embd;
  for (auto* buf : {&qa_, &q_, &kva_, &lat_, &kpe_, &qpe_, &qlat_, &olat_, &ov_, &gate_, &up_, &head_in_, &head_out_,
                    &router_, &moe_in_, &moe_out_, &shared_})
    *buf = ops_->make_buffer();
}

void deepseek2_model::build_rope(int64_t T) {
  const model_config& c = config_;
  rope_.build(plan_.positions.data(), T, c.rope_dims, c.rope_freq_base, false,
              rope_freqs_.empty() ? nullptr : rope_freqs_.data(), &c.yarn, rope_magnitude_);
}

void deepseek2_model::attention(int32_t l, const arch::layer_kv& kv, int64_t T) {
  kv_pool& pool = kv.pool;  // one pool holds every layer (pools_layout is the single set)
  const model_config& c = config_;
  const layer& L = layers_[size_t(l)];
  backend::ops& o = *ops_;
  const int64_t H = c.n_head, hd = c.head_dim, rd = c.rope_dims, kvr = c.kv_lora_rank, nope = hd - rd,
                vd = c.v_head_dim, lat_w = kvr + rd;
  float* xn = xn_->floats(0);
  float* q = q_->floats(size_t(T * H * hd));
  float* kva = kva_->floats(size_t(T * lat_w));
  if (c.q_lora_rank > 0) {
    float* qa = qa_->floats(size_t(T * c.q_lora_rank));
    // The q LoRA down-projection and the KV latent read the same input: one call.
    const weight_id ws[] = {L.q_a, L.kv_a};
    float* const ys[] = {qa, kva};
    o.matmul_many(ws, xn, T, ys);
    o.rms_norm(qa, L.q_a_norm.data(), qa, T, c.q_lora_rank, c.rms_eps);
    o.matmul(L.q_b, qa, T, q);
  } else {
    const weight_id ws[] = {L.q, L.kv_a};
    float* const ys[] = {q, kva};
    o.matmul_many(ws, xn, T, ys);
  }
  // The latent row: the normalised compressed KV, then the roped shared key part.
  float* lat = lat_->floats(size_t(T * lat_w));
  float* kpe = kpe_->floats(size_t(T * rd));
  o.copy_rows(kva, lat_w, lat, kvr, T, kvr);
  o.copy_rows(kva + kvr, lat_w, kpe, rd, T, rd);
  o.rms_norm(lat, L.kv_a_norm.data(), lat, T, kvr, c.rms_eps);
  o.rope(kpe, rope_, 1);
  // Joined in place at the cache row's stride: [kvr normalised | rd roped] per token.
  float* row = kva;
  o.copy_rows(lat, kvr, row, lat_w, T, kvr);
  o.copy_rows(kpe, rd, row + kvr, lat_w, T, rd);
  o.kv_write(pool, kv.layer, 0, plan_.slots[kv.index], row, lat_w);
  // Per head: q_pe roped, q_nope absorbed into latent space through W_UK (head-major), every
  // head's small matmul in one call.
  float* qpe = qpe_->floats(size_t(H * T * rd));
  float* qlat = qlat_->floats(size_t(H * T * kvr));
  float* head_in = head_in_->floats(size_t(H * T * nope));
  tasks_.clear();
  for (int64_t h = 0; h < H; ++h) {
    o.copy_rows(q + h * hd, H * hd, head_in + h * T * nope, nope, T, nope);
    o.copy_rows(q + h * hd + nope, H * hd, qpe + h * T * rd, rd, T, rd);
    o.rope(qpe + h * T * rd, rope_, 1);
    tasks_.push_back({L.k_b[size_t(h)], head_in + h * T * nope, T, qlat + h * T * kvr});
  }
  o.matmul_batch(tasks_);
  // Attention in latent space, one call per (sequence, head).
  float* olat = olat_->floats(size_t(H * T * kvr));
  calls_.clear();
  for (const auto& [t0, b] : plan_.starts)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t off = h * T + t0;
      calls_.push_back(backend::mla_seq{.q_lat = qlat + off * kvr,
                                        .q_pe = qpe + off * rd,
                                        .n_tokens = int64_t(b->tokens.size()),
                                        .pos0 = b->pos,
                                        .pages = b->pages_of(kv.index),
                                        .out = olat + off * kvr});
    }
  o.mla_attention(calls_, int32_t(kvr), int32_t(rd), kq_scale_, pool, kv.layer);
  // Per head: back out of latent space through W_UV (one call), then the output projection.
  float* ov = ov_->floats(size_t(T * H * vd));
  float* head_out = head_out_->floats(size_t(H * T * vd));
  tasks_.clear();
  for (int64_t h = 0; h < H; ++h) tasks_.push_back({L.v_b[size_t(h)], olat + h * T * kvr, T, head_out + h * T * vd});
  o.matmul_batch(tasks_);
  for (int64_t h = 0; h < H; ++h) o.copy_rows(head_out + h * T * vd, vd, ov + h * vd, H * vd, T, vd);
  o.matmul(L.wo, ov, T, tmp_->floats(size_t(T * c.n_embd)));
}

void deepseek2_model::ffn(int32_t l, int64_t T) {
  const model_config& c = config_;
  const layer& L = layers_[size_t(l)];
  backend::ops& o = *ops_;
  const int64_t e = c.n_embd;
  float* xn = xn_->floats(0);
  float* y = tmp_->floats(size_t(T * e));
  if (!L.moe) {
    arch::gated_ffn(o, L.gate, L.up, L.down, xn, T, c.n_ff, ffn_kind::silu, *gate_, *up_, y);
    return;
  }
  // Route every token, then run each expert once on the rows routed to it: a step reads only
  // the experts its tokens chose.
  const int64_t k = c.n_expert_used;
  float* logits = router_->floats(size_t(T * c.n_expert));
  o.matmul(L.router, xn, T, logits);
  route_e_.resize(size_t(T * k));
  route_w_.resize(size_t(T * k));
  const backend::moe_routing r{.n_expert = c.n_expert,
                               .n_used = c.n_expert_used,
                               .gating = cpu::moe_gating(c.expert_gating),
                               .norm_weights = c.expert_weights_norm,
                               .weights_scale = c.expert_weights_scale,
                               .selection_bias = L.probs_bias.empty() ? nullptr : L.probs_bias.data()};
  o.moe_route(logits, T, r, route_e_.data(), route_w_.data());
  float* out = moe_out_->floats(size_t(T * k * e));  // [token][choice][n_embd]
  // Every routed expert's rows gathered (token order within an expert), then all experts and
  // the shared ones in two batched stages: gate and up, then down.
  groups_.clear();
  expert_rows_.clear();  // the token of each gathered row ...
  moe_dest_.clear();     // ... and its (token * k + choice) row of `out`
  for (int32_t x = 0; x < c.n_expert; ++x) {
    const int64_t first = int64_t(expert_rows_.size());
    for (int64_t i = 0; i < T * k; ++i)
      if (route_e_[size_t(i)] == x) {
        expert_rows_.push_back(int32_t(i / k));
        moe_dest_.push_back(int32_t(i));
      }
    if (int64_t(expert_rows_.size()) > first) groups_.push_back({x, first, int64_t(expert_rows_.size()) - first});
  }
  const int64_t m = int64_t(expert_rows_.size()), fe = c.n_ff_exp, fs = fe * c.n_expert_shared;
  float* in = moe_in_->floats(size_t(m * e));
  o.gather_rows(xn, expert_rows_, in, e);
  float* g = gate_->floats(size_t(m * fe + T * fs));
  float* u = up_->floats(size_t(m * fe + T * fs));
  float* eo = head_out_->floats(size_t(m * e));
  float* shared = L.has_shared ? shared_->floats(size_t(T * e)) : nullptr;
  tasks_.clear();
  for (const expert_group& gr : groups_) {
    tasks_.push_back({L.exp_gate[size_t(gr.expert)], in + gr.first * e, gr.rows, g + gr.first * fe});
    tasks_.push_back({L.exp_up[size_t(gr.expert)], in + gr.first * e, gr.rows, u + gr.first * fe});
  }
  if (L.has_shared) {
    tasks_.push_back({L.gate, xn, T, g + m * fe});
    tasks_.push_back({L.up, xn, T, u + m * fe});
  }
  o.matmul_batch(tasks_);
  o.swiglu(g, u, g, size_t(m * fe + T * fs));
  tasks_.clear();
  for (const expert_group& gr : groups_)
    tasks_.push_back({L.exp_down[size_t(gr.expert)], g + gr.first * fe, gr.rows, eo + gr.first * e});
  if (L.has_shared) tasks_.push_back({L.down, g + m * fe, T, shared});
  o.matmul_batch(tasks_);
  o.scatter_rows(eo, moe_dest_, out, e);
  // Weighted sum in choice order (as llama.cpp adds them), plus the shared experts.
  o.moe_combine(out, route_w_.data(), T, k, e, shared, y);
}

}  // namespace

std::unique_ptr<llama_model> make_deepseek2_model(const deepseek2_weights& w, kv_dtype kv,
                                                  std::unique_ptr<backend::ops> ops) {
  return std::make_unique<deepseek2_model>(w, kv, std::move(ops));
}

std::unique_ptr<llama_model> make_cpu_deepseek2(const deepseek2_weights& w, const cpu_options& opt) {
  return make_deepseek2_model(w, opt.kv, opt.make_backend ? opt.make_backend() : backend::make_cpu_backend(opt));
}

}  // namespace tandem
