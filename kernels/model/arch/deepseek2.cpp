#include "kernels/model/arch/deepseek2.h"

#include <fmt/format.h>

#include <cmath>
#include <set>

#include "kernels/base/error.h"
#include "kernels/model/arch/deepseek2_forward.h"
#include "kernels/model/arch/dense.h"

namespace tandem::arch {

namespace {

constexpr std::string_view k_arch = "deepseek2";

/// `deepseek2.<k>`
std::string dk(std::string_view k) { return key(k_arch, k); }

/// An optional size key: `def` when absent, else a value in [0, 2^30].
int32_t size_or(const gguf::file& f, const std::string& k, int32_t def) {
  if (f.find(k) == nullptr) return def;
  const uint64_t v = f.get_u64(k);
  if (v > uint64_t(1) << 30)
    throw tandem::error(fmt::format("{}: metadata {} = {} is out of range", f.name(), k, v));
  return int32_t(v);
}

model_config config_of(const gguf::file& f) {
  model_config c = read_base_config(f, k_arch, rope_kind::normal);
  if (f.find(dk("attention.key_length_mla")) == nullptr)
    throw tandem::error(error_kind::unimplemented,
                        fmt::format("{}: {} is missing: this is an older deepseek2 conversion with the joint "
                                    "attn_kv_b tensor; convert the model again with a current llama.cpp "
                                    "(convert_hf_to_gguf.py writes attn_k_b / attn_v_b and key_length_mla)",
                                    f.name(), dk("attention.key_length_mla")));
  c.kv_lora_rank = required(f, dk("attention.kv_lora_rank"));
  c.q_lora_rank = size_or(f, dk("attention.q_lora_rank"), 0);
  c.rope_dims = required(f, dk("rope.dimension_count"));
  c.head_dim = required(f, dk("attention.key_length_mla"));
  c.v_head_dim = required(f, dk("attention.value_length_mla"));
  if (c.rope_dims % 2 != 0 || c.rope_dims >= c.head_dim)
    throw tandem::error(fmt::format("{}: {} = {} must be even and below {} = {}", f.name(), dk("rope.dimension_count"),
                                    c.rope_dims, dk("attention.key_length_mla"), c.head_dim));
  // The cache row: the latent and the roped key part (key_length), the latent alone as values.
  if (const int32_t k = size_or(f, dk("attention.key_length"), c.kv_lora_rank + c.rope_dims);
      k != c.kv_lora_rank + c.rope_dims)
    throw tandem::error(fmt::format("{}: {} = {}, expected kv_lora_rank + rope dimensions = {}", f.name(),
                                    dk("attention.key_length"), k, c.kv_lora_rank + c.rope_dims));
  if (const int32_t v = size_or(f, dk("attention.value_length"), c.kv_lora_rank); v != c.kv_lora_rank)
    throw tandem::error(fmt::format("{}: {} = {}, expected kv_lora_rank = {}", f.name(), dk("attention.value_length"),
                                    v, c.kv_lora_rank));
  // llama.cpp's converter stores 0.1 x DeepSeek's mscale_all_dim; its loader divides it out.
  c.yarn.log_mul /= 0.1f;
  c.n_dense_lead = size_or(f, dk("leading_dense_block_count"), 0);
  if (c.n_dense_lead > c.n_layer)
    throw tandem::error(fmt::format("{}: {} = {} exceeds {} = {}", f.name(), dk("leading_dense_block_count"),
                                    c.n_dense_lead, dk("block_count"), c.n_layer));
  if (c.n_dense_lead < c.n_layer) {
    c.n_expert = required(f, dk("expert_count"));
    c.n_expert_used = required(f, dk("expert_used_count"));
    if (c.n_expert_used > c.n_expert)
      throw tandem::error(fmt::format("{}: {} = {} exceeds {} = {}", f.name(), dk("expert_used_count"),
                                      c.n_expert_used, dk("expert_count"), c.n_expert));
    c.n_ff_exp = required(f, dk("expert_feed_forward_length"));
    c.n_expert_shared = size_or(f, dk("expert_shared_count"), 0);
    c.expert_weights_scale = f.get_f32_or(dk("expert_weights_scale"), 1.0f);
    if (!(c.expert_weights_scale > 0.0f && std::isfinite(c.expert_weights_scale)))
      throw tandem::error(fmt::format("{}: {} = {} must be a positive number", f.name(), dk("expert_weights_scale"),
                                      c.expert_weights_scale));
    const auto* norm = f.find(dk("expert_weights_norm"));
    c.expert_weights_norm = norm != nullptr && norm->as_bool();
    // Absent: softmax, as DeepSeek-V2/V2.5 files have it (V3 writes 2, sigmoid).
    c.expert_gating = size_or(f, dk("expert_gating_func"), 1);
    if (c.expert_gating == 0) c.expert_gating = 1;
    if (c.expert_gating != 1 && c.expert_gating != 2)
      throw tandem::error(fmt::format("{}: {} = {} is not 1 (softmax) or 2 (sigmoid)", f.name(),
                                      dk("expert_gating_func"), c.expert_gating));
  }
  return c;
}

deepseek2_weights weights_of(const gguf::file& f, const model_config& c) {
  deepseek2_weights w;
  w.config = c;
  w.token_embd = f.tensor("token_embd.weight").view();
  w.config.n_vocab = vocab_rows(f, k_arch, w.token_embd);
  w.output_norm = f.tensor("output_norm.weight").view();
  w.output = optional_tensor(f, "output.weight");
  for (int32_t l = 0; l < c.n_layer; ++l) {
    auto name = [&](const char* s) { return fmt::format("blk.{}.{}.weight", l, s); };
    auto t = [&](const char* s) { return f.tensor(name(s)).view(); };
    deepseek2_weights::layer L;
    L.attn_norm = t("attn_norm");
    if (c.q_lora_rank > 0) {
      L.attn_q_a = t("attn_q_a");
      L.attn_q_a_norm = t("attn_q_a_norm");
      L.attn_q_b = t("attn_q_b");
    } else {
      L.attn_q = t("attn_q");
    }
    L.attn_kv_a_mqa = t("attn_kv_a_mqa");
    L.attn_kv_a_norm = t("attn_kv_a_norm");
    L.attn_k_b = t("attn_k_b");
    L.attn_v_b = t("attn_v_b");
    L.attn_output = t("attn_output");
    L.ffn_norm = t("ffn_norm");
    if (l < c.n_dense_lead) {
      L.ffn_gate = t("ffn_gate");
      L.ffn_up = t("ffn_up");
      L.ffn_down = t("ffn_down");
    } else {
      L.ffn_gate_inp = t("ffn_gate_inp");
      L.ffn_gate_exps = t("ffn_gate_exps");
      L.ffn_up_exps = t("ffn_up_exps");
      L.ffn_down_exps = t("ffn_down_exps");
      if (c.n_expert_shared > 0) {
        L.ffn_gate_shexp = t("ffn_gate_shexp");
        L.ffn_up_shexp = t("ffn_up_shexp");
        L.ffn_down_shexp = t("ffn_down_shexp");
      }
      L.exp_probs_b = optional_tensor(f, fmt::format("blk.{}.exp_probs_b.bias", l));
    }
    w.layers.push_back(L);
  }
  return w;
}

std::unique_ptr<llama_model> load_of(const gguf::file& f, const model_config& c, const cpu_options& opt) {
  const deepseek2_weights w = weights_of(f, c);
  std::set<const void*> used;
  w.for_each_view([&](const tensor_view& t) { used.insert(t.data); });
  refuse_unused_tensors(f, k_arch, used);
  return make_cpu_deepseek2(w, opt);
}

}  // namespace

const architecture& deepseek2_architecture() {
  static constexpr architecture a{"deepseek2", config_of, load_of};
  return a;
}

}  // namespace tandem::arch
