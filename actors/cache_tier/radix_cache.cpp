#include "actors/cache_tier/radix_cache.h"

#include <algorithm>
#include <unordered_set>

#include <fmt/format.h>

#include "actors/cache_tier/page_file.h"

namespace tandem {

radix_cache::radix_cache(page_allocator& dev, page_allocator* host, const options& opt)
    : dev_(dev), host_(host), opt_(opt) {}

namespace {
/// `host` for pool 0 and every other pool of a set of `n` pools (one shared id space).
std::vector<page_allocator*> shared_host(page_allocator* host, size_t n) {
  return host ? std::vector<page_allocator*>(std::max<size_t>(n, 1), host) : std::vector<page_allocator*>{};
}
}  // namespace

radix_cache::radix_cache(std::vector<page_allocator*> dev, page_allocator* host, const options& opt)
    : radix_cache(dev, shared_host(host, dev.size()), opt) {}

radix_cache::radix_cache(std::vector<page_allocator*> dev, std::vector<page_allocator*> host, const options& opt)
    : dev_(*dev.at(0)), host_(host.empty() ? nullptr : host[0]), opt_(opt) {
  const auto& pools = opt_.pools.pools;
  if (dev.size() > 1 || pools.size() > 1) {
    if (pools.size() != dev.size())
      throw tandem::error(error_kind::failed, fmt::format("radix cache: {} page allocators for a layout of {} pools",
                                                          dev.size(), pools.size()));
    if (pools[0].window_tokens > 0)
      throw tandem::error(error_kind::unimplemented,
                          fmt::format("radix cache: the first pool of a layout must keep the full context ({})",
                                      opt_.pools.describe()));
    if (pools.size() > 32)
      throw tandem::error(error_kind::failed, "radix cache: more than 32 pools in a layout");
    for (const auto& sp : pools)
      if (sp.page.page_size != opt_.page_size)
        throw tandem::error(error_kind::failed, fmt::format("radix cache: pool {} has page size {}, the cache {}",
                                                            sp.name, sp.page.page_size, opt_.page_size));
    for (size_t p = 1; p < dev.size(); ++p) dev_x_.push_back(dev[p]);
    if (!host.empty() && host.size() != dev.size())
      throw tandem::error(error_kind::failed, fmt::format("radix cache: {} host allocators for a layout of {} pools",
                                                          host.size(), dev.size()));
    for (size_t p = 1; p < host.size(); ++p) host_x_.push_back(host[p]);
  }
}

radix_cache::~radix_cache() = default;

void radix_cache::walk_path(std::span<const int32_t> tokens, size_t limit, std::vector<node*>& path,
                            std::vector<disk_load>& dk) {
  const size_t ps = static_cast<size_t>(opt_.page_size);
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
  if (!disk_tier() || !host_tier()) return;
  uint64_t h = cur->hash;
  for (; off + ps <= limit; off += ps) {
    std::span<const int32_t> chunk(tokens.data() + off, ps);
    uint64_t hh = chain_hash(h, chunk);
    if (!disk_.count(hh)) break;
    disk_load d;
    d.hash = hh;
    d.parent = h;
    d.tokens.assign(chunk.begin(), chunk.end());
    d.xdevice.assign(dev_x_.size(), -1);
    d.xhost.assign(dev_x_.size(), -1);
    d.xop.assign(dev_x_.size(), 0);
    dk.push_back(std::move(d));
    h = hh;
  }
}

radix_cache::match_result radix_cache::match(std::span<const int32_t> tokens, int32_t max_tokens,
                                             std::vector<copy_op>& ops) {
  if (multi()) return match_pools(tokens, max_tokens, ops);
  match_result r;
  const size_t ps = static_cast<size_t>(opt_.page_size);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(max_tokens, 0)));
  ++clock_;
  std::vector<node*> path;
  std::vector<disk_load> dk;
  walk_path(tokens, limit, path, dk);
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
  for (auto [p, h] : m.pinned_xhost) host_x_[size_t(p) - 1]->unref(h);
  m.pinned_xhost.clear();
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
    bool bad = failed.count(static_cast<uint32_t>(d.op_index)) > 0;
    for (size_t p = 1; p < n_pools(); ++p)
      if (d.mask & (1u << (p - 1))) bad |= failed.count(static_cast<uint32_t>(d.xop[p - 1])) > 0;
    if (!broken && bad) {
      broken = true;
      disk_read_failed(d.hash, drop);
    }
    if (broken) {
      host_->unref(d.host);  // the device page stays the caller's, recomputed by prefill
      for (size_t p = 1; p < n_pools(); ++p)
        if (d.xhost[p - 1] >= 0) host_x_[p - 1]->unref(d.xhost[p - 1]);
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
      for (size_t p = 1; p < n_pools(); ++p) {
        if (d.xhost[p - 1] < 0) continue;
        if (n->xhost[p - 1] < 0) n->xhost[p - 1] = d.xhost[p - 1];
        else host_x_[p - 1]->unref(d.xhost[p - 1]);
      }
      if (n->dev < 0) {
        n->dev = d.device;
        hold_device(d.device);
        ++n_device_nodes_;
      }
      for (size_t p = 1; p < n_pools(); ++p)
        if (d.xdevice[p - 1] >= 0 && n->xdev[p - 1] < 0) {
          n->xdev[p - 1] = d.xdevice[p - 1];
          hold_pool(p, d.xdevice[p - 1]);
        }
      n->last_use = clock_;
      at = n;
      continue;
    }
    auto n = new_node();
    n->dev = d.device;
    hold_device(d.device);
    for (size_t p = 1; p < n_pools(); ++p)
      if (d.xdevice[p - 1] >= 0) {
        n->xdev[p - 1] = d.xdevice[p - 1];
        hold_pool(p, d.xdevice[p - 1]);
      }
    n->host = d.host;
    for (size_t p = 1; p < n_pools(); ++p) n->xhost[p - 1] = d.xhost[p - 1];
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
  // Several pools: a cut in the disk part may leave the new end without its window blocks
  // and the caller's pages mix cached and fresh ones; the caller gives the match up (retry).
  if (broken && multi()) return -1;
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
  const uint32_t mask = it->second.mask;
  disk_.erase(it);
  ++disk_read_failures_;
  for (size_t p = 0; p < n_pools(); ++p) {
    if (p > 0 && !(mask & (1u << (p - 1)))) continue;
    copy_op op;
    op.kind = copy_op::drop_disk;
    op.hash = hash;
    op.pool = static_cast<int32_t>(p);
    ops.push_back(std::move(op));
  }
}

int32_t radix_cache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages,
                            std::vector<copy_op>& ops, bool allow_backup,
                            std::span<const std::vector<int32_t>> xpages) {
  node* cur = &root_;
  const size_t ps = static_cast<size_t>(opt_.page_size);
  int32_t added = 0;
  ++clock_;
  for (size_t i = 0; (i + 1) * ps <= tokens.size() && i < pages.size(); ++i) {
    std::vector<int32_t> key(tokens.begin() + static_cast<std::ptrdiff_t>(i * ps),
                             tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * ps));
    auto it = cur->children.find(key);
    node* n;
    auto xpage = [&](size_t p) -> int32_t {
      return p - 1 < xpages.size() && i < xpages[p - 1].size() ? xpages[p - 1][i] : -1;
    };
    if (it == cur->children.end()) {
      auto nn = new_node();
      nn->dev = pages[i];
      hold_device(pages[i]);  // the cache's own reference
      for (size_t p = 1; p < n_pools(); ++p)
        if (xpage(p) >= 0) {
          nn->xdev[p - 1] = xpage(p);
          hold_pool(p, xpage(p));
        }
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
      for (size_t p = 1; p < n_pools(); ++p)
        if (n->xdev[p - 1] < 0 && xpage(p) >= 0) {  // n->dev >= 0 here: the request's or its own
          n->xdev[p - 1] = xpage(p);
          hold_pool(p, xpage(p));
        }
      n->last_use = clock_;
    }
    cur = n;
  }
  return added;
}

}  // namespace tandem
