#include "kernels/cpu/llama_cpu.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "actors/common/error.h"
#include "kernels/cpu/aligned_vector.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem {

namespace {

void check_shape(const tensor_view& t, const std::string& name, int64_t cols, int64_t rows) {
  if (t.data == nullptr) throw tandem::error(fmt::format("model tensor {} is missing", name));
  if (!is_supported(t.type))
    throw tandem::error(fmt::format("model tensor {} has type {}; supported are f32, f16, bf16, q8_0", name,
                                    to_string(t.type)));
  if (t.cols() != cols || t.rows() != rows)
    throw tandem::error(fmt::format("model tensor {} is {}x{} (cols x rows), expected {}x{}", name, t.cols(),
                                    t.rows(), cols, rows));
  if (t.type == ggml_type::q8_0 && cols % q8_0_block != 0)
    throw tandem::error(fmt::format("model tensor {} is q8_0 with {} columns, not a multiple of 32", name, cols));
  if (t.nbytes != 0 && t.nbytes < row_bytes(t.type, cols) * size_t(rows))
    throw tandem::error(fmt::format("model tensor {} holds {} bytes, needs {}", name, t.nbytes,
                                    row_bytes(t.type, cols) * size_t(rows)));
}

std::vector<float> to_f32(const tensor_view& t) {
  std::vector<float> out(size_t(t.cols()));
  cpu::dequantize_row(t.type, t.row(0), out.data(), t.cols());
  return out;
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
    if (int32_t(w_.layers.size()) != c.n_layer)
      throw tandem::error(fmt::format("model has {} layers of weights but n_layer={}", w_.layers.size(), c.n_layer));
    const int64_t e = c.n_embd, qd = int64_t(c.n_head) * c.head_dim, kd = int64_t(c.n_head_kv) * c.head_dim;
    check_shape(w_.token_embd, "token_embd.weight", e, c.n_vocab);
    check_shape(w_.output_norm, "output_norm.weight", e, 1);
    if (w_.output.data == nullptr) w_.output = w_.token_embd;  // tied embeddings
    check_shape(w_.output, "output.weight", e, c.n_vocab);
    output_norm_ = to_f32(w_.output_norm);
    for (int32_t l = 0; l < c.n_layer; ++l) {
      const auto& L = w_.layers[size_t(l)];
      auto n = [l](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
      check_shape(L.attn_norm, n("attn_norm"), e, 1);
      check_shape(L.attn_q, n("attn_q"), e, qd);
      check_shape(L.attn_k, n("attn_k"), e, kd);
      check_shape(L.attn_v, n("attn_v"), e, kd);
      check_shape(L.attn_output, n("attn_output"), qd, e);
      check_shape(L.ffn_norm, n("ffn_norm"), e, 1);
      check_shape(L.ffn_gate, n("ffn_gate"), e, c.n_ff);
      check_shape(L.ffn_up, n("ffn_up"), e, c.n_ff);
      check_shape(L.ffn_down, n("ffn_down"), c.n_ff, e);
      attn_norm_.push_back(to_f32(L.attn_norm));
      ffn_norm_.push_back(to_f32(L.ffn_norm));
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

  kv_layout layout(int32_t page_size) const override {
    return kv_layout{.n_layers = w_.config.n_layer, .n_kv_heads = w_.config.n_head_kv,
                     .head_dim = w_.config.head_dim, .page_size = page_size, .dtype = opt_.kv};
  }

  void forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) override;

 private:
  llama_weights w_;
  cpu_options opt_;
  cpu_isa isa_;  // resolved once: a path this CPU runs
  cpu::thread_pool pool_;
  std::vector<float> output_norm_;
  std::vector<std::vector<float>> attn_norm_, ffn_norm_;
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
  tok_.clear();
  pos_.clear();
  size_t n_logits = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const batch_seq& b = batch[s];
    const int64_t end = int64_t(b.pos) + int64_t(b.tokens.size());
    if (b.pos < 0) throw tandem::error(fmt::format("batch sequence {}: negative position {}", s, b.pos));
    if (b.want_logits && b.tokens.empty())
      throw tandem::error(fmt::format("batch sequence {} wants logits but has no new tokens", s));
    if (c.n_ctx > 0 && end > c.n_ctx)
      throw tandem::error(fmt::format("batch sequence {}: positions up to {} exceed the context length {}", s, end,
                                      c.n_ctx));
    if (int64_t(b.pages.size()) * ps < end)
      throw tandem::error(fmt::format("batch sequence {}: {} pages of {} tokens cannot hold {} positions; "
                                      "allocate more pages",
                                      s, b.pages.size(), ps, end));
    // Every page attention reads ([0, end)), not only the ones written now.
    for (int64_t i = 0; i < (end + ps - 1) / ps; ++i) {
      const int32_t page = b.pages[size_t(i)];
      if (page < 0 || page >= pool.n_pages())
        throw tandem::error(fmt::format("batch sequence {}: page id {} is outside the pool of {} pages", s, page,
                                        pool.n_pages()));
    }
    for (size_t i = 0; i < b.tokens.size(); ++i) {
      if (b.tokens[i] < 0 || b.tokens[i] >= c.n_vocab)
        throw tandem::error(fmt::format("batch sequence {}: token id {} is out of range [0, {})", s, b.tokens[i],
                                        c.n_vocab));
      tok_.push_back(b.tokens[i]);
      pos_.push_back(b.pos + int32_t(i));
    }
    n_logits += b.want_logits ? 1 : 0;
  }
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
  rope_.build(pos_.data(), T, int(hd), c.rope_freq_base);  // the same angles for every layer

  for (int32_t l = 0; l < c.n_layer; ++l) {
    const packed_layer& W = packed_[size_t(l)];
    cpu::rms_norm(x_.data(), attn_norm_[size_t(l)].data(), xn_.data(), T, e, c.rms_eps, &pool_);
    // Q, K and V (and below gate and up) read the same input: one fork-join for all three.
    const cpu::packed_weight* qkv_w[] = {&W.attn_q, &W.attn_k, &W.attn_v};
    float* const qkv_y[] = {q_.data(), k_.data(), v_.data()};
    cpu::matmul_many(qkv_w, xn_.data(), T, qkv_y, mm_scratch_, &pool_);
    cpu::rope(q_.data(), rope_, c.n_head, &pool_);
    cpu::rope(k_.data(), rope_, c.n_head_kv, &pool_);
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
    cpu::paged_attention_batch(attn_, c.n_head, pool, l, &pool_, isa_);
    cpu::matmul(W.attn_output, att_.data(), T, tmp_.data(), mm_scratch_, &pool_);
    cpu::add_inplace(x_.data(), tmp_.data(), T * e, &pool_);

    cpu::rms_norm(x_.data(), ffn_norm_[size_t(l)].data(), xn_.data(), T, e, c.rms_eps, &pool_);
    const cpu::packed_weight* gate_up_w[] = {&W.ffn_gate, &W.ffn_up};
    float* const gate_up_y[] = {gate_.data(), up_.data()};
    cpu::matmul_many(gate_up_w, xn_.data(), T, gate_up_y, mm_scratch_, &pool_);
    cpu::swiglu(gate_.data(), up_.data(), gate_.data(), size_t(T * c.n_ff), &pool_, isa_);
    cpu::matmul(W.ffn_down, gate_.data(), T, tmp_.data(), mm_scratch_, &pool_);
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
}

}  // namespace

std::unique_ptr<llama_model> make_cpu_llama(const llama_weights& w, const cpu_options& opt) {
  return std::make_unique<cpu_llama>(w, opt);
}

}  // namespace tandem
