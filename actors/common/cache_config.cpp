#include "actors/common/cache_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <system_error>

namespace tandem {

namespace {
constexpr double k_gib = 1024.0 * 1024.0 * 1024.0;
/// Fixed part of an L3 file: magic, version, layout fingerprint, chain hash, parent hash,
/// token count, payload size, checksum (see actors/cache_tier/disk_format.h).
constexpr uint64_t k_disk_header_bytes = 64;
}  // namespace

namespace {
/// A one-pool set reads as its page ("layers=22 kv_heads=4 ..."), as before layout sets.
std::string set_text(const kv_pools_layout& set) {
  return set.pools.size() == 1 ? set.pools[0].page.describe() : set.describe();
}
bool set_valid(const kv_pools_layout& set) {
  if (set.pools.empty()) return false;
  for (const auto& p : set.pools)
    if (!p.page.valid()) return false;
  return true;
}
}  // namespace

namespace {
/// The fraction of host_size_gb each pool gets: host_pool_share when it names exactly the set's
/// pools, else the pools' device bytes (validate_cache_config reports a share that does not fit).
std::vector<double> host_shares(const cache_config& c, const kv_pools_layout& set, std::span<const int64_t> pool_pages) {
  const size_t n = set.pools.size();
  std::vector<double> share(n, 0);
  bool named = !c.host_pool_share.empty() && c.host_pool_share.size() == n;
  for (size_t p = 0; named && p < n; ++p) {
    auto it = std::find_if(c.host_pool_share.begin(), c.host_pool_share.end(),
                           [&](const auto& e) { return e.first == set.pools[p].name; });
    if (it == c.host_pool_share.end() || !(it->second > 0)) named = false;
    else share[p] = it->second;
  }
  if (named) return share;
  double total = 0;
  for (size_t p = 0; p < n; ++p) {
    share[p] = double(p < pool_pages.size() ? pool_pages[p] : 0) * double(set.pools[p].page.page_bytes());
    total += share[p];
  }
  for (auto& s : share) s = total > 0 ? s / total : 1.0 / double(n);
  return share;
}

std::string percent_list(const kv_pools_layout& set, const std::vector<double>& share) {
  std::string out;
  for (size_t p = 0; p < set.pools.size(); ++p)
    out += fmt::format("{}{} {:.1f}%", out.empty() ? "" : ", ", set.pools[p].name, 100.0 * share[p]);
  return out;
}
}  // namespace

std::vector<int64_t> cache_host_pool_pages(const cache_config& c, const kv_pools_layout& set,
                                           std::span<const int64_t> pool_pages) {
  std::vector<int64_t> out;
  if (set.pools.empty() || pool_pages.size() < set.pools.size()) return out;
  if (c.host_ratio > 0) {
    for (size_t p = 0; p < set.pools.size(); ++p)
      out.push_back(static_cast<int64_t>(std::floor(c.host_ratio * double(pool_pages[p]))));
    return out;
  }
  if (!(c.host_size_gb > 0)) return out;
  const std::vector<double> share = host_shares(c, set, pool_pages);
  for (size_t p = 0; p < set.pools.size(); ++p) {
    const double pb = std::max<double>(1, double(set.pools[p].page.page_bytes()));
    out.push_back(static_cast<int64_t>(std::floor(c.host_size_gb * k_gib * share[p] / pb)));
  }
  return out;
}

int64_t cache_host_pages(const cache_config& c, const kv_pools_layout& set, int32_t device_pages) {
  const std::vector<int64_t> pages(set.pools.size(), device_pages);
  const auto host = cache_host_pool_pages(c, set, pages);
  return host.empty() ? 0 : host[0];
}

int64_t cache_host_pages(const cache_config& c, const kv_layout& layout, int32_t device_pages) {
  return cache_host_pages(c, kv_pools_layout::single(layout), device_pages);
}

uint64_t cache_disk_file_bytes(const kv_layout& layout) {
  return k_disk_header_bytes + uint64_t(layout.page_size) * 4 + uint64_t(layout.page_bytes());
}

uint64_t cache_disk_block_bytes(const kv_pools_layout& set) {
  uint64_t b = 0;
  for (const auto& p : set.pools) b += cache_disk_file_bytes(p.page);
  return b;
}

int64_t cache_disk_pages(const cache_config& c, const kv_pools_layout& set) {
  if (c.disk_dir.empty() || c.disk_size_gb <= 0 || cache_disk_block_bytes(set) == 0) return 0;
  return static_cast<int64_t>(std::floor(c.disk_size_gb * k_gib / double(cache_disk_block_bytes(set))));
}

int64_t cache_disk_pages(const cache_config& c, const kv_layout& layout) {
  return cache_disk_pages(c, kv_pools_layout::single(layout));
}

bool parse_cache_write_policy(const std::string& s, cache_write_policy& out) {
  if (s == "write_through") {
    out = cache_write_policy::write_through;
  } else if (s == "write_through_selective") {
    out = cache_write_policy::write_through_selective;
  } else if (s == "write_back") {
    out = cache_write_policy::write_back;
  } else {
    return false;
  }
  return true;
}

const char* cache_write_policy_name(cache_write_policy p) {
  switch (p) {
    case cache_write_policy::write_through: return "write_through";
    case cache_write_policy::write_through_selective: return "write_through_selective";
    case cache_write_policy::write_back: return "write_back";
  }
  return "write_through_selective";
}

std::vector<std::string> validate_cache_config(const cache_config& c, const kv_layout& layout, int32_t device_pages,
                                               uint64_t host_ram_bytes) {
  return validate_cache_config(c, kv_pools_layout::single(layout), device_pages, host_ram_bytes);
}

std::vector<std::string> validate_cache_config(const cache_config& c, const kv_pools_layout& set, int32_t device_pages,
                                               uint64_t host_ram_bytes) {
  const std::vector<int64_t> pages(set.pools.size(), device_pages);
  return validate_cache_config(c, set, pages, host_ram_bytes);
}

namespace {
/// Problems of cache.host_pool_share for the pools of `set` (names, values, sum).
void check_host_shares(const cache_config& c, const kv_pools_layout& set, std::vector<std::string>& out) {
  if (c.host_pool_share.empty()) return;
  std::string names;
  for (const auto& sp : set.pools) names += (names.empty() ? "" : ", ") + sp.name;
  if (c.host_ratio > 0) {
    out.push_back(fmt::format("cache.host_pool_share splits cache.host_size_gb, but the host tier is sized by "
                              "cache.host_ratio = {} (each pool gets that multiple of its device pages); remove "
                              "host_pool_share or size the tier with host_size_gb",
                              c.host_ratio));
    return;
  }
  double sum = 0;
  for (const auto& [name, v] : c.host_pool_share) {
    const bool known = std::any_of(set.pools.begin(), set.pools.end(), [&](const auto& sp) { return sp.name == name; });
    if (!known)
      out.push_back(fmt::format("cache.host_pool_share names pool '{}', which this model's KV layout does not have "
                                "(its pools: {}); name each of them once",
                                name, names));
    if (!std::isfinite(v) || v <= 0 || v > 1)
      out.push_back(fmt::format("cache.host_pool_share.{} = {} must be a fraction in (0, 1]; e.g. 0.5", name, v));
    sum += v;
  }
  for (const auto& sp : set.pools)
    if (std::none_of(c.host_pool_share.begin(), c.host_pool_share.end(), [&](const auto& e) { return e.first == sp.name; }))
      out.push_back(fmt::format("cache.host_pool_share does not name pool '{}' (the model's pools: {}); give every "
                                "pool a fraction, or remove host_pool_share to split by device bytes",
                                sp.name, names));
  if (std::abs(sum - 1.0) > 1e-6)
    out.push_back(fmt::format("cache.host_pool_share fractions sum to {:.6g}; they split cache.host_size_gb, so "
                              "they must sum to 1",
                              sum));
}
}  // namespace

std::vector<std::string> validate_cache_config(const cache_config& c, const kv_pools_layout& set,
                                               std::span<const int64_t> pool_pages, uint64_t host_ram_bytes) {
  std::vector<std::string> out;
  auto bad_number = [](double v) { return !std::isfinite(v) || v < 0; };
  if (bad_number(c.host_ratio))
    out.push_back(fmt::format("cache.host_ratio = {} must be a finite number >= 0; use e.g. 2 (host pool = 2x the "
                              "device pool) or 0 for no host tier",
                              c.host_ratio));
  if (bad_number(c.host_size_gb))
    out.push_back(fmt::format("cache.host_size_gb = {} must be a finite number >= 0; use e.g. 8, or 0 and set "
                              "cache.host_ratio instead",
                              c.host_size_gb));
  if (bad_number(c.disk_size_gb))
    out.push_back(fmt::format("cache.disk_size_gb = {} must be a finite number >= 0; use e.g. 64", c.disk_size_gb));
  if (!out.empty()) return out;  // the checks below compute with these numbers

  if (c.host_ratio > 0 && c.host_size_gb > 0)
    out.push_back(fmt::format("cache.host_ratio = {} and cache.host_size_gb = {} are both set, but they are two "
                              "ways to size the same host pool; keep one and set the other to 0",
                              c.host_ratio, c.host_size_gb));
  const bool host = c.host_ratio > 0 || c.host_size_gb > 0;
  const bool layout_ok = set_valid(set) && pool_pages.size() >= set.pools.size();
  if (!layout_ok && (host || !c.disk_dir.empty()))
    out.push_back(fmt::format("cache: the model's KV layout ({}) is not valid, so no host or disk tier can be "
                              "sized; fix the model file or disable cache.host_ratio / cache.disk_dir",
                              set_text(set)));
  if (layout_ok) check_host_shares(c, set, out);
  const bool shares_ok = out.empty();
  // Each pool has host pages of its own; every pool needs at least one.
  std::vector<int64_t> host_pages;
  if (layout_ok && host && shares_ok) host_pages = cache_host_pool_pages(c, set, pool_pages);
  const bool one = set.pools.size() == 1;
  auto pool_name = [&](size_t p) { return one ? std::string() : fmt::format(" '{}'", set.pools[p].name); };
  if (!host_pages.empty() && c.host_size_gb > 0 && c.host_ratio == 0) {
    // The host pool holds whole KV pages of each pool; an absolute size that leaves a pool
    // without one cannot be honoured (the ratio always can: it scales with the pages).
    const std::vector<double> share = host_shares(c, set, pool_pages);
    double min_bytes = 0;
    for (size_t p = 0; p < set.pools.size(); ++p)
      min_bytes = std::max(min_bytes, double(set.pools[p].page.page_bytes()) / std::max(share[p], 1e-12));
    for (size_t p = 0; p < set.pools.size(); ++p) {
      if (host_pages[p] >= 1) continue;
      const uint64_t pb = set.pools[p].page.page_bytes();
      out.push_back(fmt::format(
          "cache.host_size_gb = {} is not supported for this model's KV layout: {}one page of {}{} takes {} "
          "bytes ({:.6f} GiB), so its host pool would hold no page; use cache.host_ratio (e.g. 2) or a "
          "cache.host_size_gb of at least {:.6f}",
          c.host_size_gb, one ? "" : fmt::format("split across its pools ({}), ", percent_list(set, share)),
          one ? "" : fmt::format("pool '{}' (", set.pools[p].name), set.pools[p].page.describe() + (one ? "" : ")"), pb,
          double(pb) / k_gib, std::ceil(min_bytes / k_gib * 1e6) / 1e6));  // rounded up: enough
      break;  // the minimum size covers every pool
    }
  }
  if (!host_pages.empty() && c.host_ratio > 0) {
    for (size_t p = 0; p < set.pools.size(); ++p) {
      if (host_pages[p] >= 1) continue;
      out.push_back(fmt::format("cache.host_ratio = {} of device pool{} of {} pages gives no host page; use a ratio "
                                ">= {:.3f} or 0 for no host tier",
                                c.host_ratio, pool_name(p), pool_pages[p],
                                pool_pages[p] > 0 ? 1.0 / double(pool_pages[p]) : 1.0));
      break;
    }
  }
  for (size_t p = 0; p < host_pages.size(); ++p)
    if (host_pages[p] > (int64_t(1) << 30)) {
      out.push_back(fmt::format("cache: the host pool{} would hold {} pages, more than the 2^30 page ids a pool can "
                                "name; lower cache.host_ratio / cache.host_size_gb or raise limits.page_size",
                                pool_name(p), host_pages[p]));
      break;
    }
  if (host_ram_bytes > 0 && !host_pages.empty()) {
    double want = 0;
    for (size_t p = 0; p < host_pages.size(); ++p) want += double(host_pages[p]) * double(set.pools[p].page.page_bytes());
    if (want > 0.9 * double(host_ram_bytes))
      out.push_back(fmt::format("cache: the host pool needs {:.2f} GiB ({} pages of {} bytes{}) but the machine has "
                                "{:.2f} GiB of RAM (at most 90% may go to the pool); lower {} ",
                                want / k_gib, host_pages[0], set.pools[0].page.page_bytes(),
                                one ? "" : " and the other pools' pages", double(host_ram_bytes) / k_gib,
                                c.host_ratio > 0 ? "cache.host_ratio" : "cache.host_size_gb"));
  }
  if (c.write_policy == cache_write_policy::write_through_selective && c.write_through_threshold < 1)
    out.push_back(fmt::format("cache.write_through_threshold = {} must be >= 1 (hits before a page is backed up "
                              "to the host tier); use e.g. 2, or cache.write_policy = write_through",
                              c.write_through_threshold));
  if (c.min_load_back_tokens < 0)
    out.push_back(fmt::format("cache.min_load_back_tokens = {} must be >= 0 (0 = one page); use e.g. {}",
                              c.min_load_back_tokens, set.page_size()));
  if (!c.enabled && (host || !c.disk_dir.empty()))
    out.push_back("cache.enabled = false turns prefix reuse off, so the host/disk tiers set by cache.host_ratio, "
                  "cache.host_size_gb or cache.disk_dir would never be used; enable the cache or unset them");

  if (!c.disk_dir.empty()) {
    if (!host)
      out.push_back(fmt::format("cache.disk_dir = '{}' needs a host tier (disk pages load back through host "
                                "memory); set cache.host_ratio (e.g. 2) or cache.host_size_gb",
                                c.disk_dir));
    if (c.disk_size_gb <= 0)
      out.push_back(fmt::format("cache.disk_size_gb = {} must be > 0 when cache.disk_dir = '{}' is set (the disk "
                                "tier needs a bound); use e.g. 64",
                                c.disk_size_gb, c.disk_dir));
    else if (layout_ok && cache_disk_pages(c, set) < 1)
      out.push_back(fmt::format("cache.disk_size_gb = {} is smaller than one page file of this model ({} bytes); "
                                "raise it to at least {:.6f}",
                                c.disk_size_gb, cache_disk_block_bytes(set),
                                double(cache_disk_block_bytes(set)) / k_gib));
    std::error_code ec;
    auto st = std::filesystem::status(c.disk_dir, ec);
    if (!ec && std::filesystem::exists(st) && !std::filesystem::is_directory(st))
      out.push_back(fmt::format("cache.disk_dir = '{}' exists and is not a directory; point it at a directory "
                                "(it is created if missing)",
                                c.disk_dir));
  } else if (c.disk_size_gb > 0) {
    out.push_back(fmt::format("cache.disk_size_gb = {} is set but cache.disk_dir is empty; set cache.disk_dir to a "
                              "directory or cache.disk_size_gb to 0",
                              c.disk_size_gb));
  }
  return out;
}

kv_sizing size_kv_pools(const limits& lim, const cache_config& c, const kv_layout& layout, uint64_t host_ram_bytes) {
  return size_kv_pools(lim, c, kv_pools_layout::single(layout), host_ram_bytes);
}

kv_sizing size_kv_pools(const limits& lim, const cache_config& c, const kv_pools_layout& set, uint64_t host_ram_bytes) {
  kv_sizing k;
  if (set.pools.empty()) {
    k.problems.push_back("the model declares no KV pool; the model file is broken");
    return k;
  }
  const kv_layout& layout = set.pools[0].page;
  const int64_t page_bytes = std::max<int64_t>(1, int64_t(layout.page_bytes()));
  const int64_t budget = int64_t(lim.kv_cache_mb) * 1024 * 1024;
  // Window pools: a ring of pages per sequence that can hold one (decode batch + prefill batch),
  // never more pages than the full pool has blocks. The full pool gets the rest of the budget.
  std::vector<int64_t> ring(set.pools.size(), 0);
  int64_t ring_bytes = 0;
  const int64_t seqs = int64_t(std::max(1, lim.max_running_seqs)) + int64_t(std::max(0, lim.max_prefill_batch_seqs));
  for (size_t p = 1; p < set.pools.size(); ++p) {
    ring[p] = seqs * set.pools[p].max_pages(int64_t(1) << 40, std::max(1, lim.prefill_chunk_tokens));
    ring_bytes += ring[p] * int64_t(set.pools[p].page.page_bytes());
  }
  if (lim.device_pages > 0) {
    k.device_pages = lim.device_pages;
  } else if (set.pools.size() > 1 && budget - ring_bytes < page_bytes) {
    // Not even the rings fit next to one full page: equal page counts, as if no pool were a window.
    k.device_pages = budget / std::max<int64_t>(1, int64_t(set.block_bytes()));
  } else {
    k.device_pages = (budget - ring_bytes) / page_bytes;
  }
  if (k.device_pages < 1 || k.device_pages > (int64_t(1) << 30)) {
    k.problems.push_back(fmt::format("KV pool of {} pages ({} bytes each, {}) from limits.kv_cache_mb = {} / "
                                     "device_pages = {}; give at least one page (kv_cache_mb >= {}) and at most 2^30",
                                     k.device_pages, set.block_bytes(), set_text(set), lim.kv_cache_mb,
                                     lim.device_pages, (int64_t(set.block_bytes()) + (1 << 20) - 1) >> 20));
    return k;
  }
  k.pool_pages.push_back(k.device_pages);
  for (size_t p = 1; p < set.pools.size(); ++p) k.pool_pages.push_back(std::min(ring[p], k.device_pages));
  k.problems = validate_cache_config(c, set, k.pool_pages, host_ram_bytes);
  if (!k.ok()) return k;
  const bool prefix_cache = lim.prefix_cache && c.enabled;
  if (prefix_cache) k.host_pool_pages = cache_host_pool_pages(c, set, k.pool_pages);
  k.host_pages = k.host_pool_pages.empty() ? 0 : k.host_pool_pages[0];
  if (k.host_pages <= 0) k.host_pool_pages.clear();
  for (size_t p = 0; p < k.host_pool_pages.size(); ++p)
    k.host_pool_bytes.push_back(uint64_t(k.host_pool_pages[p]) * uint64_t(set.pools[p].page.page_bytes()));
  k.disk_pages = k.host_pages > 0 ? cache_disk_pages(c, set) : 0;
  return k;
}

}  // namespace tandem
