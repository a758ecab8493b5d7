#include "actors/cache_tier/radix_cache.h"

#include <algorithm>
#include <unordered_set>

#include "actors/cache_tier/page_file.h"

namespace tandem {

radix_cache::radix_cache(page_allocator& dev, page_allocator* host, const options& opt)
    : dev_(dev), host_(host), opt_(opt) {}

radix_cache::~radix_cache() = default;

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
  copy_op op;
  op.kind = copy_op::drop_disk;
  op.hash = victim->first;
  ops.push_back(std::move(op));
  disk_.erase(victim);
  ++evictions_[2];
  return true;
}

bool radix_cache::put_disk(node* n, std::vector<copy_op>& ops) {
  if (!disk_tier() || n->host < 0) return false;
  if (disk_.count(n->hash)) {
    touch_disk(n->hash);
    return true;
  }
  if (static_cast<int64_t>(disk_.size()) >= opt_.disk_pages && !evict_disk(ops)) return false;
  copy_op op;
  op.kind = copy_op::host_to_disk;
  op.host = n->host;
  op.hash = n->hash;
  op.parent = n->parent->hash;
  op.tokens = n->key;
  ops.push_back(std::move(op));
  touch_disk(n->hash);
  backup_tokens_[2] += opt_.page_size;
  return true;
}

bool radix_cache::evict_host(std::vector<copy_op>& ops) {
  std::vector<const node*> all;
  walk(&root_, all);
  node* victim = nullptr;
  for (const node* c : all) {
    if (c->host < 0 || host_->refcount(c->host) != 1) continue;   // pinned by a pending load
    if (c->dev < 0 && !c->children.empty()) continue;              // would leave a hole in the path
    if (!victim || c->last_use < victim->last_use) victim = const_cast<node*>(c);
  }
  if (!victim) return false;
  // Write-back to the disk tier: the node leaves memory, its file keeps the prefix reusable.
  if (victim->dev < 0 && disk_tier() && !disk_.count(victim->hash)) put_disk(victim, ops);
  host_->unref(victim->host);
  victim->host = -1;
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

void radix_cache::backup(node* n, std::vector<copy_op>& ops) {
  if (!host_tier() || n->dev < 0) return;
  if (n->host < 0) {
    auto h = take_host(ops);
    if (!h) {
      ++backups_skipped_;  // every host page is pinned by pending loads: try again on a later hit
      return;
    }
    copy_op op;
    op.kind = copy_op::device_to_host;
    op.device = n->dev;
    op.host = *h;
    ops.push_back(std::move(op));
    n->host = *h;
    ++n_host_nodes_;
    backup_tokens_[1] += opt_.page_size;
  }
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
          copy_op op;
          op.kind = copy_op::device_to_host;
          op.device = v->dev;
          op.host = *h;
          ops.push_back(std::move(op));
          v->host = *h;
          ++n_host_nodes_;
          backup_tokens_[1] += opt_.page_size;
        } else if (!v->children.empty()) {
          continue;  // nowhere to keep it and removing it would orphan its children
        }
      } else if (!v->children.empty()) {
        continue;
      }
    }
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

radix_cache::match_result radix_cache::match(std::span<const int32_t> tokens, int32_t max_tokens,
                                             std::vector<copy_op>& ops) {
  match_result r;
  const size_t ps = static_cast<size_t>(opt_.page_size);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(max_tokens, 0)));
  ++clock_;
  std::vector<node*> path;
  node* cur = &root_;
  size_t off = 0;
  for (; off + ps <= limit; off += ps) {
    std::vector<int32_t> key(tokens.begin() + static_cast<std::ptrdiff_t>(off),
                             tokens.begin() + static_cast<std::ptrdiff_t>(off + ps));
    auto it = cur->children.find(key);
    if (it == cur->children.end()) break;
    cur = it->second.get();
    path.push_back(cur);
  }
  std::vector<disk_load> dk;
  if (disk_tier() && host_tier()) {
    uint64_t h = cur->hash;
    for (; off + ps <= limit; off += ps) {
      std::span<const int32_t> chunk(tokens.data() + off, ps);
      uint64_t hh = chain_hash(h, chunk);
      if (!disk_.count(hh)) break;
      disk_load d;
      d.hash = hh;
      d.parent = h;
      d.tokens.assign(chunk.begin(), chunk.end());
      dk.push_back(std::move(d));
      h = hh;
    }
  }
  size_t n_dev = 0;
  while (n_dev < path.size() && path[n_dev]->dev >= 0) ++n_dev;
  size_t n_host = path.size() - n_dev;
  if (!host_tier()) n_host = 0;
  const int32_t load_tokens = static_cast<int32_t>((n_host + dk.size()) * ps);
  const int32_t min_lb = opt_.min_load_back_tokens > 0 ? opt_.min_load_back_tokens : opt_.page_size;
  if (load_tokens > 0 && load_tokens < min_lb) {
    // Too short to pay for a copy round trip: recompute instead.
    r.skipped_tokens = load_tokens;
    n_host = 0;
    dk.clear();
  }
  for (size_t i = 0; i < n_dev; ++i) {
    dev_.ref(path[i]->dev);
    r.pages.push_back(path[i]->dev);
  }
  // Pin what the loads read before allocating (allocation may evict).
  for (size_t i = n_dev; i < n_dev + n_host; ++i) {
    host_->ref(path[i]->host);
    r.pinned_host.push_back(path[i]->host);
  }
  for (auto& d : dk) {
    disk_[d.hash].pins += 1;
    touch_disk(d.hash);
    r.pinned_disk.push_back(d.hash);
  }
  size_t loaded_host = 0;
  for (size_t i = n_dev; i < n_dev + n_host; ++i) {
    auto d = take_device(ops);
    if (!d) break;
    node* n = path[i];
    n->dev = *d;  // the cache's reference
    ++n_device_nodes_;
    dev_.set_cached(*d, true);
    dev_.ref(*d);  // the caller's
    copy_op op;
    op.kind = copy_op::host_to_device;
    op.device = *d;
    op.host = n->host;
    ops.push_back(std::move(op));
    r.pages.push_back(*d);
    ++loaded_host;
  }
  if (loaded_host < n_host) dk.clear();  // the disk part hangs below the host part
  for (auto& d : dk) {
    auto h = take_host(ops);
    if (!h) break;
    auto p = take_device(ops);
    if (!p) {
      host_->unref(*h);
      break;
    }
    d.host = *h;
    d.device = *p;  // refcount 1: the caller's until finish_match attaches it
    copy_op rd;
    rd.kind = copy_op::disk_to_host;
    rd.host = *h;
    rd.hash = d.hash;
    rd.parent = d.parent;
    rd.tokens = d.tokens;
    d.op_index = ops.size();
    ops.push_back(std::move(rd));
    copy_op up;
    up.kind = copy_op::host_to_device;
    up.device = *p;
    up.host = *h;
    ops.push_back(std::move(up));
    r.pages.push_back(*p);
    r.disk.push_back(std::move(d));
  }
  const size_t used = n_dev + loaded_host;
  for (size_t i = 0; i < used; ++i) {
    path[i]->last_use = clock_;
    path[i]->hits += 1;
  }
  r.attach = used > 0 ? static_cast<const void*>(path[used - 1]) : static_cast<const void*>(&root_);
  r.device_tokens = static_cast<int32_t>(n_dev * ps);
  r.host_tokens = static_cast<int32_t>(loaded_host * ps);
  r.disk_tokens = static_cast<int32_t>(r.disk.size() * ps);
  r.tokens = static_cast<int32_t>(r.pages.size() * ps);
  if (opt_.policy == cache_write_policy::write_through_selective)
    for (size_t i = 0; i < n_dev; ++i)
      if (path[i]->host < 0 && path[i]->hits >= opt_.write_through_threshold) backup(path[i], ops);
  return r;
}

int32_t radix_cache::finish_match(match_result& m, std::span<const uint32_t> failed_ops) {
  for (auto h : m.pinned_host) host_->unref(h);
  m.pinned_host.clear();
  for (auto h : m.pinned_disk) {
    auto it = disk_.find(h);
    if (it != disk_.end() && it->second.pins > 0) it->second.pins -= 1;
  }
  m.pinned_disk.clear();
  std::unordered_set<uint32_t> failed(failed_ops.begin(), failed_ops.end());
  node* at = const_cast<node*>(static_cast<const node*>(m.attach));
  int32_t tokens = m.tokens;
  bool broken = false;
  std::vector<copy_op> drop;
  for (auto& d : m.disk) {
    if (!broken && failed.count(static_cast<uint32_t>(d.op_index))) {
      broken = true;
      disk_read_failed(d.hash, drop);
    }
    if (broken) {
      host_->unref(d.host);  // the device page stays the caller's, recomputed by prefill
      tokens -= opt_.page_size;
      continue;
    }
    auto it = at->children.find(d.tokens);
    if (it != at->children.end()) {
      node* n = it->second.get();  // cached meanwhile by another request
      if (n->host < 0) {
        n->host = d.host;
        ++n_host_nodes_;
      } else {
        host_->unref(d.host);
      }
      if (n->dev < 0) {
        n->dev = d.device;
        hold_device(d.device);
        ++n_device_nodes_;
      }
      n->last_use = clock_;
      at = n;
      continue;
    }
    auto n = std::make_unique<node>();
    n->dev = d.device;
    hold_device(d.device);
    n->host = d.host;
    n->hash = d.hash;
    n->parent = at;
    n->key = d.tokens;
    n->last_use = clock_;
    n->hits = 1;
    node* raw = n.get();
    at->children.emplace(d.tokens, std::move(n));
    ++n_nodes_;
    ++n_device_nodes_;
    ++n_host_nodes_;
    at = raw;
  }
  m.disk.clear();
  pending_drops_.insert(pending_drops_.end(), drop.begin(), drop.end());
  return tokens;
}

std::vector<copy_op> radix_cache::take_pending_ops() {
  std::vector<copy_op> out;
  out.swap(pending_drops_);
  return out;
}

void radix_cache::disk_read_failed(uint64_t hash, std::vector<copy_op>& ops) {
  auto it = disk_.find(hash);
  if (it == disk_.end()) return;
  disk_.erase(it);
  ++disk_read_failures_;
  copy_op op;
  op.kind = copy_op::drop_disk;
  op.hash = hash;
  ops.push_back(std::move(op));
}

int32_t radix_cache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages,
                            std::vector<copy_op>& ops, bool allow_backup) {
  node* cur = &root_;
  const size_t ps = static_cast<size_t>(opt_.page_size);
  int32_t added = 0;
  ++clock_;
  for (size_t i = 0; (i + 1) * ps <= tokens.size() && i < pages.size(); ++i) {
    std::vector<int32_t> key(tokens.begin() + static_cast<std::ptrdiff_t>(i * ps),
                             tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * ps));
    auto it = cur->children.find(key);
    node* n;
    if (it == cur->children.end()) {
      auto nn = std::make_unique<node>();
      nn->dev = pages[i];
      hold_device(pages[i]);  // the cache's own reference
      nn->parent = cur;
      nn->key = key;
      nn->hash = chain_hash(cur->hash, key);
      n = nn.get();
      cur->children.emplace(std::move(key), std::move(nn));
      ++n_nodes_;
      ++n_device_nodes_;
      ++added;
      n->last_use = clock_;
      if (opt_.policy == cache_write_policy::write_through && host_tier()) {
        if (allow_backup)
          backup(n, ops);
        else
          ++backups_skipped_;
      }
    } else {
      n = it->second.get();
      if (n->dev < 0) {
        // Host-only: the request's page holds the same KV; the node is device-resident again.
        n->dev = pages[i];
        hold_device(pages[i]);
        ++n_device_nodes_;
      }
      n->last_use = clock_;
    }
    cur = n;
  }
  return added;
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
      if (v->host >= 0 && host_->refcount(v->host) != 1) continue;
      if (v->dev >= 0) {
        release_device(v->dev);
        --n_device_nodes_;
      }
      if (v->host >= 0) {
        host_->unref(v->host);
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

}  // namespace tandem
