#pragma once
/// Copy-on-write forks of a sequence's KV pages (decode, n > 1; decode_fork.cpp). A fork
/// recomputes the last prompt position and writes from there on: the blocks before the one
/// holding that position are shared (every fork takes one reference on each of their pages,
/// so each page returns to its pool exactly once, when its last holder frees it), that block
/// is copied per fork (its earlier positions hold KV the fork reads), later blocks are not the
/// fork's. Pure functions; the cache tier takes the references and makes the copies.
#include <cstdint>
#include <span>
#include <vector>

#include "actors/common/pool_pages_wire.h"

namespace tandem {

struct fork_plan {
  int64_t copy_block = 0;          ///< the block each fork gets its own copy of
  pool_pages shared;               ///< per pool: the pages one fork references (-1s left out)
  std::vector<int32_t> copy_from;  ///< per pool: the page of copy_block (-1: the pool has none there)
};

/// The plan for forks of a sequence with tables `t` that write from position `first_write` on.
fork_plan plan_fork(const pool_pages& t, int64_t first_write, int32_t page_size);

/// One fork's tables: `t`'s blocks before copy_block and, at copy_block, `copies[p]` per pool.
pool_pages fork_tables(const pool_pages& t, const fork_plan& plan, std::span<const int32_t> copies);

/// The cache tier's request for `forks` forks: every shared page `forks` times, and per pool
/// the page to copy once per fork (the k-th page allocated in a pool is fork k's copy).
struct fork_request {
  pool_pages holds;
  pool_pages copy_from;
  std::vector<int32_t> counts;  ///< pages to allocate per pool
};
fork_request make_fork_request(const fork_plan& plan, int32_t forks);

/// Fork k's copies (one per pool, -1 where the pool copies nothing) out of the allocation
/// `got` for make_fork_request(plan, forks).
std::vector<int32_t> fork_copies(const fork_plan& plan, const pool_pages& got, int32_t k);

}  // namespace tandem
