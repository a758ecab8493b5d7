#include "kernels/model/arch/qwen3.h"

#include <fmt/format.h>

#include "kernels/model/arch/dense.h"

namespace tandem::arch {

namespace {

model_config config_of(const gguf::file& f) { return read_dense_config(f, "qwen3", rope_kind::neox); }

llama_weights weights_of(const gguf::file& f, const model_config& c) {
  llama_weights w = read_dense_weights(f, c);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    auto t = [&](const char* s) { return f.tensor(fmt::format("blk.{}.{}.weight", l, s)).view(); };
    auto& L = w.layers[size_t(l)];
    L.attn_q_norm = t("attn_q_norm");
    L.attn_k_norm = t("attn_k_norm");
  }
  return w;
}

}  // namespace

const architecture& qwen3_architecture() {
  static constexpr architecture a{"qwen3", config_of, load_dense<weights_of>};
  return a;
}

}  // namespace tandem::arch
