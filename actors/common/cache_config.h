#pragma once
/// Settings of the hierarchical KV cache (device -> host -> disk). Filled from `tandem serve`
/// flags or the `[cache]` table of a cluster config; checked by validate_cache_config() both in
/// `tandem check-config` and at every start, before any actor exists.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "actors/common/limits.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

/// When the host tier (L2) gets a copy of a device (L1) page.
enum class cache_write_policy : uint8_t {
  write_through,            ///< every page computed by prefill is backed up at once
  write_through_selective,  ///< backed up after `write_through_threshold` hits
  write_back,               ///< backed up on eviction from L1; the eviction waits for the copy
};

struct cache_config {
  bool enabled = true;        ///< prefix reuse at all (L1 radix cache)
  /// L2 size as a multiple of the device pool; 0 = no host tier. Exclusive with host_size_gb.
  double host_ratio = 0;
  /// L2 size in GiB; 0 = use host_ratio. Exclusive with host_ratio.
  double host_size_gb = 0;
  /// How host_size_gb is split across the pools of a layout set (pool name, fraction; the
  /// fractions name every pool and sum to 1). Empty = in proportion to the pools' device bytes.
  std::vector<std::pair<std::string, double>> host_pool_share;
  cache_write_policy write_policy = cache_write_policy::write_through_selective;
  int32_t write_through_threshold = 2;  ///< hits before a write_through_selective backup
  std::string disk_dir;                 ///< L3 directory; empty = no disk tier
  double disk_size_gb = 0;              ///< L3 bound; required when disk_dir is set
  int32_t min_load_back_tokens = 0;     ///< shorter L2/L3 hits are recomputed instead (0 = page_size)
};

/// Host (L2) pages `c` asks for on a device pool of `device_pages` pages: host_ratio x
/// device_pages, or floor(host_size_gb GiB / page bytes); 0 = no host tier.
int64_t cache_host_pages(const cache_config& c, const kv_layout& layout, int32_t device_pages);
/// The same for pool 0 of a layout set on a device pool of `device_pages` pool-0 pages
/// (cache_host_pool_pages' first entry when every pool has as many device pages).
int64_t cache_host_pages(const cache_config& c, const kv_pools_layout& set, int32_t device_pages);
/// Host (L2) pages of every pool of a layout set whose device pools have `pool_pages` pages:
/// host_ratio x each pool's device pages, or host_size_gb split across the pools (by
/// host_pool_share, else in proportion to their device bytes), whole pages of each pool.
/// Empty when `c` asks for no host tier.
std::vector<int64_t> cache_host_pool_pages(const cache_config& c, const kv_pools_layout& set,
                                           std::span<const int64_t> pool_pages);
/// Bytes of a block's L3 files (one per pool).
uint64_t cache_disk_block_bytes(const kv_pools_layout& set);
/// L3 entries (blocks, a file per pool each) `c` allows for a layout set.
int64_t cache_disk_pages(const cache_config& c, const kv_pools_layout& set);
/// Bytes of one L3 file (header, the page's tokens, the page bytes, checksum).
uint64_t cache_disk_file_bytes(const kv_layout& layout);
/// L3 files `c` allows: floor(disk_size_gb GiB / file bytes); 0 = no disk tier.
int64_t cache_disk_pages(const cache_config& c, const kv_layout& layout);

/// Parses "write_through" / "write_through_selective" / "write_back"; false if unknown.
bool parse_cache_write_policy(const std::string& s, cache_write_policy& out);
const char* cache_write_policy_name(cache_write_policy p);

/// One problem per entry, each naming the key (as `cache.<key>`), the value, why, and the fix;
/// empty if `c` can be honoured for a model whose KV pages look like `layout` on a device pool of
/// `device_pages` pages with `host_ram_bytes` of host memory available (0 = unknown, not checked).
std::vector<std::string> validate_cache_config(const cache_config& c, const kv_layout& layout, int32_t device_pages,
                                               uint64_t host_ram_bytes);
/// validate_cache_config for a layout set (`device_pages`: pool 0's; the other pools as many).
std::vector<std::string> validate_cache_config(const cache_config& c, const kv_pools_layout& set, int32_t device_pages,
                                               uint64_t host_ram_bytes);
/// validate_cache_config for a layout set whose device pools have `pool_pages` pages each.
std::vector<std::string> validate_cache_config(const cache_config& c, const kv_pools_layout& set,
                                               std::span<const int64_t> pool_pages, uint64_t host_ram_bytes);

/// The KV memory one node builds: its device pool and the cache tiers behind it, from the
/// limits and [cache] settings for a model's KV layout. `tandem serve` (actor_cluster) builds
/// exactly this and `tandem check-config` checks exactly this, so a config that passes the
/// check cannot fail at start on sizing.
struct kv_sizing {
  int64_t device_pages = 0;  ///< limits.device_pages, or kv_cache_mb MiB / page bytes
  int64_t host_pages = 0;    ///< L2 pages of pool 0 (0 = none; also 0 with the prefix cache off)
  /// L2 pages of every pool, pool 0 (= host_pages) first; empty = no host tier. Each pool has
  /// its own host allocator: a block may keep its full-context page in host memory without its
  /// window page.
  std::vector<int64_t> host_pool_pages;
  int64_t disk_pages = 0;    ///< L3 entries (0 = none; only behind a host tier; a file per pool each)
  /// Host bytes of every pool (host_pool_pages x the pool's page bytes).
  std::vector<uint64_t> host_pool_bytes;
  /// Device pages of every pool of the layout set, pool 0 (= device_pages) first. A window
  /// pool gets a ring per sequence the node can hold at once (limits.max_running_seqs +
  /// max_prefill_batch_seqs), the full pool the rest of limits.kv_cache_mb.
  std::vector<int64_t> pool_pages;
  /// One entry per reason the node cannot start with these settings, each naming the fix;
  /// empty = it can.
  std::vector<std::string> problems;
  bool ok() const { return problems.empty(); }
};

/// Sizes a node's KV pools; `host_ram_bytes` as in validate_cache_config (0 = not checked).
kv_sizing size_kv_pools(const limits& lim, const cache_config& c, const kv_layout& layout, uint64_t host_ram_bytes);
/// size_kv_pools for a layout set (kernels/model/kv_pools.h).
kv_sizing size_kv_pools(const limits& lim, const cache_config& c, const kv_pools_layout& set, uint64_t host_ram_bytes);

}  // namespace tandem
