#pragma once
/// Device-tier prefix cache: a radix tree whose edges are full pages of tokens (page_size
/// tokens each) and whose nodes hold the KV page of that chunk. The cache holds one
/// reference per cached page; a page in use by a request has refcount > 1 and is pinned.
/// Unreferenced cached pages are evicted least-recently-used first (leaves only, so every
/// cached path stays a valid prefix).
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "actors/cache_tier/page_allocator.h"

namespace tandem {

class radix_cache {
 public:
  radix_cache(page_allocator& alloc, int32_t page_size);
  ~radix_cache();

  struct match_result {
    std::vector<int32_t> pages;  ///< cached pages of the prefix, in order (no refs added)
    int32_t tokens = 0;          ///< pages.size() * page_size
  };
  /// Longest cached prefix of `tokens` of at most `max_tokens` tokens (whole pages only).
  /// Touches the matched nodes (LRU).
  match_result match(std::span<const int32_t> tokens, int32_t max_tokens);
  /// Caches the full pages of `tokens` (pages[i] holds tokens [i*ps, (i+1)*ps)). Chunks
  /// already cached keep their existing page. Returns the number of pages newly cached.
  int32_t insert(std::span<const int32_t> tokens, std::span<const int32_t> pages);
  /// Evicts the least recently used unpinned leaf; false if none can be evicted.
  bool evict_one();
  /// Evicts until `n` pages are free in the allocator or nothing is evictable.
  void evict_until_free(int32_t n);
  /// Drops every unpinned page (tests, shutdown).
  void clear();

  int32_t cached_pages() const { return n_nodes_; }
  /// Cached pages no request references (what eviction could free now).
  int32_t evictable_pages() const;
  int64_t evictions() const { return evictions_; }

 private:
  struct node {
    int32_t page = -1;
    uint64_t last_use = 0;
    node* parent = nullptr;
    std::vector<int32_t> key;  ///< the chunk on the edge into this node
    std::map<std::vector<int32_t>, std::unique_ptr<node>> children;
  };
  void collect_leaves(node* n, std::vector<node*>& out) const;
  int32_t count_evictable(const node* n) const;

  page_allocator& alloc_;
  int32_t page_size_;
  node root_;
  uint64_t clock_ = 0;
  int32_t n_nodes_ = 0;
  int64_t evictions_ = 0;
};

}  // namespace tandem
