#pragma once
/// Bounded free list of KV page ids with reference counts. Owned by the cache tier actor
/// (not thread-safe: one owner). Allocation fails explicitly (`overloaded`), never grows.
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels/base/error.h"

namespace tandem {

class page_allocator {
 public:
  explicit page_allocator(int32_t n_pages);

  /// `n` pages with refcount 1, or nullopt (nothing allocated) if fewer are free.
  std::optional<std::vector<int32_t>> try_alloc(int32_t n);
  /// Like try_alloc but throws tandem::error(overloaded) naming the shortfall.
  std::vector<int32_t> alloc(int32_t n);
  /// Adds a reference. Throws tandem::error(failed) on a free or out-of-range page.
  void ref(int32_t page);
  /// Drops a reference; true if the page became free. Throws on double free / bad id.
  bool unref(int32_t page);
  void unref_all(std::span<const int32_t> pages);

  int32_t refcount(int32_t page) const;
  /// Marks whether the prefix cache holds one of the page's references (its tree node points
  /// at it); the cache calls it whenever a node gains or loses its device page.
  void set_cached(int32_t page, bool cached);
  int32_t n_pages() const { return static_cast<int32_t>(refs_.size()); }
  int32_t n_free() const { return static_cast<int32_t>(free_.size()); }
  /// Cached pages that no request references (the cache's reference is the only one): an
  /// allocation can have them by eviction. Kept by ref/unref in O(1), so credits can carry it.
  int32_t n_evictable() const { return evictable_; }
  int64_t alloc_failures() const { return alloc_failures_; }

 private:
  void check(int32_t page) const;
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  ///< stack: lowest ids handed out first
  std::vector<uint8_t> cached_;  ///< per page: the prefix cache holds a reference
  int32_t evictable_ = 0;        ///< pages with cached_ set and refcount 1
  int64_t alloc_failures_ = 0;
};

}  // namespace tandem
