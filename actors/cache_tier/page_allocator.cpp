#include "actors/cache_tier/page_allocator.h"

#include <fmt/format.h>

namespace tandem {

page_allocator::page_allocator(int32_t n_pages) {
  if (n_pages <= 0)
    throw tandem::error(
        error_kind::failed,
        fmt::format("page allocator needs > 0 pages, got {}; raise limits.device_pages or kv_cache_mb",
                    n_pages));
  refs_.assign(static_cast<size_t>(n_pages), 0);
  cached_.assign(static_cast<size_t>(n_pages), 0);
  free_.reserve(static_cast<size_t>(n_pages));
  for (int32_t p = n_pages - 1; p >= 0; --p) free_.push_back(p);
}

std::optional<std::vector<int32_t>> page_allocator::try_alloc(int32_t n) {
  if (n < 0 || n > n_free()) {
    ++alloc_failures_;
    return std::nullopt;
  }
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    int32_t p = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(p)] = 1;
    out.push_back(p);
  }
  return out;
}

std::vector<int32_t> page_allocator::alloc(int32_t n) {
  auto r = try_alloc(n);
  if (!r)
    throw tandem::error(
        error_kind::overloaded,
        fmt::format("KV cache exhausted: {} pages wanted, {} of {} free; retry later or raise "
                    "limits.kv_cache_mb / device_pages",
                    n, n_free(), n_pages()));
  return std::move(*r);
}

void page_allocator::check(int32_t page) const {
  if (page < 0 || page >= n_pages())
    throw tandem::error(error_kind::failed,
                        fmt::format("page id {} is out of range [0, {})", page, n_pages()));
}

void page_allocator::ref(int32_t page) {
  check(page);
  auto& r = refs_[static_cast<size_t>(page)];
  if (r == 0)
    throw tandem::error(error_kind::failed, fmt::format("reference to free page {} (use after free)", page));
  if (cached_[static_cast<size_t>(page)] && r == 1) --evictable_;
  ++r;
}

bool page_allocator::unref(int32_t page) {
  check(page);
  auto& r = refs_[static_cast<size_t>(page)];
  if (r == 0) throw tandem::error(error_kind::failed, fmt::format("double free of page {}", page));
  auto& c = cached_[static_cast<size_t>(page)];
  if (c && r == 1) --evictable_;
  if (--r > 0) {
    if (c && r == 1) ++evictable_;
    return false;
  }
  c = 0;  // the cache's reference went with the last one
  free_.push_back(page);
  return true;
}

void page_allocator::set_cached(int32_t page, bool cached) {
  check(page);
  auto& c = cached_[static_cast<size_t>(page)];
  if (bool(c) == cached) return;
  if (cached && refs_[static_cast<size_t>(page)] == 0)
    throw tandem::error(error_kind::failed, fmt::format("free page {} cannot be cached", page));
  if (refs_[static_cast<size_t>(page)] == 1) evictable_ += cached ? 1 : -1;
  c = cached ? 1 : 0;
}

void page_allocator::unref_all(std::span<const int32_t> pages) {
  for (auto p : pages) unref(p);
}

int32_t page_allocator::refcount(int32_t page) const {
  check(page);
  return refs_[static_cast<size_t>(page)];
}

}  // namespace tandem
