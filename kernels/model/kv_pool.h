#pragma once
/// Paged KV cache memory. A page holds K and V of every layer for `page_size` consecutive
/// token positions of one sequence. Pages are identified by index; which pages are free is
/// the cache tier's business (actors/cache_tier/page_allocator.h), not the pool's.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

/// Shape of one page; two sides exchanging pages must agree on every field.
struct kv_layout {
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 16;  ///< tokens per page

  /// floats of K (or V) for one layer of one page: [page_size][n_kv_heads][head_dim]
  size_t layer_floats() const { return size_t(page_size) * n_kv_heads * head_dim; }
  /// bytes of one page (K and V, all layers), f32 storage
  size_t page_bytes() const { return 2 * size_t(n_layers) * layer_floats() * sizeof(float); }
  bool operator==(const kv_layout&) const = default;
  /// "layers=22 kv_heads=4 head_dim=64 page_size=16"
  std::string describe() const;
};

/// Contiguous storage for `n_pages` pages. Page p, layer l:
///   K at base + (p * n_layers + l) * 2 * layer_floats, V right after K.
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
  float* k(int32_t page, int32_t layer) { return base(page, layer); }
  float* v(int32_t page, int32_t layer) { return base(page, layer) + layout_.layer_floats(); }
  const float* k(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->k(page, layer); }
  const float* v(int32_t page, int32_t layer) const { return const_cast<kv_pool*>(this)->v(page, layer); }
  /// The whole page as bytes (for copies and transfers).
  uint8_t* page_data(int32_t page) { return reinterpret_cast<uint8_t*>(base(page, 0)); }
  size_t bytes() const { return floats_ * sizeof(float); }
  /// Start of the whole storage (`bytes()` long): what a transport registers for remote writes.
  uint8_t* data() { return reinterpret_cast<uint8_t*>(data_); }

 private:
  float* base(int32_t page, int32_t layer) {
    return data_ + (size_t(page) * layout_.n_layers + layer) * 2 * layout_.layer_floats();
  }
  kv_layout layout_;
  int32_t n_pages_;
  std::vector<float> storage_;  ///< empty when the caller provides the memory
  float* data_ = nullptr;
  size_t floats_ = 0;
};

}  // namespace tandem
