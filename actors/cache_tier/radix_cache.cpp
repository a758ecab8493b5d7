#include "actors/cache_tier/radix_cache.h"

namespace tandem {

radix_cache::radix_cache(page_allocator& alloc, int32_t page_size) : alloc_(alloc), page_size_(page_size) {}

radix_cache::~radix_cache() = default;

radix_cache::match_result radix_cache::match(std::span<const int32_t> tokens, int32_t max_tokens) {
  match_result r;
  node* cur = &root_;
  const size_t ps = static_cast<size_t>(page_size_);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(max_tokens, 0)));
  ++clock_;
  for (size_t off = 0; off + ps <= limit; off += ps) {
    std::vector<int32_t> key(tokens.begin() + static_cast<std::ptrdiff_t>(off),
                             tokens.begin() + static_cast<std::ptrdiff_t>(off + ps));
    auto it = cur->children.find(key);
    if (it == cur->children.end()) break;
    cur = it->second.get();
    cur->last_use = clock_;
    r.pages.push_back(cur->page);
  }
  r.tokens = static_cast<int32_t>(r.pages.size()) * page_size_;
  return r;
}

int32_t radix_cache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages) {
  node* cur = &root_;
  const size_t ps = static_cast<size_t>(page_size_);
  int32_t added = 0;
  ++clock_;
  for (size_t i = 0; (i + 1) * ps <= tokens.size() && i < pages.size(); ++i) {
    std::vector<int32_t> key(tokens.begin() + static_cast<std::ptrdiff_t>(i * ps),
                             tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * ps));
    auto it = cur->children.find(key);
    if (it == cur->children.end()) {
      auto n = std::make_unique<node>();
      n->page = pages[i];
      n->parent = cur;
      n->key = key;
      alloc_.ref(pages[i]);  // the cache's own reference
      it = cur->children.emplace(std::move(key), std::move(n)).first;
      ++n_nodes_;
      ++added;
    }
    cur = it->second.get();
    cur->last_use = clock_;
  }
  return added;
}

void radix_cache::collect_leaves(node* n, std::vector<node*>& out) const {
  for (auto& [k, c] : n->children) {
    if (c->children.empty())
      out.push_back(c.get());
    else
      collect_leaves(c.get(), out);
  }
}

bool radix_cache::evict_one() {
  std::vector<node*> leaves;
  collect_leaves(&root_, leaves);
  node* victim = nullptr;
  for (auto* l : leaves) {
    if (alloc_.refcount(l->page) != 1) continue;  // pinned by a request
    if (!victim || l->last_use < victim->last_use) victim = l;
  }
  if (!victim) return false;
  alloc_.unref(victim->page);
  node* parent = victim->parent;
  parent->children.erase(victim->key);
  --n_nodes_;
  ++evictions_;
  return true;
}

void radix_cache::evict_until_free(int32_t n) {
  while (alloc_.n_free() < n && evict_one()) {
  }
}

void radix_cache::clear() {
  while (evict_one()) {
  }
}

int32_t radix_cache::count_evictable(const node* n) const {
  int32_t c = 0;
  for (const auto& [k, ch] : n->children) {
    c += count_evictable(ch.get());
  }
  if (n != &root_ && alloc_.refcount(n->page) == 1) {
    // Evictable once its subtree is gone; only counts if the whole subtree is unpinned.
    bool all = true;
    for (const auto& [k, ch] : n->children)
      if (alloc_.refcount(ch->page) != 1) all = false;
    if (all) ++c;
  }
  return c;
}

int32_t radix_cache::evictable_pages() const { return count_evictable(&root_); }

}  // namespace tandem
