#include <algorithm>

#include "actors/cache_tier/page_file.h"
#include "actors/cache_tier/radix_cache.h"

/// The radix cache's evictions, backups and disk index (radix_cache.h).
namespace tandem {

bool radix_cache::device_child(const node* n) const {
  for (const auto& [k, c] : n->children)
    if (c->dev >= 0) return true;
  return false;
}

void radix_cache::walk(const node* n, std::vector<const node*>& out) const {
  for (const auto& [k, c] : n->children) {
    out.push_back(c.get());
    walk(c.get(), out);
  }
}

void radix_cache::remove_leaf(node* n) {
  node* parent = n->parent;
  auto key = n->key;  // erase destroys n
  parent->children.erase(key);
  --n_nodes_;
}

void radix_cache::add_disk_entry(uint64_t hash) {
  if (!disk_tier()) return;
  disk_[hash].last_use = ++clock_;
}

bool radix_cache::evict_disk(std::vector<copy_op>& ops) {
  auto victim = disk_.end();
  for (auto it = disk_.begin(); it != disk_.end(); ++it)
    if (it->second.pins == 0 && (victim == disk_.end() || it->second.last_use < victim->second.last_use))
      victim = it;
  if (victim == disk_.end()) return false;
  for (size_t p = 0; p < n_pools(); ++p) {
    if (p > 0 && !(victim->second.mask & (1u << (p - 1)))) continue;
    copy_op op;
    op.kind = copy_op::drop_disk;
    op.hash = victim->first;
    op.pool = static_cast<int32_t>(p);
    ops.push_back(std::move(op));
  }
  disk_.erase(victim);
  ++evictions_[2];
  return true;
}

bool radix_cache::put_disk(node* n, std::vector<copy_op>& ops) {
  if (!disk_tier() || n->host < 0) return false;
  // Each pool's page of the block has its own file; an entry lists the other pools it has.
  auto write = [&](size_t p) {
    copy_op op;
    op.kind = copy_op::host_to_disk;
    op.host = p == 0 ? n->host : n->xhost[p - 1];
    op.hash = n->hash;
    op.parent = n->parent->hash;
    op.tokens = n->key;
    op.pool = static_cast<int32_t>(p);
    ops.push_back(std::move(op));
  };
  if (auto it = disk_.find(n->hash); it != disk_.end()) {
    for (size_t p = 1; p < n_pools(); ++p) {
      const uint32_t bit = 1u << (p - 1);
      if (n->xhost[p - 1] >= 0 && !(it->second.mask & bit)) {
        write(p);
        it->second.mask |= bit;
      }
    }
    touch_disk(n->hash);
    return true;
  }
  if (static_cast<int64_t>(disk_.size()) >= opt_.disk_pages && !evict_disk(ops)) return false;
  write(0);
  for (size_t p = 1; p < n_pools(); ++p)
    if (n->xhost[p - 1] >= 0) write(p);
  touch_disk(n->hash);
  disk_[n->hash].mask = xhost_mask(n);
  backup_tokens_[2] += opt_.page_size;
  return true;
}

bool radix_cache::evict_host(std::vector<copy_op>& ops) {
  std::vector<const node*> all;
  walk(&root_, all);
  node* victim = nullptr;
  for (const node* c : all) {
    if (c->host < 0 || !host_unpinned(c)) continue;                // pinned by a pending load
    if (c->dev < 0 && !c->children.empty()) continue;              // would leave a hole in the path
    if (!victim || c->last_use < victim->last_use) victim = const_cast<node*>(c);
  }
  if (!victim) return false;
  // Write-back to the disk tier: the node leaves memory, its file keeps the prefix reusable.
  if (victim->dev < 0 && disk_tier() && !disk_.count(victim->hash)) put_disk(victim, ops);
  host_->unref(victim->host);
  victim->host = -1;
  drop_xhost(victim);
  --n_host_nodes_;
  ++evictions_[1];
  if (victim->dev < 0) remove_leaf(victim);
  return true;
}

std::optional<int32_t> radix_cache::take_host(std::vector<copy_op>& ops) {
  if (!host_) return std::nullopt;
  if (host_->n_free() == 0 && !evict_host(ops)) return std::nullopt;
  auto r = host_->try_alloc(1);
  if (!r) return std::nullopt;
  return (*r)[0];
}

void radix_cache::copy_to_host(node* n, int32_t host, std::vector<copy_op>& ops) {
  copy_op op;
  op.kind = copy_op::device_to_host;
  op.device = n->dev;
  op.host = host;
  ops.push_back(std::move(op));
  n->host = host;
  ++n_host_nodes_;
  backup_tokens_[1] += opt_.page_size;
}

void radix_cache::backup(node* n, std::vector<copy_op>& ops) {
  if (!host_tier() || n->dev < 0) return;
  if (n->host < 0) {
    auto h = take_host(ops);
    if (!h) {
      ++backups_skipped_;  // every host page is pinned by pending loads: try again on a later hit
      return;
    }
    copy_to_host(n, *h, ops);
  }
  backup_xdev(n, ops);
  if (opt_.policy == cache_write_policy::write_through && disk_tier()) put_disk(n, ops);
}

bool radix_cache::evict_device(std::vector<copy_op>& ops) {
  std::vector<const node*> all;
  walk(&root_, all);
  std::vector<node*> cand;
  for (const node* c : all)
    if (c->dev >= 0 && dev_.refcount(c->dev) == 1 && !device_child(c)) cand.push_back(const_cast<node*>(c));
  std::sort(cand.begin(), cand.end(), [](const node* a, const node* b) { return a->last_use < b->last_use; });
  for (node* v : cand) {
    if (v->host < 0) {
      // write_back copies on eviction; a node with children must keep a copy somewhere (its
      // children are host-only), whatever the policy.
      const bool copy = host_tier() && (opt_.policy == cache_write_policy::write_back || !v->children.empty());
      if (copy) {
        auto h = take_host(ops);
        if (h) {
          copy_to_host(v, *h, ops);
        } else if (!v->children.empty()) {
          continue;  // nowhere to keep it and removing it would orphan its children
        }
      } else if (!v->children.empty()) {
        continue;
      }
    }
    if (v->host >= 0) backup_xdev(v, ops);
    drop_xdev(v);
    release_device(v->dev);
    v->dev = -1;
    --n_device_nodes_;
    ++evictions_[0];
    if (v->host < 0) remove_leaf(v);
    return true;
  }
  return false;
}

std::optional<int32_t> radix_cache::take_device(std::vector<copy_op>& ops) {
  if (dev_.n_free() == 0 && !evict_device(ops)) return std::nullopt;
  auto r = dev_.try_alloc(1);
  if (!r) return std::nullopt;
  return (*r)[0];
}

std::optional<std::vector<int32_t>> radix_cache::alloc_device(int32_t n, std::vector<copy_op>& ops) {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(std::max(n, 0)));
  for (int32_t i = 0; i < n; ++i) {
    auto p = take_device(ops);
    if (!p) {
      dev_.unref_all(out);  // evictions done so far stay done (their ops still run)
      return std::nullopt;
    }
    out.push_back(*p);
  }
  return out;
}

void radix_cache::clear_device() {
  std::vector<copy_op> none;
  for (;;) {
    std::vector<const node*> all;
    walk(&root_, all);
    bool any = false;
    for (const node* c : all) {
      node* v = const_cast<node*>(c);
      if (v->dev < 0 || dev_.refcount(v->dev) != 1 || device_child(v)) continue;
      if (v->host < 0 && !v->children.empty()) continue;
      drop_xdev(v);
      release_device(v->dev);
      v->dev = -1;
      --n_device_nodes_;
      ++evictions_[0];
      if (v->host < 0) remove_leaf(v);
      any = true;
      break;  // the walk's pointers may be stale now
    }
    if (!any) return;
  }
}

void radix_cache::clear() {
  for (;;) {
    std::vector<const node*> all;
    walk(&root_, all);
    bool any = false;
    for (const node* c : all) {
      node* v = const_cast<node*>(c);
      if (!v->children.empty()) continue;
      if (v->dev >= 0 && dev_.refcount(v->dev) != 1) continue;
      if (v->host >= 0 && !host_unpinned(v)) continue;
      if (v->dev >= 0) {
        drop_xdev(v);
        release_device(v->dev);
        --n_device_nodes_;
      }
      if (v->host >= 0) {
        host_->unref(v->host);
        drop_xhost(v);
        --n_host_nodes_;
      }
      remove_leaf(v);
      any = true;
      break;
    }
    if (!any) return;
  }
}

int32_t radix_cache::evictable_pages() const {
  std::vector<const node*> all;
  walk(&root_, all);
  int32_t c = 0;
  for (const node* n : all)
    if (n->dev >= 0 && dev_.refcount(n->dev) == 1) ++c;
  return c;
}

std::unique_ptr<radix_cache::node> radix_cache::new_node() const {
  auto n = std::make_unique<node>();
  n->xdev.assign(dev_x_.size(), -1);
  n->xhost.assign(dev_x_.size(), -1);
  return n;
}

void radix_cache::add_disk_pool(uint64_t hash, size_t p) {
  auto it = disk_.find(hash);
  if (p == 0 || p >= n_pools() || it == disk_.end()) return;
  it->second.mask |= 1u << (p - 1);
}

int32_t radix_cache::cached_pool_pages(size_t p) const {
  return p == 0 ? n_device_nodes_ : count_nodes([p](const node* n) { return n->xdev[p - 1] >= 0; });
}

void radix_cache::drop_xdev(node* n) {
  for (size_t p = 1; p < n_pools(); ++p) {
    int32_t& x = n->xdev[p - 1];
    if (x < 0) continue;
    release_pool(p, x);
    x = -1;
  }
}

void radix_cache::backup_xdev(node* n, std::vector<copy_op>& ops) {
  if (!host_tier() || n->host < 0) return;
  for (size_t p = 1; p < n_pools(); ++p) {
    if (n->xdev[p - 1] < 0 || n->xhost[p - 1] >= 0) continue;
    auto h = take_xhost(p);
    if (!h) {
      ++backups_skipped_;  // every host page of the pool is pinned: the block keeps pool 0 only
      continue;
    }
    copy_op op;
    op.kind = copy_op::device_to_host;
    op.device = n->xdev[p - 1];
    op.host = *h;
    op.pool = static_cast<int32_t>(p);
    ops.push_back(std::move(op));
    n->xhost[p - 1] = *h;
  }
}

bool radix_cache::host_unpinned(const node* n) const {
  if (n->host >= 0 && host_->refcount(n->host) != 1) return false;
  for (size_t p = 1; p < n_pools(); ++p)
    if (n->xhost[p - 1] >= 0 && host_x_[p - 1]->refcount(n->xhost[p - 1]) != 1) return false;
  return true;
}

uint32_t radix_cache::xhost_mask(const node* n) const {
  uint32_t m = 0;
  for (size_t p = 1; p < n_pools(); ++p)
    if (n->xhost[p - 1] >= 0) m |= 1u << (p - 1);
  return m;
}

void radix_cache::drop_xhost(node* n) {
  for (size_t p = 1; p < n_pools(); ++p) {
    int32_t& h = n->xhost[p - 1];
    if (h < 0) continue;
    host_x_[p - 1]->unref(h);
    h = -1;
  }
}

bool radix_cache::evict_xhost(size_t p) {
  std::vector<const node*> all;
  walk(&root_, all);
  node* victim = nullptr;
  for (const node* c : all) {
    const int32_t h = c->xhost[p - 1];
    if (h < 0 || host_x_[p - 1]->refcount(h) != 1) continue;  // a pending load reads it
    if (!victim || c->last_use < victim->last_use) victim = const_cast<node*>(c);
  }
  if (!victim) return false;
  // The block's pool-0 host page stays; only a resume whose window reads this block loses it.
  // Its disk file (if any) stays too: a later load from disk brings the page back.
  int32_t& h = victim->xhost[p - 1];
  host_x_[p - 1]->unref(h);
  h = -1;
  ++evictions_[1];
  return true;
}

std::optional<int32_t> radix_cache::take_xhost(size_t p) {
  if (p == 0 || p > host_x_.size()) return std::nullopt;
  page_allocator& a = *host_x_[p - 1];
  if (a.n_free() == 0 && !evict_xhost(p)) return std::nullopt;
  auto r = a.try_alloc(1);
  if (!r) return std::nullopt;
  return (*r)[0];
}

int32_t radix_cache::host_cached_pool_pages(size_t p) const {
  return p == 0 ? n_host_nodes_ : count_nodes([p](const node* n) { return n->xhost[p - 1] >= 0; });
}

int32_t radix_cache::count_nodes(const std::function<bool(const node*)>& pred) const {
  std::vector<const node*> all;
  walk(&root_, all);
  return static_cast<int32_t>(std::count_if(all.begin(), all.end(), pred));
}

bool radix_cache::evict_pool(size_t p, std::vector<copy_op>& ops) {
  std::vector<const node*> all;
  walk(&root_, all);
  node* victim = nullptr;
  for (const node* c : all) {
    const int32_t x = c->xdev[p - 1];
    if (x < 0 || dev_x_[p - 1]->refcount(x) != 1) continue;  // a sequence's window reads it
    if (!victim || c->last_use < victim->last_use) victim = const_cast<node*>(c);
  }
  if (!victim) return false;
  // The block's pool-0 page stays; only a resume whose window reads this block loses it.
  if (opt_.policy == cache_write_policy::write_back) backup_xdev(victim, ops);
  int32_t& x = victim->xdev[p - 1];
  release_pool(p, x);
  x = -1;
  ++evictions_[0];
  return true;
}

std::optional<std::vector<int32_t>> radix_cache::alloc_pool(size_t p, int32_t n, std::vector<copy_op>& ops) {
  if (p == 0) return alloc_device(n, ops);
  if (p >= n_pools()) return std::nullopt;
  page_allocator& a = *dev_x_[p - 1];
  while (a.n_free() < n)
    if (!evict_pool(p, ops)) break;
  auto r = a.try_alloc(std::max(n, 0));
  return r;
}

}  // namespace tandem
