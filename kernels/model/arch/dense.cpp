#include "kernels/model/arch/dense.h"

#include <fmt/format.h>

#include <cmath>
#include <set>
#include <string>

#include "kernels/base/error.h"
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

std::string key(std::string_view arch, std::string_view k) { return fmt::format("{}.{}", arch, k); }

int32_t positive(const gguf::file& f, const std::string& k, uint64_t v) {
  if (v == 0 || v > uint64_t(1) << 30)
    throw tandem::error(fmt::format("{}: metadata {} = {} is out of range; it must be a positive size", f.name(), k, v));
  return int32_t(v);
}

int32_t required(const gguf::file& f, const std::string& k) { return positive(f, k, f.get_u64(k)); }

namespace {

/// `<arch>.rope.scaling.*`: linear scaling into c.rope_freq_scale, YaRN into c.yarn (run after
/// the context length is read: YaRN's original context defaults to it, as in llama.cpp).
void read_rope_scaling(const gguf::file& f, std::string_view arch, model_config& c) {
  const std::string scaling = key(arch, "rope.scaling.type");
  const auto* t = f.find(scaling);
  if (t == nullptr || t->as_string() == "none") return;
  const std::string type = t->as_string();
  if (type != "linear" && type != "yarn")
    throw tandem::error(error_kind::unimplemented,
                        fmt::format("{}: {} = '{}' is not supported; supported are none, linear and yarn (Llama 3 "
                                    "scaling comes as the rope_freqs.weight tensor)",
                                    f.name(), scaling, type));
  const std::string factor = key(arch, "rope.scaling.factor");
  const float s = f.get_f32(factor);
  if (!(s >= 1.0f && std::isfinite(s)))
    throw tandem::error(fmt::format("{}: {} = {} must be a finite number >= 1", f.name(), factor, s));
  if (type == "linear") {
    c.rope_freq_scale = 1.0f / s;
    return;
  }
  yarn_scaling& y = c.yarn;
  y.factor = s;
  y.orig_ctx = positive(f, key(arch, "rope.scaling.original_context_length"),
                        f.get_u64_or(key(arch, "rope.scaling.original_context_length"), uint64_t(c.n_ctx)));
  y.beta_fast = f.get_f32_or(key(arch, "rope.scaling.yarn_beta_fast"), y.beta_fast);
  y.beta_slow = f.get_f32_or(key(arch, "rope.scaling.yarn_beta_slow"), y.beta_slow);
  y.log_mul = f.get_f32_or(key(arch, "rope.scaling.yarn_log_multiplier"), y.log_mul);
  y.attn_factor = f.get_f32_or(key(arch, "rope.scaling.attn_factor"), y.attn_factor);
  for (const auto& [k, v] : {std::pair{"yarn_beta_fast", y.beta_fast}, {"yarn_beta_slow", y.beta_slow},
                             {"attn_factor", y.attn_factor}})
    if (!(v > 0.0f && std::isfinite(v)))
      throw tandem::error(fmt::format("{}: {} = {} must be a positive number", f.name(),
                                      key(arch, std::string("rope.scaling.") + k), v));
  if (!(y.log_mul >= 0.0f && std::isfinite(y.log_mul)))
    throw tandem::error(fmt::format("{}: {} = {} must be a number >= 0", f.name(),
                                    key(arch, "rope.scaling.yarn_log_multiplier"), y.log_mul));
}

}  // namespace

model_config read_base_config(const gguf::file& f, std::string_view arch, rope_kind rope) {
  model_config c;
  c.arch = std::string(arch);
  const auto* name = f.find("general.name");
  c.name = name ? name->as_string() : f.name();
  c.n_embd = required(f, key(arch, "embedding_length"));
  c.n_layer = required(f, key(arch, "block_count"));
  c.n_head = required(f, key(arch, "attention.head_count"));
  c.n_head_kv = positive(f, key(arch, "attention.head_count_kv"),
                         f.get_u64_or(key(arch, "attention.head_count_kv"), uint64_t(c.n_head)));
  c.n_ff = required(f, key(arch, "feed_forward_length"));
  c.n_ctx = required(f, key(arch, "context_length"));
  c.rope_freq_base = f.get_f32_or(key(arch, "rope.freq_base"), 10000.0f);
  c.rms_eps = f.get_f32_or(key(arch, "attention.layer_norm_rms_epsilon"), 1e-5f);
  c.rope = rope;
  if (c.n_head % c.n_head_kv != 0)
    throw tandem::error(fmt::format("{}: {} = {} is not a multiple of {} = {}", f.name(),
                                    key(arch, "attention.head_count"), c.n_head,
                                    key(arch, "attention.head_count_kv"), c.n_head_kv));
  read_rope_scaling(f, arch, c);
  if (!(c.rms_eps > 0.0f && std::isfinite(c.rms_eps)))
    throw tandem::error(fmt::format("{}: {} = {} must be a small positive number", f.name(),
                                    key(arch, "attention.layer_norm_rms_epsilon"), c.rms_eps));
  if (!(c.rope_freq_base > 0.0f && std::isfinite(c.rope_freq_base)))
    throw tandem::error(fmt::format("{}: {} = {} must be positive", f.name(), key(arch, "rope.freq_base"),
                                    c.rope_freq_base));
  return c;
}

model_config read_dense_config(const gguf::file& f, std::string_view arch, rope_kind rope) {
  model_config c = read_base_config(f, arch, rope);
  // The head size: key_length when given (Qwen3 and others decouple it from the width),
  // else the width split over the heads.
  const std::string k_len = key(arch, "attention.key_length");
  if (f.find(k_len) != nullptr) {
    c.head_dim = required(f, k_len);
  } else {
    if (c.n_embd % c.n_head != 0)
      throw tandem::error(fmt::format("{}: {} = {} is not a multiple of {} = {}; set {}", f.name(),
                                      key(arch, "embedding_length"), c.n_embd, key(arch, "attention.head_count"),
                                      c.n_head, k_len));
    c.head_dim = c.n_embd / c.n_head;
  }
  if (c.head_dim % 2 != 0)
    throw tandem::error(fmt::format("{}: head size {} is odd; RoPE needs an even head size", f.name(), c.head_dim));
  const std::string v_len = key(arch, "attention.value_length");
  if (f.find(v_len) != nullptr && f.get_u64(v_len) != uint64_t(c.head_dim))
    throw tandem::error(fmt::format("{}: {} = {} differs from the key length {}; this engine needs them equal",
                                    f.name(), v_len, f.get_u64(v_len), c.head_dim));
  const std::string rope_dims = key(arch, "rope.dimension_count");
  if (f.find(rope_dims) != nullptr && f.get_u64(rope_dims) != uint64_t(c.head_dim))
    throw tandem::error(fmt::format("{}: {} = {}, expected the head size {} (partial RoPE is not supported for {})",
                                    f.name(), rope_dims, f.get_u64(rope_dims), c.head_dim, arch));
  return c;
}

tensor_view optional_tensor(const gguf::file& f, const std::string& name) {
  const auto* t = f.find_tensor(name);
  return t != nullptr ? t->view() : tensor_view{};
}

int32_t vocab_rows(const gguf::file& f, std::string_view arch, const tensor_view& token_embd) {
  const int32_t n = positive(f, "token_embd.weight rows", uint64_t(token_embd.rows()));
  const std::string vocab_key = key(arch, "vocab_size");
  if (f.find(vocab_key) != nullptr && f.get_u64(vocab_key) != uint64_t(n))
    throw tandem::error(
        fmt::format("{}: {} = {} but token_embd.weight has {} rows", f.name(), vocab_key, f.get_u64(vocab_key), n));
  return n;
}

std::unique_ptr<llama_model> make_dense(const gguf::file& f, const llama_weights& w, const cpu_options& opt) {
  std::set<const void*> used;
  w.for_each_view([&](const tensor_view& t) { used.insert(t.data); });
  refuse_unused_tensors(f, w.config.arch, used);
  return make_cpu_llama(w, opt);
}

llama_weights read_dense_weights(const gguf::file& f, const model_config& c) {
  llama_weights w;
  w.config = c;
  w.token_embd = f.tensor("token_embd.weight").view();
  w.config.n_vocab = vocab_rows(f, c.arch, w.token_embd);
  w.output_norm = f.tensor("output_norm.weight").view();
  w.output = optional_tensor(f, "output.weight");
  w.rope_freqs = optional_tensor(f, "rope_freqs.weight");
  for (int32_t l = 0; l < c.n_layer; ++l) {
    auto t = [&](const char* s) { return f.tensor(fmt::format("blk.{}.{}.weight", l, s)).view(); };
    llama_weights::layer L;
    L.attn_norm = t("attn_norm");
    L.attn_q = t("attn_q");
    L.attn_k = t("attn_k");
    L.attn_v = t("attn_v");
    L.attn_output = t("attn_output");
    L.ffn_norm = t("ffn_norm");
    L.ffn_gate = t("ffn_gate");
    L.ffn_up = t("ffn_up");
    L.ffn_down = t("ffn_down");
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace tandem::arch
