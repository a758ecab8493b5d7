#pragma once
// A tiny random dense decoder held in memory, and a naive double-precision forward over a
// contiguous KV cache to check the CPU model against: the Llama block plus what the other
// dense architectures add (Q/K/V biases, per-head q/k norms, NeoX RoPE, RoPE frequency
// factors and linear scaling).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/model/arch/dense_forward.h"
#include "kernels/cpu/ops.h"

namespace tandem::test {

/// What a tiny_model adds to the plain Llama block.
struct arch_features {
  bool qkv_bias = false;      ///< qwen2
  bool qk_norm = false;       ///< qwen3
  bool neox = false;          ///< qwen2/qwen3 RoPE pairing
  bool rope_freqs = false;    ///< Llama 3.1 style per-pair divisors
  float rope_freq_scale = 1;  ///< linear RoPE scaling
  bool gemma2 = false;        ///< post norms, GELU, soft-caps, q scale, embedding scale, window
  int32_t window = 4;         ///< gemma2: the sliding window of the even layers
};

/// A tiny random model (GQA: 4 heads over 2 KV heads) whose bytes live in this struct.
struct tiny_model {
  model_config cfg;
  ggml_type type;
  std::vector<std::vector<uint8_t>> store;
  llama_weights w;

  explicit tiny_model(ggml_type t = ggml_type::f32, uint64_t seed = 7, arch_features x = {}) : type(t) {
    cfg.name = "tiny";
    cfg.n_vocab = 50;
    cfg.n_embd = 32;
    cfg.n_layer = 2;
    cfg.n_head = 4;
    cfg.n_head_kv = 2;
    cfg.n_ff = 64;
    cfg.n_ctx = 128;
    cfg.head_dim = 8;
    cfg.rope = x.neox ? rope_kind::neox : rope_kind::normal;
    cfg.rope_freq_scale = x.rope_freq_scale;
    if (x.gemma2) {
      cfg.ffn = ffn_kind::gelu;
      cfg.scale_embeddings = true;
      cfg.attn_scale = 0.3f;
      cfg.attn_softcap = 2.0f;  // small caps so that they bite on these random weights
      cfg.final_softcap = 1.5f;
      cfg.sliding_window = x.window;
      cfg.swa_pattern = 2;
    }
    store.reserve(128);
    std::mt19937_64 rng(seed);
    w.config = cfg;
    const int64_t e = cfg.n_embd, qd = 32, kd = 16;
    w.token_embd = make(rng, t, e, cfg.n_vocab, x.gemma2 ? 0.2f : 1.0f);
    w.output_norm = make_norm(rng, e);
    w.output = make(rng, t, e, cfg.n_vocab, 0.3f);
    for (int l = 0; l < cfg.n_layer; ++l) {
      llama_weights::layer L;
      L.attn_norm = make_norm(rng, e);
      L.attn_q = make(rng, t, e, qd, 0.3f);
      L.attn_k = make(rng, t, e, kd, 0.3f);
      L.attn_v = make(rng, t, e, kd, 0.3f);
      L.attn_output = make(rng, t, qd, e, 0.3f);
      L.ffn_norm = make_norm(rng, e);
      L.ffn_gate = make(rng, t, e, cfg.n_ff, 0.3f);
      L.ffn_up = make(rng, t, e, cfg.n_ff, 0.3f);
      L.ffn_down = make(rng, t, cfg.n_ff, e, 0.3f);
      if (x.qkv_bias) {
        L.attn_q_bias = make_vector(rng, qd, 0.5f, 0.0f);
        L.attn_k_bias = make_vector(rng, kd, 0.5f, 0.0f);
        L.attn_v_bias = make_vector(rng, kd, 0.5f, 0.0f);
      }
      if (x.gemma2) {
        L.attn_post_norm = make_norm(rng, e);
        L.ffn_post_norm = make_norm(rng, e);
      }
      if (x.qk_norm) {
        L.attn_q_norm = make_norm(rng, cfg.head_dim);
        L.attn_k_norm = make_norm(rng, cfg.head_dim);
      }
      w.layers.push_back(L);
    }
    if (x.rope_freqs) w.rope_freqs = make_vector(rng, cfg.head_dim / 2, 3.0f, 4.0f);  // divisors in [1, 7]
  }

  tensor_view make(std::mt19937_64& rng, ggml_type t, int64_t cols, int64_t rows, float scale) {
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<uint8_t> bytes(row_bytes(t, cols) * size_t(rows));
    std::vector<float> q8;
    for (int64_t i = 0; i < cols * rows; ++i) {
      const float f = d(rng);
      if (t == ggml_type::f32) std::memcpy(bytes.data() + i * 4, &f, 4);
      else if (t == ggml_type::q8_0) {
        q8.push_back(f);
        if (q8.size() == size_t(q8_0_block)) {  // block full: scale by its max magnitude
          float amax = 0;
          for (float v : q8) amax = std::max(amax, std::fabs(v));
          block_q8_0 blk;
          const float d = amax / 127.0f;
          blk.d = cpu::fp32_to_fp16(d);
          for (int j = 0; j < q8_0_block; ++j) blk.qs[j] = int8_t(std::lround(d > 0 ? q8[size_t(j)] / d : 0.0f));
          std::memcpy(bytes.data() + size_t(i / q8_0_block) * sizeof(block_q8_0), &blk, sizeof blk);
          q8.clear();
        }
      } else {
        const uint16_t h = t == ggml_type::f16 ? cpu::fp32_to_fp16(f) : cpu::fp32_to_bf16(f);
        std::memcpy(bytes.data() + i * 2, &h, 2);
      }
    }
    store.push_back(std::move(bytes));
    tensor_view v;
    v.type = t;
    v.ne[0] = cols;
    v.ne[1] = rows;
    v.n_dims = 2;
    v.data = store.back().data();
    v.nbytes = store.back().size();
    return v;
  }
  /// An f32 vector of n values uniform in [offset - scale, offset + scale].
  tensor_view make_vector(std::mt19937_64& rng, int64_t n, float scale, float offset) {
    tensor_view v = make(rng, ggml_type::f32, n, 1, scale);
    auto* f = static_cast<float*>(const_cast<void*>(v.data));
    for (int64_t i = 0; i < n; ++i) f[i] += offset;
    v.n_dims = 1;
    return v;
  }
  tensor_view make_norm(std::mt19937_64& rng, int64_t n) { return make_vector(rng, n, 0.5f, 1.0f); }  // like trained norms
};

inline std::vector<double> dense(const tensor_view& t) {
  std::vector<float> f(size_t(t.cols() * t.rows()));
  for (int64_t r = 0; r < t.rows(); ++r) cpu::dequantize_row(t.type, t.row(r), f.data() + r * t.cols(), t.cols());
  return {f.begin(), f.end()};
}

/// Naive double-precision forward over a contiguous KV cache: returns logits of every token.
inline std::vector<std::vector<double>> reference_logits(const tiny_model& m, const std::vector<int32_t>& toks) {
  const auto& c = m.cfg;
  const int e = c.n_embd, hd = c.head_dim, nh = c.n_head, nkv = c.n_head_kv, ff = c.n_ff;
  const auto emb = dense(m.w.token_embd);
  // RMSNorm of n-element groups of x (the whole vector, or each head).
  auto norm_groups = [&](const std::vector<double>& x, const tensor_view& w, size_t n) {
    const auto wd = dense(w);
    std::vector<double> y(x.size());
    for (size_t g = 0; g < x.size(); g += n) {
      double ss = 0;
      for (size_t i = 0; i < n; ++i) ss += x[g + i] * x[g + i];
      const double s = 1.0 / std::sqrt(ss / double(n) + double(c.rms_eps));
      for (size_t i = 0; i < n; ++i) y[g + i] = x[g + i] * s * wd[i];
    }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const tensor_view& w) { return norm_groups(x, w, x.size()); };
  auto mv = [](const tensor_view& w, const std::vector<double>& x) {
    const auto wd = dense(w);
    std::vector<double> y(size_t(w.rows()));
    for (int64_t r = 0; r < w.rows(); ++r)
      for (int64_t k = 0; k < w.cols(); ++k) y[size_t(r)] += wd[size_t(r * w.cols() + k)] * x[size_t(k)];
    return y;
  };
  auto add = [](std::vector<double>& y, const tensor_view& b) {
    if (b.data == nullptr) return;
    const auto bd = dense(b);
    for (size_t i = 0; i < y.size(); ++i) y[i] += bd[i];
  };
  const std::vector<double> factors = m.w.rope_freqs.data ? dense(m.w.rope_freqs) : std::vector<double>(size_t(hd / 2), 1.0);
  auto rope = [&](std::vector<double>& v, int heads, int pos) {
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < hd / 2; ++i) {
        const double th = pos * double(c.rope_freq_scale) * std::pow(double(c.rope_freq_base), -2.0 * i / hd) /
                          factors[size_t(i)];
        const bool neox = c.rope == rope_kind::neox;
        double& a = v[size_t(h * hd + (neox ? i : 2 * i))];
        double& b = v[size_t(h * hd + (neox ? i + hd / 2 : 2 * i + 1))];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(th) - b0 * std::sin(th);
        b = a0 * std::sin(th) + b0 * std::cos(th);
      }
  };
  std::vector<std::vector<std::vector<double>>> K(size_t(c.n_layer)), V(size_t(c.n_layer));
  auto cap = [](double v, float c) { return c > 0 ? double(c) * std::tanh(v / double(c)) : v; };
  std::vector<std::vector<double>> out;
  for (size_t p = 0; p < toks.size(); ++p) {
    std::vector<double> x(emb.begin() + toks[p] * e, emb.begin() + (toks[p] + 1) * e);
    if (c.scale_embeddings)
      for (double& v : x) v *= std::sqrt(double(e));
    for (int l = 0; l < c.n_layer; ++l) {
      const auto& W = m.w.layers[size_t(l)];
      auto xn = norm(x, W.attn_norm);
      auto q = mv(W.attn_q, xn), k = mv(W.attn_k, xn), v = mv(W.attn_v, xn);
      add(q, W.attn_q_bias);
      add(k, W.attn_k_bias);
      add(v, W.attn_v_bias);
      if (W.attn_q_norm.data != nullptr) {
        q = norm_groups(q, W.attn_q_norm, size_t(hd));
        k = norm_groups(k, W.attn_k_norm, size_t(hd));
      }
      rope(q, nh, int(p));
      rope(k, nkv, int(p));
      const double q_scale = c.attn_scale > 0 ? double(c.attn_scale) : 1.0 / std::sqrt(double(hd));
      const size_t first = c.is_swa_layer(l) ? size_t(std::max<int64_t>(0, int64_t(p) + 1 - c.sliding_window)) : 0;
      K[size_t(l)].push_back(k);
      V[size_t(l)].push_back(v);
      std::vector<double> att(size_t(nh * hd));
      for (int h = 0; h < nh; ++h) {
        const int g = h / (nh / nkv);
        std::vector<double> s(p + 1);
        double mx = -1e300, tot = 0;
        for (size_t j = first; j <= p; ++j) {
          for (int d = 0; d < hd; ++d) s[j] += q[size_t(h * hd + d)] * K[size_t(l)][j][size_t(g * hd + d)];
          s[j] = cap(s[j] * q_scale, c.attn_softcap);
          mx = std::max(mx, s[j]);
        }
        for (size_t j = first; j <= p; ++j) tot += s[j] = std::exp(s[j] - mx);
        for (size_t j = first; j <= p; ++j)
          for (int d = 0; d < hd; ++d) att[size_t(h * hd + d)] += s[j] / tot * V[size_t(l)][j][size_t(g * hd + d)];
      }
      auto o = mv(W.attn_output, att);
      if (W.attn_post_norm.data != nullptr) o = norm(o, W.attn_post_norm);
      for (int i = 0; i < e; ++i) x[size_t(i)] += o[size_t(i)];
      xn = norm(x, W.ffn_norm);
      auto g = mv(W.ffn_gate, xn);
      const auto u = mv(W.ffn_up, xn);
      for (int i = 0; i < ff; ++i) {
        const double a = g[size_t(i)];
        const double act = c.ffn == ffn_kind::gelu
                               ? 0.5 * a * (1 + std::tanh(std::sqrt(2 / 3.141592653589793) * (a + 0.044715 * a * a * a)))
                               : a / (1 + std::exp(-a));
        g[size_t(i)] = act * u[size_t(i)];
      }
      auto d = mv(W.ffn_down, g);
      if (W.ffn_post_norm.data != nullptr) d = norm(d, W.ffn_post_norm);
      for (int i = 0; i < e; ++i) x[size_t(i)] += d[size_t(i)];
    }
    auto logits = mv(m.w.output, norm(x, m.w.output_norm));
    for (double& v : logits) v = cap(v, c.final_softcap);
    out.push_back(logits);
  }
  return out;
}

}  // namespace tandem::test
