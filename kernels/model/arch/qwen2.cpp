#include "kernels/model/arch/qwen2.h"

#include <fmt/format.h>

#include "kernels/model/arch/dense.h"

namespace tandem::arch {

namespace {

model_config config_of(const gguf::file& f) { return read_dense_config(f, "qwen2", rope_kind::neox); }

llama_weights weights_of(const gguf::file& f, const model_config& c) {
  llama_weights w = read_dense_weights(f, c);
  for (int32_t l = 0; l < c.n_layer; ++l) {
    auto bias = [&](const char* s) { return f.tensor(fmt::format("blk.{}.{}.bias", l, s)).view(); };
    auto& L = w.layers[size_t(l)];
    L.attn_q_bias = bias("attn_q");
    L.attn_k_bias = bias("attn_k");
    L.attn_v_bias = bias("attn_v");
  }
  return w;
}

}  // namespace

const architecture& qwen2_architecture() {
  static constexpr architecture a{"qwen2", config_of, load_dense<weights_of>};
  return a;
}

}  // namespace tandem::arch
