#include "kernels/cpu/mla_attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"

namespace tandem::cpu {

kv_layout mla_layout(int32_t n_layers, int32_t kv_lora_rank, int32_t rope_dims, int32_t page_size) {
  return kv_layout{.n_layers = n_layers,
                   .n_kv_heads = 1,
                   .head_dim = kv_lora_rank + rope_dims,
                   .page_size = page_size,
                   .components = {kv_component{"latent", 1, kv_lora_rank + rope_dims, 4}}};
}

void mla_attention(const float* q_lat, const float* q_pe, int64_t n_tokens, int32_t pos0, int n_heads,
                   int32_t kv_lora_rank, int32_t rope_dims, float scale, const kv_pool& pool, int32_t layer,
                   std::span<const int32_t> pages, float* out, cpu_isa isa) {
  const kv_layout& L = pool.layout();
  const int32_t width = kv_lora_rank + rope_dims;
  if (L.components.size() != 1 || L.components[0].name != "latent" || L.components[0].head_dim != width ||
      L.components[0].n_heads != 1 || L.components[0].elem_bytes != 4)
    throw tandem::error(fmt::format("mla attention: the KV pool ({}) is not a latent layout of {} + {} floats",
                                    L.describe(), kv_lora_rank, rope_dims));
  const int64_t n_ctx = int64_t(pos0) + n_tokens;
  if (int64_t(pages.size()) * L.page_size < n_ctx)
    throw tandem::error(fmt::format("mla attention: {} pages of {} tokens cannot hold {} positions", pages.size(),
                                    L.page_size, n_ctx));
  // The cached rows of every position, once for all heads and tokens.
  std::vector<const float*> rows(static_cast<size_t>(n_ctx));
  for (int64_t p = 0; p < n_ctx; ++p) {
    const int32_t page = pages[size_t(p / L.page_size)];
    const auto* base = reinterpret_cast<const float*>(const_cast<kv_pool&>(pool).component(page, layer, 0));
    rows[size_t(p)] = base + size_t(p % L.page_size) * size_t(width);
  }
  std::vector<float> att(static_cast<size_t>(n_ctx));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t len = int64_t(pos0) + t + 1;
    for (int h = 0; h < n_heads; ++h) {
      const float* ql = q_lat + (t * n_heads + h) * kv_lora_rank;
      const float* qp = q_pe + (t * n_heads + h) * rope_dims;
      for (int64_t p = 0; p < len; ++p)
        att[size_t(p)] = (dot(ql, rows[size_t(p)], kv_lora_rank, isa) +
                          dot(qp, rows[size_t(p)] + kv_lora_rank, rope_dims, isa)) * scale;
      softmax(att.data(), size_t(len), isa);
      float* o = out + (t * n_heads + h) * kv_lora_rank;
      std::fill(o, o + kv_lora_rank, 0.0f);
      for (int64_t p = 0; p < len; ++p) axpy(att[size_t(p)], rows[size_t(p)], o, kv_lora_rank, isa);
    }
  }
}

}  // namespace tandem::cpu
