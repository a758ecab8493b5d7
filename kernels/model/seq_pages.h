#pragma once
/// A sequence's KV page tables over a layout set (pool_pages: a table per pool indexed by
/// block; a window pool holds -1 for blocks no step reads again): pure functions the prefill
/// and decode schedulers keep their sequences' pages with.
#include <cstdint>
#include <vector>

#include "kernels/model/kv_pools.h"

namespace tandem {

/// Blocks the tables cover (pool 0's length; 0 when none).
inline size_t blocks_of(const pool_pages& t) { return t.empty() ? 0 : t[0].size(); }

/// True if any table holds a page.
bool holds_pages(const pool_pages& t);

/// `t` cut to its first `blocks` blocks in every pool (a forward step's tables).
pool_pages first_blocks(const pool_pages& t, size_t blocks);

/// Window pools: moves the pages of every block a step starting at `next_pos` does not read
/// (before kv_pool_spec::first_live_block) into `freed` (same shape as `t`) and sets them -1.
/// Full pools are untouched. Returns the number of pages moved.
int32_t release_dead_pages(const kv_pools_layout& set, int64_t next_pos, pool_pages& t, pool_pages& freed);

/// Before a prefill step over [start, end): in each window pool, the pages of blocks the step
/// does not read move to the blocks it reads or writes that lack one, in block order, if the
/// sequence owns them alone (blocks >= owned_from, computed here); pages of earlier blocks
/// (shared with the prefix cache) go to `freed`. Throws tandem::error (failed) naming the pool
/// when a block of the step is left without a page (the acquisition gave too few).
void rotate_window_pages(const kv_pools_layout& set, int64_t start, int64_t end, int32_t owned_from, int32_t page_size,
                         pool_pages& t, pool_pages& freed);

/// Pages each pool needs for a step ending at `end` (exclusive): blocks(end) - table length.
std::vector<int32_t> pages_lacking(const pool_pages& t, int64_t end, int32_t page_size);

/// Pages each pool holds (-1 entries left out).
std::vector<int32_t> pages_held(const pool_pages& t);

}  // namespace tandem
