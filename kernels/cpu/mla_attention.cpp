#include "kernels/cpu/mla_attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/mla_attention_avx512.h"
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
  // Tokens in groups of G per head: each cached row (kv_lora_rank + rope_dims floats) is read
  // once per group, instead of once per token. Each (token, head) gets the same bits as its
  // own dot, softmax and axpy calls in the same order (the avx512 group kernels compute
  // exactly those; test_mla compares a chunk with its tokens one by one).
  // A group of one (a decode token) runs the plain calls: the group kernels took twice their
  // time there (measured, 16 heads, context 64 and 512), and 1.2x less from 2 tokens on.
  constexpr int64_t G = mla_detail::kGroup;
  const bool vector = vector_isa(resolve_isa(isa)) == cpu_isa::avx512 && kv_lora_rank % 16 == 0 && rope_dims % 16 == 0;
  std::vector<float> att(static_cast<size_t>(G * n_ctx));
  for (int64_t t0 = 0; t0 < n_tokens; t0 += G) {
    const int64_t gn = std::min(G, n_tokens - t0);
    const int64_t len0 = int64_t(pos0) + t0 + 1;  // token t0 + g attends to [0, len0 + g)
    const bool grouped = vector && gn > 1;
    for (int h = 0; h < n_heads; ++h) {
      const float *ql[G], *qp[G];
      float* o[G];
      for (int64_t g = 0; g < G; ++g) {  // past gn: valid pointers the kernels never read
        const int64_t th = (t0 + std::min(g, gn - 1)) * n_heads + h;
        ql[g] = q_lat + th * kv_lora_rank, qp[g] = q_pe + th * rope_dims, o[g] = out + th * kv_lora_rank;
      }
      if (grouped) {
        mla_detail::group_scores(ql, qp, int(gn), len0, rows.data(), kv_lora_rank, rope_dims, scale, att.data(), n_ctx);
      } else {
        for (int64_t p = 0; p < len0 + gn - 1; ++p)
          for (int64_t g = std::max<int64_t>(0, p - len0 + 1); g < gn; ++g)
            att[size_t(g * n_ctx + p)] = (dot(ql[g], rows[size_t(p)], kv_lora_rank, isa) +
                                          dot(qp[g], rows[size_t(p)] + kv_lora_rank, rope_dims, isa)) * scale;
      }
      for (int64_t g = 0; g < gn; ++g) softmax(att.data() + g * n_ctx, size_t(len0 + g), isa);
      if (grouped) {
        mla_detail::group_values(att.data(), n_ctx, int(gn), len0, rows.data(), kv_lora_rank, o);
      } else {
        for (int64_t g = 0; g < gn; ++g) std::fill(o[g], o[g] + kv_lora_rank, 0.0f);
        for (int64_t p = 0; p < len0 + gn - 1; ++p)
          for (int64_t g = std::max<int64_t>(0, p - len0 + 1); g < gn; ++g)
            axpy(att[size_t(g * n_ctx + p)], rows[size_t(p)], o[g], kv_lora_rank, isa);
      }
    }
  }
}

}  // namespace tandem::cpu
