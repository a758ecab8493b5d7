#pragma once
/// Cache tier actor: owns the bookkeeping of the hierarchical KV cache of one worker: the page
/// allocators of the device pool (L1) and the host pool (L2), the radix prefix tree over both
/// and the index of the disk tier (L3). Page memory and files belong to the worker, which runs
/// the copies this actor asks for (CacheCopy) in order with its forward passes.
///  - call Acquire{tokens}: longest cached prefix (whole pages, at most |tokens|-1 tokens so
///    the last prompt token is always computed), loading L2/L3 hits back into device pages
///    (the reply waits for the copies), + fresh pages for the rest -> AcquireReply.
///  - call Alloc{count} -> AllocReply (evicts unreferenced cached pages if needed; under
///    write_back the reply waits for the victims' copies).
///  - send Free{pages}, Insert{tokens, pages} (no reply; Insert may start backups).
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <memory>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/cache_config.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

struct cache_tier_options {
  int32_t n_pages = 0;
  bool prefix_cache = true;
  int32_t mailbox_bound = 1024;
  cache_config cache;        ///< tiers and write policy (validated by the caller)
  kv_layout layout;          ///< the worker's page layout (names disk files; its page size is the tier's)
  int32_t host_pages = 0;    ///< L2 pages of pool 0 (the worker allocates the same number)
  /// L2 pages of pools 1.. (each pool has its own host allocator); empty = host_pages each.
  std::vector<int32_t> extra_host_pages;
  int64_t disk_pages = 0;    ///< L3 bound in files; 0 = no disk tier
  int32_t max_background_copies = 8;  ///< backup batches in flight before backups are skipped (limits.cache_max_background_copies)
  /// The KV layout set (kernels/model/kv_pools.h); empty or one pool = `layout`'s one pool.
  /// Several pools: `n_pages` is pool 0's, `extra_pages` the others' (in order); every pool has
  /// host pages of its own; a disk entry has a file per pool of its block.
  kv_pools_layout pools;
  std::vector<int32_t> extra_pages;
  /// Tokens a prefill step computes at most (limits.prefill_chunk_tokens): an acquisition gets
  /// a window pool's pages for the blocks one step reads and writes, not for the whole prompt.
  int32_t chunk_tokens = 256;
};

/// `worker` runs the page copies (may be empty when host_pages == 0 and disk_pages == 0).
/// Throws tandem::error if the disk directory cannot be used.
bounded_actor spawn_cache_tier(caf::actor_system& sys, const cache_tier_options& opt, bounded_actor worker,
                               std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
