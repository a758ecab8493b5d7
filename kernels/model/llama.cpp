#include "kernels/model/llama.h"

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

std::unique_ptr<llama_model> llama_model::load(const gguf::file& f, const cpu_options& opt) {
  return arch::load(f, opt);
}

}  // namespace tandem
