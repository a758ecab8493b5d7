#include "kernels/model/kv_pool.h"

#include <fmt/format.h>

#include "actors/common/error.h"

namespace tandem {

std::string kv_layout::describe() const {
  return fmt::format("layers={} kv_heads={} head_dim={} page_size={}", n_layers, n_kv_heads, head_dim,
                     page_size);
}

namespace {
void check_shape(const kv_layout& layout, int32_t n_pages) {
  if (n_pages <= 0 || layout.n_layers <= 0 || layout.n_kv_heads <= 0 || layout.head_dim <= 0 ||
      layout.page_size <= 0)
    throw tandem::error(fmt::format("invalid KV pool: {} pages of {}", n_pages, layout.describe()));
}
}  // namespace

kv_pool::kv_pool(const kv_layout& layout, int32_t n_pages) : layout_(layout), n_pages_(n_pages) {
  check_shape(layout, n_pages);
  storage_.assign(size_t(n_pages) * layout.n_layers * 2 * layout.layer_floats(), 0.0f);
  data_ = storage_.data();
  floats_ = storage_.size();
}

kv_pool::kv_pool(const kv_layout& layout, int32_t n_pages, void* storage, size_t storage_bytes)
    : layout_(layout), n_pages_(n_pages) {
  check_shape(layout, n_pages);
  if (!storage || storage_bytes < bytes_for(layout, n_pages) || reinterpret_cast<uintptr_t>(storage) % alignof(float))
    throw tandem::error(fmt::format("KV pool storage of {} bytes at {} cannot hold {} pages of {} ({} bytes)",
                                    storage_bytes, storage, n_pages, layout.describe(), bytes_for(layout, n_pages)));
  data_ = static_cast<float*>(storage);
  floats_ = bytes_for(layout, n_pages) / sizeof(float);
}

}  // namespace tandem
