#include "kernels/model/kv_pool.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/base/error.h"

namespace tandem {

const char* to_string(kv_dtype t) { return t == kv_dtype::f16 ? "f16" : "f32"; }

bool parse_kv_dtype(const std::string& s, kv_dtype& out) {
  if (s == "f32") out = kv_dtype::f32;
  else if (s == "f16") out = kv_dtype::f16;
  else return false;
  return true;
}

kv_dtype require_kv_dtype(const std::string& s, const std::string& subject) {
  kv_dtype t = kv_dtype::f32;
  if (!parse_kv_dtype(s, t))
    throw tandem::error(error_kind::failed,
                        fmt::format("{} is not a KV cache type; use f32 or f16", subject));
  return t;
}

std::vector<kv_component> kv_layout::effective_components() const {
  if (!components.empty()) return components;
  const int32_t b = int32_t(elem_bytes());
  return {kv_component{"k", n_kv_heads, head_dim, b}, kv_component{"v", n_kv_heads, head_dim, b}};
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
  if (dtype != kv_dtype::f32 && dtype != kv_dtype::f16) return false;
  if (!components.empty() && dtype != kv_dtype::f32) return false;  // components carry their own sizes
  if (is_standard() && (n_kv_heads <= 0 || head_dim <= 0)) return false;
  for (const auto& c : components)
    if (c.n_heads <= 0 || c.head_dim <= 0 || c.elem_bytes <= 0) return false;
  return layer_bytes() > 0;
}

std::string kv_layout::describe() const {
  std::string s = fmt::format("layers={} kv_heads={} head_dim={} page_size={}", n_layers, n_kv_heads, head_dim,
                              page_size);
  if (dtype != kv_dtype::f32) s += fmt::format(" kv={}", to_string(dtype));
  if (!components.empty()) s += " components=" + components_text();
  return s;
}

std::string kv_layout::components_text() const {
  std::string out;
  for (size_t i = 0; i < components.size(); ++i)
    out += fmt::format("{}{}:{}x{}x{}", i ? "," : "", components[i].name, components[i].n_heads,
                       components[i].head_dim, components[i].elem_bytes);
  return out;
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
  floats_ = size_t(n_pages) * layout.n_layers * layer_stride_floats_;
  // On 2 MiB pages where the kernel gives them: decode attention reads a few KiB of every
  // sequence's pages all over the pool, and on 4 KiB pages nearly every row is a TLB miss
  // (a batch-32 decode's attention at context 80 read its 189 MB at ~20 GB/s).
  size_t alloc = 0;
  auto* mem = static_cast<float*>(cpu::huge_alloc(floats_ * sizeof(float), alloc));
  if (mem == nullptr)
    throw tandem::error(error_kind::overloaded,
                        fmt::format("cannot allocate {} bytes for a KV pool of {} pages of {}; use fewer pages",
                                    alloc, n_pages, layout.describe()));
  std::memset(mem, 0, alloc);
  storage_.reset(mem);
  data_ = mem;
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
