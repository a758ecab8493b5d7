#include <algorithm>

#include "actors/cache_tier/page_file.h"
#include "actors/cache_tier/radix_cache.h"
#include "kernels/model/kv_pools_plan.h"

/// radix_cache::match for layouts of several pools: the prefix is only as long as the blocks
/// the next token's window reads are somewhere (usable_prefix), and their pages are loaded
/// back with pool 0's. Allocation is all or nothing: when the pages for a host/disk hit cannot
/// be found, the match falls back to what the device holds, which needs no allocation.
namespace tandem {

radix_cache::match_result radix_cache::match_pools(std::span<const int32_t> tokens, int32_t max_tokens,
                                                   std::vector<copy_op>& ops) {
  const size_t ps = static_cast<size_t>(opt_.page_size);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(max_tokens, 0)));
  const size_t X = dev_x_.size();
  ++clock_;
  std::vector<node*> path;
  std::vector<disk_load> dk;
  walk_path(tokens, limit, path, dk);
  size_t n_dev = 0;
  while (n_dev < path.size() && path[n_dev]->dev >= 0) ++n_dev;
  auto bit = [](size_t p) { return 1u << (p - 1); };
  auto present_any = [&](size_t p, int64_t b) -> bool {
    if (p == 0) return true;
    if (size_t(b) < path.size()) {
      const node* n = path[size_t(b)];
      return n->xdev[p - 1] >= 0 || (host_tier() && n->xhost[p - 1] >= 0);
    }
    auto it = disk_.find(dk[size_t(b) - path.size()].hash);
    return it != disk_.end() && (it->second.mask & bit(p));
  };
  auto present_dev = [&](size_t p, int64_t b) -> bool {
    return size_t(b) < n_dev && (p == 0 || path[size_t(b)]->xdev[p - 1] >= 0);
  };
  const size_t k_dev = static_cast<size_t>(usable_prefix(opt_.pools, int64_t(n_dev * ps), present_dev)) / ps;
  size_t k = static_cast<size_t>(usable_prefix(opt_.pools, int64_t((path.size() + dk.size()) * ps), present_any)) / ps;
  if (!host_tier()) k = k_dev;
  match_result r;
  const int32_t min_lb = opt_.min_load_back_tokens > 0 ? opt_.min_load_back_tokens : opt_.page_size;
  if (k > k_dev && int32_t((k - std::min(k, n_dev)) * ps) < min_lb) {
    r.skipped_tokens = static_cast<int32_t>((k - std::min(k, n_dev)) * ps);
    k = k_dev;
  }

  // Provides every page of a k-block prefix; false (nothing held, nothing changed but
  // evictions) when the pages for its loads cannot be found.
  auto attempt = [&](size_t kk) -> bool {
    const size_t nd = std::min(n_dev, kk), np = std::min(path.size(), kk), nk = kk - np;
    std::vector<int32_t> live(X + 1, 0);
    for (size_t p = 1; p <= X; ++p) live[p] = opt_.pools.pools[p].first_live_block(int64_t(kk * ps));
    auto is_live = [&](size_t p, size_t b) { return int64_t(b) >= live[p]; };
    // Every page a load reads must be in host memory (usable_prefix checked it for k blocks).
    for (size_t b = nd; b < np; ++b)
      if (path[b]->host < 0) return false;
    for (size_t b = 0; b < np; ++b)
      for (size_t p = 1; p <= X; ++p)
        if (is_live(p, b) && path[b]->xdev[p - 1] < 0 && path[b]->xhost[p - 1] < 0) return false;
    // Pins: the device pages used as they are, the host pages the loads read, the disk entries.
    std::vector<int32_t> got0, pinned_host;
    std::vector<std::pair<int32_t, int32_t>> pinned_xhost;  // (pool, host page)
    std::vector<std::pair<size_t, int32_t>> gotx;  // (pool, page) references taken
    for (size_t i = 0; i < nd; ++i) {
      dev_.ref(path[i]->dev);
      got0.push_back(path[i]->dev);
    }
    for (size_t b = 0; b < np; ++b)
      for (size_t p = 1; p <= X; ++p)
        if (is_live(p, b) && path[b]->xdev[p - 1] >= 0) {
          dev_x_[p - 1]->ref(path[b]->xdev[p - 1]);
          gotx.emplace_back(p, path[b]->xdev[p - 1]);
        }
    for (size_t b = nd; b < np; ++b) {
      host_->ref(path[b]->host);
      pinned_host.push_back(path[b]->host);
    }
    for (size_t b = 0; b < np; ++b)
      for (size_t p = 1; p <= X; ++p)
        if (is_live(p, b) && path[b]->xdev[p - 1] < 0) {
          host_x_[p - 1]->ref(path[b]->xhost[p - 1]);
          pinned_xhost.emplace_back(int32_t(p), path[b]->xhost[p - 1]);
        }
    for (size_t j = 0; j < nk; ++j) disk_[dk[j].hash].pins += 1;
    // Allocations into temporaries: nothing is attached until all succeeded.
    std::vector<int32_t> new0, new_host;
    std::vector<std::vector<int32_t>> newx(X + 1), newxh(X + 1);  // device / host pages of pools 1..
    bool ok = true;
    for (size_t b = nd; b < kk && ok; ++b) {
      auto d = take_device(ops);
      if (!d) ok = false;
      else new0.push_back(*d);
      if (ok && b >= np) {
        auto h = take_host(ops);
        if (!h) ok = false;
        else new_host.push_back(*h);
      }
    }
    for (size_t p = 1; p <= X && ok; ++p)
      for (size_t b = size_t(live[p]); b < kk && ok; ++b) {
        if (b < np && path[b]->xdev[p - 1] >= 0) continue;
        auto x = alloc_pool(p, 1, ops);
        if (!x) ok = false;
        else newx[p].push_back((*x)[0]);
        if (ok && b >= np) {  // a disk block: read into a host page of the pool first
          auto h = take_xhost(p);
          if (!h) ok = false;
          else newxh[p].push_back(*h);
        }
      }
    if (!ok) {
      dev_.unref_all(new0);
      dev_.unref_all(got0);
      for (auto h : new_host) host_->unref(h);
      for (auto h : pinned_host) host_->unref(h);
      for (size_t p = 1; p <= X; ++p)
        for (auto h : newxh[p]) host_x_[p - 1]->unref(h);
      for (auto [p, h] : pinned_xhost) host_x_[size_t(p) - 1]->unref(h);
      for (size_t p = 1; p <= X; ++p) dev_x_[p - 1]->unref_all(newx[p]);
      for (auto [p, x] : gotx) dev_x_[p - 1]->unref(x);
      for (size_t j = 0; j < nk; ++j) disk_[dk[j].hash].pins -= 1;
      return false;
    }
    // Commit: pages in block order per pool, copies for every load.
    r.pages = got0;
    r.xpages.assign(X, std::vector<int32_t>(kk, -1));
    std::vector<size_t> nx(X + 1, 0), nxh(X + 1, 0);
    auto load = [&](copy_op::kind_t kind, int32_t dev, int32_t host, size_t p) {
      copy_op op;
      op.kind = kind;
      op.device = dev;
      op.host = host;
      op.pool = static_cast<int32_t>(p);
      ops.push_back(std::move(op));
    };
    for (size_t b = 0; b < np; ++b) {
      node* n = path[b];
      if (b >= nd) {
        const int32_t d = new0[b - nd];
        n->dev = d;
        ++n_device_nodes_;
        dev_.set_cached(d, true);
        dev_.ref(d);
        load(copy_op::host_to_device, d, n->host, 0);
        r.pages.push_back(d);
      }
      for (size_t p = 1; p <= X; ++p) {
        if (!is_live(p, b)) continue;
        if (n->xdev[p - 1] < 0) {
          const int32_t x = newx[p][nx[p]++];
          n->xdev[p - 1] = x;
          dev_x_[p - 1]->set_cached(x, true);
          dev_x_[p - 1]->ref(x);
          load(copy_op::host_to_device, x, n->xhost[p - 1], p);
        }
        r.xpages[p - 1][b] = n->xdev[p - 1];
      }
    }
    for (size_t j = 0; j < nk; ++j) {
      disk_load d = std::move(dk[j]);
      const size_t b = np + j;
      d.host = new_host[j];
      d.device = new0[b - nd];
      copy_op rd;
      rd.kind = copy_op::disk_to_host;
      rd.host = d.host;
      rd.hash = d.hash;
      rd.parent = d.parent;
      rd.tokens = d.tokens;
      d.op_index = ops.size();
      ops.push_back(rd);
      load(copy_op::host_to_device, d.device, d.host, 0);
      for (size_t p = 1; p <= X; ++p) {
        if (!is_live(p, b)) continue;
        d.xhost[p - 1] = newxh[p][nxh[p]++];
        copy_op rx = rd;
        rx.pool = static_cast<int32_t>(p);
        rx.host = d.xhost[p - 1];
        d.xop[p - 1] = ops.size();
        ops.push_back(std::move(rx));
        d.mask |= bit(p);
        d.xdevice[p - 1] = newx[p][nx[p]++];
        load(copy_op::host_to_device, d.xdevice[p - 1], d.xhost[p - 1], p);
        r.xpages[p - 1][b] = d.xdevice[p - 1];
      }
      r.pages.push_back(d.device);
      r.pinned_disk.push_back(d.hash);
      touch_disk(d.hash);
      r.disk.push_back(std::move(d));
    }
    r.pinned_host = std::move(pinned_host);
    r.pinned_xhost = std::move(pinned_xhost);
    for (size_t i = 0; i < np; ++i) {
      path[i]->last_use = clock_;
      path[i]->hits += 1;
    }
    r.attach = np > 0 ? static_cast<const void*>(path[np - 1]) : static_cast<const void*>(&root_);
    r.device_tokens = static_cast<int32_t>(nd * ps);
    r.host_tokens = static_cast<int32_t>((np - nd) * ps);
    r.disk_tokens = static_cast<int32_t>(nk * ps);
    r.tokens = static_cast<int32_t>(kk * ps);
    if (opt_.policy == cache_write_policy::write_through_selective)
      for (size_t i = 0; i < nd; ++i)
        if (path[i]->host < 0 && path[i]->hits >= opt_.write_through_threshold) backup(path[i], ops);
    return true;
  };
  if (!attempt(k)) {
    // Device-only, over what the failed attempt's evictions left (they may have dropped window
    // pages it did not pin): every page is there, so this needs no allocation.
    const size_t k2 =
        static_cast<size_t>(usable_prefix(opt_.pools, int64_t(std::min(k_dev, k) * ps), present_dev)) / ps;
    if (!attempt(k2)) r = match_result{};
  }
  return r;
}

}  // namespace tandem
