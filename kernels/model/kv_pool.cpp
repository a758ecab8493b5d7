#include "kernels/model/kv_pool.h"

#include <fmt/format.h>

#include "actors/common/error.h"

namespace tandem {

std::vector<kv_component> kv_layout::effective_components() const {
  if (!components.empty()) return components;
  return {kv_component{"k", n_kv_heads, head_dim, 4}, kv_component{"v", n_kv_heads, head_dim, 4}};
}

size_t kv_layout::layer_bytes() const {
  size_t b = 0;
  for (const auto& c : effective_components()) b += component_bytes(c);
  return (b + sizeof(float) - 1) / sizeof(float) * sizeof(float);  // layers start float-aligned
}

uint64_t kv_layout::fingerprint() const {
  // FNV-1a over the fields that decide the byte layout of a page.
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  mix(uint64_t(n_layers));
  mix(uint64_t(page_size));
  for (const auto& c : effective_components()) {
    for (char ch : c.name) mix(uint64_t(uint8_t(ch)));
    mix(uint64_t(c.n_heads));
    mix(uint64_t(c.head_dim));
    mix(uint64_t(c.elem_bytes));
  }
  return h;
}

bool kv_layout::valid() const {
  if (n_layers <= 0 || page_size <= 0) return false;
  if (is_standard() && (n_kv_heads <= 0 || head_dim <= 0)) return false;
  for (const auto& c : components)
    if (c.n_heads <= 0 || c.head_dim <= 0 || c.elem_bytes <= 0) return false;
  return layer_bytes() > 0;
}

std::string kv_layout::describe() const {
  std::string s = fmt::format("layers={} kv_heads={} head_dim={} page_size={}", n_layers, n_kv_heads, head_dim,
                              page_size);
  if (!components.empty()) {
    s += " components=";
    for (size_t i = 0; i < components.size(); ++i)
      s += fmt::format("{}{}:{}x{}x{}", i ? "," : "", components[i].name, components[i].n_heads,
                       components[i].head_dim, components[i].elem_bytes);
  }
  return s;
}

void kv_pool::init_shape() {
  if (n_pages_ <= 0 || !layout_.valid())
    throw tandem::error(fmt::format("invalid KV pool: {} pages of {}", n_pages_, layout_.describe()));
  size_t off = 0;
  for (const auto& c : layout_.effective_components()) {
    component_offset_.push_back(off);
    off += layout_.component_bytes(c);
  }
  layer_stride_floats_ = (off + sizeof(float) - 1) / sizeof(float);
  page_bytes_ = layer_stride_floats_ * sizeof(float) * size_t(layout_.n_layers);
}

kv_pool::kv_pool(const kv_layout& layout, int32_t n_pages) : layout_(layout), n_pages_(n_pages) {
  init_shape();
  storage_.assign(size_t(n_pages) * layout.n_layers * layer_stride_floats_, 0.0f);
  data_ = storage_.data();
  floats_ = storage_.size();
}

kv_pool::kv_pool(const kv_layout& layout, int32_t n_pages, void* storage, size_t storage_bytes)
    : layout_(layout), n_pages_(n_pages) {
  init_shape();
  const size_t need = size_t(n_pages) * page_bytes_;
  if (!storage || storage_bytes < need || reinterpret_cast<uintptr_t>(storage) % alignof(float))
    throw tandem::error(fmt::format("KV pool storage of {} bytes at {} cannot hold {} pages of {} ({} bytes)",
                                    storage_bytes, storage, n_pages, layout.describe(), need));
  data_ = static_cast<float*>(storage);
  floats_ = need / sizeof(float);
}

}  // namespace tandem
