#pragma once
/// The cache tier actor's state (cache_tier.cpp is its behaviour; cache_tier_metrics.cpp renders
/// its metrics). Internal to actors/cache_tier.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <caf/all.hpp>
#include <memory>
#include <string>
#include <vector>

#include "actors/cache_tier/cache_tier.h"
#include "actors/cache_tier/page_allocator.h"
#include "actors/cache_tier/radix_cache.h"
#include "actors/common/bounded_mailbox.h"
#include "actors/common/protocol.h"
#include "actors/common/receive.h"
#include "actors/common/metrics.h"
#include "actors/common/pool_pages_wire.h"

namespace tandem::cache_detail {

/// A `List(PoolPages)` field seen as the `extraPools` that read_pool_pages reads.
struct extra_reader {
  capnp::List<schema::PoolPages>::Reader l;
  capnp::List<schema::PoolPages>::Reader getExtraPools() const { return l; }
};

struct copy_done {
  std::vector<uint32_t> failed;
  uint64_t bytes = 0;
  int64_t worker_us = 0;
  double wall_s = 0;
};

struct cache_state {
  cache_tier_options opt;
  role_handle<worker_role> worker;
  std::unique_ptr<page_allocator> alloc;
  std::vector<std::unique_ptr<page_allocator>> xalloc;  ///< pools 1.. of the layout set
  std::unique_ptr<page_allocator> host_alloc;
  std::vector<std::unique_ptr<page_allocator>> xhost_alloc;  ///< host pages of pools 1..
  std::unique_ptr<radix_cache> cache;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<spdlog::logger> log;
  inbox box;  ///< the receive side (gate, log, unexpected-message counters)
  int64_t lookups = 0, hits = 0, hit_tokens = 0, alloc_failures = 0, bad_frees = 0;
  int64_t tier_hits[3] = {0, 0, 0}, tier_hit_tokens[3] = {0, 0, 0};
  int64_t load_back_tokens = 0, load_back_skipped_tokens = 0, copy_bytes = 0, copy_batches = 0;
  double load_back_s = 0, copy_s = 0;
  int64_t background_in_flight = 0, disk_restored = 0;
  int64_t fork_copies = 0;  ///< device pages copied for forks (decode n > 1)
  static inline const char* name = "cache_tier";

  bool tiers() const { return host_alloc != nullptr; }
  page_allocator& pool(size_t p) { return p == 0 ? *alloc : *xalloc[p - 1]; }
  const std::string& pool_name(size_t p) const { return opt.pools.pools[p].name; }
  /// Drops the references of `pages` (pool by pool; -1 entries skipped), counting bad frees.
  void unref_pools(const pool_pages& pages, const std::string& id) {
    for (size_t p = 0; p < pages.size() && p <= xalloc.size(); ++p)
      for (auto x : pages[p]) {
        if (x < 0 && p > 0) continue;
        try {
          pool(p).unref(x);
        } catch (const tandem::error& e) {
          ++bad_frees;
          log->error("request {}: {}", id, e.what());
        }
      }
  }

  tandem::error exhausted(const std::string& id, int32_t n) const {
    return tandem::error(
        error_kind::overloaded,
        fmt::format("request {}: KV cache exhausted ({} pages wanted, {} of {} free, {} cached and "
                    "in use); retry later or raise limits.kv_cache_mb / device_pages",
                    id, n, alloc->n_free(), alloc->n_pages(), cache->cached_pages()));
  }
};

using cache_actor_t = caf::stateful_actor<cache_state>;

/// Every metric of the cache tier (its stats reply).
std::vector<metric_sample> cache_metrics(const cache_state& s);

}  // namespace tandem::cache_detail
