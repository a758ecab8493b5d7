#pragma once
/// Multi-head latent attention (DeepSeek-V2/V3 MLA) over paged KV that caches one latent
/// vector per position instead of K and V per head: the cache component "latent" holds
/// [kv_lora_rank normalised latent c | rope_dims roped key part k_pe] (f32) per position, so
/// a token costs (kv_lora_rank + rope_dims) * 4 bytes per layer whatever the head count. The
/// queries arrive absorbed: q_nope of head h multiplied by that head's W_UK^T gives a query in
/// latent space, and the output stays in latent space until W_UV maps it back per head.
#include <cstdint>
#include <span>

#include "kernels/cpu/isa.h"
#include "kernels/model/kv_pool.h"

namespace tandem::cpu {

/// The KV layout of an MLA model: one "latent" component of kv_lora_rank + rope_dims f32
/// values per position and layer.
kv_layout mla_layout(int32_t n_layers, int32_t kv_lora_rank, int32_t rope_dims, int32_t page_size);

/// One sequence's absorbed MLA attention for layer `layer`:
///   score(t, h, p) = scale * (q_lat[t][h] . c_p + q_pe[t][h] . k_pe_p), causal over p <= pos0 + t,
///   out[t][h] = sum_p softmax(score)_p * c_p
/// q_lat is [n_tokens][n_heads][kv_lora_rank], q_pe [n_tokens][n_heads][rope_dims], out
/// [n_tokens][n_heads][kv_lora_rank]. Positions [0, pos0 + n_tokens) must be in `pages`. Each
/// (token, head) row depends only on its own inputs (same bits for any batch or chunk).
/// Throws tandem::error if the pool is not an MLA layout of these sizes.
void mla_attention(const float* q_lat, const float* q_pe, int64_t n_tokens, int32_t pos0, int n_heads,
                   int32_t kv_lora_rank, int32_t rope_dims, float scale, const kv_pool& pool, int32_t layer,
                   std::span<const int32_t> pages, float* out, cpu_isa isa = cpu_isa::best);

}  // namespace tandem::cpu
