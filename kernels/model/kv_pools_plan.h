#pragma once
/// Decisions over a KV layout set that the cache tier makes: how much of a cached prefix a
/// sequence can resume from when some pools keep only a window. (Host and disk tiers hold a
/// block's page of every pool, so their budgets divide by kv_pools_layout::block_bytes().)
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

}  // namespace tandem
