#pragma once
/// Decisions over a KV layout set that the cache tier and the sizing code make: how much of a
/// cached prefix a sequence can resume from when some pools keep only a window, and how a byte
/// budget (host tier, disk tier) splits across the pools.
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/kv_pools.h"

namespace tandem {

/// The longest prefix of at most `matched` tokens (whole pages) a sequence can resume from:
/// with the next token at P, every full pool's blocks [0, P/ps) and every window pool's blocks
/// [first_live_block(P), P/ps) must be present (present(pool, block)); the longest P for which
/// they are, 0 if none. A prefix whose window state was released is shortened, never used.
int64_t usable_prefix(const kv_pools_layout& set, int64_t matched,
                      const std::function<bool(size_t pool, int64_t block)>& present);

/// A byte budget split across the pools of a set.
struct pool_split {
  std::vector<int64_t> pages;  ///< per pool, whole pages
  uint64_t min_bytes = 0;      ///< the smallest budget that gives every pool a page
  std::string problem;         ///< empty = every pool got at least one page
  bool ok() const { return problem.empty(); }
};

/// Splits `bytes` across the pools of `set` in proportion to their device pools' bytes
/// (device_pages[p] x page bytes), whole pages each. A pool that would get no page makes
/// `problem` name it, `what` (e.g. "cache.host_size_gb = 0.001") and the minimum size.
pool_split split_pool_bytes(const kv_pools_layout& set, std::span<const int64_t> device_pages, uint64_t bytes,
                            const std::string& what);

}  // namespace tandem
