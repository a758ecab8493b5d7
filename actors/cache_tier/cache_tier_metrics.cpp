#include <fmt/format.h>

#include "actors/cache_tier/cache_tier_state.h"

/// The cache tier's metrics: device, host and disk tiers, per pool of the layout set, and the
/// copies between tiers (docs/metrics.md).
namespace tandem::cache_detail {

namespace {
constexpr const char* k_tier[3] = {"device", "host", "disk"};
}  // namespace

std::vector<metric_sample> cache_metrics(const cache_state& s) {
  std::vector<metric_sample> m = {
      {"kv_pages_total", "", double(s.alloc->n_pages()), "gauge", "KV pages in the device pool"},
      {"kv_pages_free", "", double(s.alloc->n_free()), "gauge", "KV pages on the free list"},
      {"kv_fork_page_copies_total", "", double(s.fork_copies), "counter",
       "KV pages copied for forked sequences (n > 1: the block each fork writes first)"},
      {"kv_pages_cached", "", double(s.cache->cached_pages()), "gauge", "KV pages held by the prefix cache"},
      {"kv_pages_evictable", "", double(s.alloc->n_evictable()), "gauge",
       "Cached KV pages no request uses (reclaimable)"},
      {"prefix_cache_lookups_total", "", double(s.lookups), "counter", "Prefix cache lookups"},
      {"prefix_cache_hits_total", "", double(s.hits), "counter", "Lookups that reused at least one page"},
      {"prefix_cache_hit_tokens_total", "", double(s.hit_tokens), "counter",
       "Prompt tokens served from the prefix cache (any tier)"},
      {"prefix_cache_evictions_total", "", double(s.cache->evictions(0)), "counter",
       "Cached pages evicted from the device pool"},
      {"kv_alloc_failures_total", "", double(s.alloc_failures), "counter",
       "Page allocations that failed (overloaded)"},
      {"kv_bad_frees_total", "", double(s.bad_frees), "counter", "Frees of pages that were not allocated (bugs)"},
  };
  const double used[3] = {double(s.alloc->n_pages() - s.alloc->n_free()),
                          double(s.host_alloc ? s.host_alloc->n_pages() - s.host_alloc->n_free() : 0),
                          double(s.cache->disk_pages())};
  const double total[3] = {double(s.alloc->n_pages()), double(s.host_alloc ? s.host_alloc->n_pages() : 0),
                           double(s.cache->disk_bound())};
  for (int t = 0; t < 3; ++t) {
    auto l = fmt::format("tier=\"{}\"", k_tier[t]);
    m.push_back({"cache_hits_total", l, double(s.tier_hits[t]), "counter",
                 "Lookups whose reused prefix includes pages of this tier"});
    m.push_back({"cache_hit_tokens_total", l, double(s.tier_hit_tokens[t]), "counter",
                 "Prompt tokens reused from this tier"});
    m.push_back({"cache_evictions_total", l, double(s.cache->evictions(t)), "counter", "Pages evicted from this tier"});
    m.push_back({"cache_pages_used", l, used[t], "gauge", "Pages of this tier in use (cached or by requests)"});
    m.push_back({"cache_pages_total", l, total[t], "gauge", "Pages this tier can hold"});
    const double cached[3] = {double(s.cache->cached_pages()), double(s.cache->host_cached_pages()),
                              double(s.cache->disk_pages())};
    m.push_back({"cache_pages_cached", l, cached[t], "gauge", "Pages of this tier held by the prefix cache"});
  }
  for (size_t p = 0; p < s.opt.pools.pools.size(); ++p) {
    const auto& a = p == 0 ? *s.alloc : *s.xalloc[p - 1];
    auto l = fmt::format("pool=\"{}\"", s.opt.pools.pools[p].name);
    const double pb = double(s.opt.pools.pools[p].page.page_bytes());
    m.push_back({"kv_pool_pages_total", l, double(a.n_pages()), "gauge", "KV pages of this pool of the layout"});
    m.push_back({"kv_pool_pages_free", l, double(a.n_free()), "gauge", "KV pages of this pool on its free list"});
    m.push_back({"kv_pool_pages_cached", l, double(s.cache->cached_pool_pages(p)), "gauge",
                 "KV pages of this pool held by the prefix cache"});
    m.push_back({"kv_pool_device_bytes", l, double(a.n_pages()) * pb, "gauge", "Bytes of this pool on the device"});
    m.push_back({"kv_pool_device_bytes_used", l, double(a.n_pages() - a.n_free()) * pb, "gauge",
                 "Bytes of this pool's pages in use (cached or by requests)"});
    // Zeros without a host tier (dashboards divide by `total > 0`, so an unconfigured tier shows nothing).
    const page_allocator* h = !s.host_alloc ? nullptr : p == 0 ? s.host_alloc.get() : s.xhost_alloc[p - 1].get();
    const double h_total = h ? double(h->n_pages()) : 0, h_free = h ? double(h->n_free()) : 0;
    m.push_back({"kv_pool_host_pages_total", l, h_total, "gauge", "Host (L2) pages of this pool"});
    m.push_back({"kv_pool_host_pages_free", l, h_free, "gauge", "Host (L2) pages of this pool free"});
    m.push_back({"kv_pool_host_pages_cached", l, h ? double(s.cache->host_cached_pool_pages(p)) : 0.0, "gauge",
                 "Host (L2) pages of this pool holding cached blocks"});
    m.push_back({"kv_pool_host_bytes", l, h_total * pb, "gauge", "Host (L2) bytes of this pool"});
    m.push_back({"kv_pool_host_bytes_used", l, (h_total - h_free) * pb, "gauge", "Host (L2) bytes of this pool in use"});
  }
  for (int t = 1; t < 3; ++t)
    m.push_back({"cache_backup_tokens_total", fmt::format("tier=\"{}\"", k_tier[t]), double(s.cache->backup_tokens(t)),
                 "counter", "Tokens copied into this tier (write-through, selective or write-back)"});
  m.push_back({"cache_load_back_tokens_total", "", double(s.load_back_tokens), "counter",
               "Tokens loaded back from host/disk into device pages"});
  m.push_back({"cache_load_back_seconds_total", "", s.load_back_s, "counter",
               "Seconds requests waited for load-back copies (round trip through the worker)"});
  m.push_back({"cache_load_back_skipped_tokens_total", "", double(s.load_back_skipped_tokens), "counter",
               "Host/disk hits shorter than cache.min_load_back_tokens, recomputed instead"});
  m.push_back({"cache_copy_bytes_total", "", double(s.copy_bytes), "counter", "Bytes copied between the tiers"});
  m.push_back({"cache_copy_seconds_total", "", s.copy_s, "counter",
               "Worker seconds spent copying between the tiers (bytes / seconds = bandwidth)"});
  m.push_back({"cache_copy_bandwidth_bytes_per_second", "", s.copy_s > 0 ? double(s.copy_bytes) / s.copy_s : 0.0,
               "gauge", "Average copy bandwidth between the tiers"});
  m.push_back({"cache_copy_batches_total", "", double(s.copy_batches), "counter", "Copy batches sent to the worker"});
  m.push_back({"cache_backups_skipped_total", "", double(s.cache->backups_skipped()), "counter",
               "Backups not made (copy queue full or no host page free)"});
  m.push_back({"cache_background_copies", "", double(s.background_in_flight), "gauge", "Backup batches in flight"});
  m.push_back({"cache_background_copies_bound", "", double(s.opt.max_background_copies), "gauge",
               "Backup batches allowed in flight"});
  m.push_back({"cache_disk_read_failures_total", "", double(s.cache->disk_read_failures()), "counter",
               "Disk tier files that failed to read or verify (bad checksum): treated as misses"});
  m.push_back({"cache_disk_restored_pages", "", double(s.disk_restored), "gauge",
               "Disk tier files found at start (from an earlier process)"});
  return m;
}

}  // namespace tandem::cache_detail
