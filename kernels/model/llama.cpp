#include "kernels/model/llama.h"

#include <fmt/format.h>

#include "actors/common/error.h"
#include "kernels/cpu/llama_cpu.h"

namespace tandem {

std::unique_ptr<llama_model> llama_model::load(const gguf::file& f, const cpu_options& opt) {
  if (const auto* arch = f.find("general.architecture"); arch && arch->as_string() != "llama")
    throw tandem::error(error_kind::unimplemented,
                        fmt::format("{}: architecture '{}' is not supported; only 'llama' is", f.name(),
                                    arch->as_string()));
  llama_weights w;
  model_config& c = w.config;
  const auto* name = f.find("general.name");
  c.name = name ? name->as_string() : f.name();
  c.n_embd = int32_t(f.get_u32("llama.embedding_length"));
  c.n_layer = int32_t(f.get_u32("llama.block_count"));
  c.n_head = int32_t(f.get_u32("llama.attention.head_count"));
  c.n_head_kv = int32_t(f.get_u64_or("llama.attention.head_count_kv", uint64_t(c.n_head)));
  c.n_ff = int32_t(f.get_u32("llama.feed_forward_length"));
  c.n_ctx = int32_t(f.get_u32("llama.context_length"));
  c.rope_freq_base = f.get_f32_or("llama.rope.freq_base", 10000.0f);
  c.rms_eps = f.get_f32_or("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  if (c.n_head <= 0 || c.n_embd % c.n_head != 0)
    throw tandem::error(fmt::format("{}: llama.embedding_length {} is not a multiple of head_count {}", f.name(),
                                    c.n_embd, c.n_head));
  c.head_dim = c.n_embd / c.n_head;

  w.token_embd = f.tensor("token_embd.weight").view();
  c.n_vocab = int32_t(w.token_embd.rows());
  w.output_norm = f.tensor("output_norm.weight").view();
  if (const auto* out = f.find_tensor("output.weight")) w.output = out->view();
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
  return make_cpu_llama(w, opt);
}

}  // namespace tandem
