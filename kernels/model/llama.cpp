#include "kernels/model/llama.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/backend/backend.h"
#include "kernels/base/error.h"
#include "kernels/cpu/mla_attention.h"
#include "kernels/model/arch/registry.h"

namespace tandem {

kv_layout model_kv_layout(const model_config& c, int32_t page_size, kv_dtype dtype) {
  if (c.kv_lora_rank > 0) {
    if (dtype != kv_dtype::f32)
      throw tandem::error("an MLA model's latent KV cache is f32 only; set [model] kv_cache_dtype = \"f32\"");
    return cpu::mla_layout(c.n_layer, c.kv_lora_rank, c.rope_dims, page_size);
  }
  return kv_layout{.n_layers = c.n_layer, .n_kv_heads = c.n_head_kv, .head_dim = c.head_dim, .page_size = page_size,
                   .dtype = dtype};
}

kv_pools_layout model_pools_layout(const model_config& c, int32_t page_size, kv_dtype dtype) {
  const kv_layout all = model_kv_layout(c, page_size, dtype);
  kv_pool_spec full{.name = "full", .page = all}, window{.name = "window", .page = all};
  window.window_tokens = c.sliding_window;
  for (int32_t l = 0; l < c.n_layer; ++l) (c.is_swa_layer(l) ? window : full).layers.push_back(l);
  if (window.layers.empty() || full.layers.empty()) return kv_pools_layout::single(all);
  full.page.n_layers = int32_t(full.layers.size());
  window.page.n_layers = int32_t(window.layers.size());
  return kv_pools_layout{.pools = {std::move(full), std::move(window)}};
}

std::unique_ptr<llama_model> llama_model::load(const gguf::file& f, const cpu_options& opt) {
  return arch::load(f, opt);
}

void llama_model::check_sample_rows(std::span<const batch_seq> batch, std::span<const sample_row> rows) {
  const auto want = size_t(std::count_if(batch.begin(), batch.end(), [](const batch_seq& b) { return b.want_logits; }));
  if (rows.size() != want)
    throw tandem::error(fmt::format("forward_sample: {} sampling rows for {} sequences wanting logits; give one per "
                                    "such sequence, in batch order",
                                    rows.size(), want));
}

void llama_model::forward_sample(std::span<const batch_seq> batch, kv_pools& pools, std::span<const sample_row> rows,
                                 std::vector<token_logprobs>& out) {
  check_sample_rows(batch, rows);
  std::vector<float> logits;
  forward(batch, pools, logits);
  out.assign(rows.size(), token_logprobs{});
  backend::sample_on_host(logits.data(), config().n_vocab, rows, out);
}

}  // namespace tandem
