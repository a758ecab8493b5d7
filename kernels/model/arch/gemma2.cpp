#include "kernels/model/arch/gemma2.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/base/error.h"
#include "kernels/model/arch/dense.h"

namespace tandem::arch {

namespace {

/// An optional positive float key (llama.cpp's defaults when absent).
float positive_f32(const gguf::file& f, const std::string& key, float def) {
  const float v = f.get_f32_or(key, def);
  if (!(v > 0.0f && std::isfinite(v)))
    throw tandem::error(fmt::format("{}: {} = {} must be a positive number", f.name(), key, v));
  return v;
}

model_config config_of(const gguf::file& f) {
  model_config c = read_dense_config(f, "gemma2", rope_kind::neox);
  c.ffn = ffn_kind::gelu;
  c.scale_embeddings = true;
  // llama.cpp's rule (after gemma_pytorch): the 27B (46 layers) scales by the width per head,
  // every other size by the head size.
  c.attn_scale = 1.0f / std::sqrt(float(c.n_layer == 46 ? c.n_embd / c.n_head : c.head_dim));
  c.attn_softcap = positive_f32(f, "gemma2.attn_logit_softcapping", 50.0f);
  c.final_softcap = positive_f32(f, "gemma2.final_logit_softcapping", 30.0f);
  const uint64_t window = f.get_u64_or("gemma2.attention.sliding_window", 4096);
  if (window == 0 || window > uint64_t(1) << 30)
    throw tandem::error(fmt::format("{}: gemma2.attention.sliding_window = {} must be a positive size", f.name(), window));
  c.sliding_window = int32_t(window);
  c.swa_pattern = 2;  // every even layer slides, as llama.cpp's set_swa_pattern(2)
  return c;
}

llama_weights weights_of(const gguf::file& f, const model_config& c) {
  llama_weights w = read_dense_weights(f, c);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    auto t = [&](const char* s) { return f.tensor(fmt::format("blk.{}.{}.weight", l, s)).view(); };
    auto& L = w.layers[size_t(l)];
    L.attn_post_norm = t("post_attention_norm");
    L.ffn_post_norm = t("post_ffw_norm");
  }
  return w;
}

}  // namespace

const architecture& gemma2_architecture() {
  static constexpr architecture a{"gemma2", config_of, load_dense<weights_of>};
  return a;
}

}  // namespace tandem::arch
