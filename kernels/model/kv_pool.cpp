#include "kernels/model/kv_pool.h"

#include <fmt/format.h>

#include "actors/common/error.h"

namespace tandem {

std::string kv_layout::describe() const {
  return fmt::format("layers={} kv_heads={} head_dim={} page_size={}", n_layers, n_kv_heads, head_dim,
                     page_size);
}

kv_pool::kv_pool(const kv_layout& layout, int32_t n_pages) : layout_(layout), n_pages_(n_pages) {
  if (n_pages <= 0 || layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 ||
      layout.page_size <= 0)
    throw tandem::error(fmt::format("invalid KV pool: {} pages of {}", n_pages, layout.describe()));
  storage_.assign(size_t(n_pages) * layout.n_layers * 2 * layout.layer_floats(), 0.0f);
}

}  // namespace tandem
