#pragma once
/// Paged KV cache memory. A page holds the cached state of every layer for `page_size`
/// consecutive token positions of one sequence. Pages are identified by index; which pages are
/// free is the cache tier's business (actors/cache_tier/page_allocator.h), not the pool's.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/huge_pages.h"

namespace tandem {

/// One tensor a layer caches per token position: `n_heads` x `head_dim` elements of
/// `elem_bytes` bytes each. Standard attention caches K and V (GQA: n_heads = n_kv_heads);
/// MLA-style attention caches one latent vector (n_heads = 1, head_dim = kv_lora_rank + rope
/// dim); a sparse-attention indexer adds its own small key cache. Each is a component here,
/// so the cache tiers (which copy pages as opaque bytes) need no special case per model.
struct kv_component {
  std::string name;        ///< "k", "v", "latent", "index_k", ...
  int32_t n_heads = 0;
  int32_t head_dim = 0;
  int32_t elem_bytes = 4;  ///< f32 storage by default
  bool operator==(const kv_component&) const = default;
};

/// Element type of the standard K/V cache. f16 halves the bytes a decode step reads per
/// cached position (at batch 32 attention reads as many bytes as the weights) and the memory
/// per token, at ~3 significant decimal digits per cached value (what llama.cpp keeps by
/// default).
enum class kv_dtype : int32_t { f32 = 0, f16 = 1 };

/// "f32" / "f16".
const char* to_string(kv_dtype t);
/// Parses "f32" / "f16"; false for anything else.
bool parse_kv_dtype(const std::string& s, kv_dtype& out);
/// parse_kv_dtype, or an error (failed) "<subject> is not a KV cache type; use f32 or f16",
/// where subject names the value as the user gave it (a flag, a key).
kv_dtype require_kv_dtype(const std::string& s, const std::string& subject);

/// Shape of one page; two sides exchanging pages must agree on every field.
struct kv_layout {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;  ///< tokens per page
  /// What each layer caches per position, in storage order. Empty = standard attention:
  /// {"k", n_kv_heads, head_dim, f32}, {"v", n_kv_heads, head_dim, f32}.
  std::vector<kv_component> components = {};
  /// Element type of the standard K/V components (components list their own elem_bytes).
  kv_dtype dtype = kv_dtype::f32;

  /// Elements of K (or V) for one layer of one page: [page_size][n_kv_heads][head_dim]
  /// (standard attention layouts only).
  size_t layer_elems() const { return size_t(page_size) * n_kv_heads * head_dim; }
  /// Bytes of one K or V element of a standard layout (4 for f32, 2 for f16).
  size_t elem_bytes() const { return dtype == kv_dtype::f16 ? 2 : 4; }
  /// The components actually stored (the default K/V pair when `components` is empty).
  std::vector<kv_component> effective_components() const;
  /// True for the default K/V layout that k()/v() address.
  bool is_standard() const { return components.empty(); }
  /// bytes of one component of one layer of one page.
  size_t component_bytes(const kv_component& c) const {
    return size_t(page_size) * size_t(c.n_heads) * size_t(c.head_dim) * size_t(c.elem_bytes);
  }
  /// bytes of one layer of one page (every component, rounded up to whole floats).
  size_t layer_bytes() const;
  /// bytes of one page (every component, all layers)
  size_t page_bytes() const { return size_t(n_layers) * layer_bytes(); }
  /// Stable 64-bit identity of the byte layout (names files of the disk cache tier).
  uint64_t fingerprint() const;
  /// True if every field is positive and the page is non-empty.
  bool valid() const;
  bool operator==(const kv_layout&) const = default;
  /// "layers=22 kv_heads=4 head_dim=64 page_size=16" (+ " kv=f16", " components=latent:1x576x4,...")
  std::string describe() const;
  /// "latent:1x576x4,..." (name:heads x head_dim x bytes per element), "" for the standard pair.
  std::string components_text() const;
};

/// Contiguous storage for `n_pages` pages. Page p, layer l starts at
///   base + (p * n_layers + l) * layer_bytes; its components follow in order
/// (standard layouts: K then V, each layer_elems elements of the layout's dtype).
class kv_pool {
 public:
  kv_pool(const kv_layout& layout, int32_t n_pages);
  /// A pool in memory the caller provides, `bytes_for(layout, n_pages)` long and float-aligned
  /// (e.g. memory a transport allocated so that peers on the same host can map it); the
  /// memory must outlive the pool. Its contents are left as they are.
  kv_pool(const kv_layout& layout, int32_t n_pages, void* storage, size_t storage_bytes);
  /// Bytes of a pool of `n_pages` pages of `layout`.
  static size_t bytes_for(const kv_layout& layout, int32_t n_pages) {
    return size_t(n_pages) * layout.page_bytes();
  }
  kv_pool(const kv_pool&) = delete;
  kv_pool& operator=(const kv_pool&) = delete;
  const kv_layout& layout() const { return layout_; }
  int32_t n_pages() const { return n_pages_; }
  /// K and V of a page's layer in an f32 layout.
  float* k(int32_t page, int32_t layer) { return base(page, layer); }
  float* v(int32_t page, int32_t layer) { return base(page, layer) + layout_.layer_elems(); }
  const float* k(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->k(page, layer); }
  const float* v(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->v(page, layer); }
  /// K and V of a page's layer in an f16 layout (IEEE half bits).
  uint16_t* k16(int32_t page, int32_t layer) { return reinterpret_cast<uint16_t*>(base(page, layer)); }
  uint16_t* v16(int32_t page, int32_t layer) { return k16(page, layer) + layout_.layer_elems(); }
  const uint16_t* k16(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->k16(page, layer); }
  const uint16_t* v16(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->v16(page, layer); }
  /// Component `c` (index into layout().effective_components()) of a page's layer, as bytes.
  uint8_t* component(int32_t page, int32_t layer, int32_t c) {
    return reinterpret_cast<uint8_t*>(base(page, layer)) + component_offset_[size_t(c)];
  }
  /// The whole page as bytes (for copies and transfers).
  uint8_t* page_data(int32_t page) { return reinterpret_cast<uint8_t*>(base(page, 0)); }
  const uint8_t* page_data(int32_t page) const { return const_cast<kv_pool*>(this)->page_data(page); }
  size_t page_bytes() const { return page_bytes_; }
  size_t bytes() const { return floats_ * sizeof(float); }
  /// Start of the whole storage (`bytes()` long): what a transport registers for remote writes.
  uint8_t* data() { return reinterpret_cast<uint8_t*>(data_); }

 private:
  /// Component offsets and strides from the layout; throws on an invalid shape.
  void init_shape();
  float* base(int32_t page, int32_t layer) {
    return data_ + (size_t(page) * layout_.n_layers + layer) * layer_stride_floats_;
  }
  kv_layout layout_;
  int32_t n_pages_;
  size_t page_bytes_ = 0;
  size_t layer_stride_floats_ = 0;  ///< layer_bytes rounded up to whole floats
  std::vector<size_t> component_offset_;
  std::unique_ptr<float, cpu::huge_free> storage_;  ///< null when the caller provides the memory
  float* data_ = nullptr;
  size_t floats_ = 0;
};

}  // namespace tandem
