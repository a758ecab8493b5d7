#pragma once
/// A KV layout as a set of pools (vLLM's hybrid allocator idea). Each pool holds some of the
/// model's layers with its own page geometry; all pools share the page size, so position `pos`
/// of a sequence lives in block pos / page_size of every pool. A full pool keeps every block of
/// the context; a window pool (sliding-window layers) needs only the blocks still inside the
/// window, so a sequence holds at most ceil(window / page_size) + 1 of its pages.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/kv_pool.h"

namespace tandem {

/// Pages per pool, pool 0 first, indexed by block; window pools hold -1 for released blocks.
using pool_pages = std::vector<std::vector<int32_t>>;

/// One pool of a layout set.
struct kv_pool_spec {
  std::string name = "full";    ///< "full" / "window": metric label, config and error text
  kv_layout page;               ///< page geometry; page.n_layers == layers.size()
  int32_t window_tokens = 0;    ///< 0: full context; > 0: a token at p reads only (p - window, p]
  std::vector<int32_t> layers;  ///< the model layers this pool holds, ascending
  bool operator==(const kv_pool_spec&) const = default;

  /// First block a step whose first new token is at `pos` reads (0 for a full pool).
  int32_t first_live_block(int64_t pos) const;
  /// Most pages of this pool one sequence of any length holds between steps of at most
  /// `chunk` new tokens: every block for a full pool (blocks(tokens)), the ring for a window.
  int32_t max_pages(int64_t tokens, int64_t chunk) const;
  /// "window: layers=[0,2] kv_heads=2 head_dim=16 page_size=16 window=32"
  std::string describe() const;
};

/// The pools of a model's KV cache, pool 0 first (the full pool when there is one).
struct kv_pools_layout {
  std::vector<kv_pool_spec> pools;
  bool operator==(const kv_pools_layout&) const = default;

  /// The set of one full pool holding every layer of `l` (every architecture but the
  /// sliding-window ones; also what a component that is not pool-aware yet uses).
  static kv_pools_layout single(const kv_layout& l);
  int32_t page_size() const { return pools.empty() ? 0 : pools.front().page.page_size; }
  /// Bytes of one block (page_size positions) over every pool.
  size_t block_bytes() const;
  /// The index of the pool named `name`, or -1.
  int32_t find(const std::string& name) const;
  /// kv_pool_spec::max_pages of every pool.
  std::vector<int32_t> max_pages(int64_t tokens, int64_t chunk) const;
  /// Throws tandem::error(overloaded) naming the first pool whose `capacity` pages cannot hold
  /// one sequence of `tokens` positions stepped `chunk` tokens at a time (admission).
  void check_fits(std::span<const int32_t> capacity, int64_t tokens, int64_t chunk) const;
  /// Pool specs joined by "; ".
  std::string describe() const;
  /// Throws tandem::error naming the problem unless every layer 0..n_layers-1 is in exactly
  /// one pool, page sizes agree and each pool's n_layers matches its layer list.
  void check(int32_t n_layers) const;
};

/// The memory of a layout set: one kv_pool per spec, owned or borrowed.
class kv_pools {
 public:
  /// Pools of `n_pages[p]` pages each.
  kv_pools(kv_pools_layout set, std::span<const int32_t> n_pages);
  /// Borrowed pools (one per spec, layouts equal to the specs'); they must outlive this.
  kv_pools(kv_pools_layout set, std::vector<kv_pool*> pools);
  /// The single-pool set over one borrowed pool.
  explicit kv_pools(kv_pool& pool);
  kv_pools(const kv_pools&) = delete;
  kv_pools& operator=(const kv_pools&) = delete;
  const kv_pools_layout& set() const { return set_; }
  size_t size() const { return pools_.size(); }
  kv_pool& operator[](size_t p) { return *pools_[p]; }
  const kv_pool& operator[](size_t p) const { return *pools_[p]; }

 private:
  kv_pools_layout set_;
  std::vector<std::unique_ptr<kv_pool>> owned_;
  std::vector<kv_pool*> pools_;
};

/// Releases the window blocks a sequence no longer reads: with the next token at `next_pos`,
/// every page of `table` (one pool's table, indexed by block) before spec.first_live_block
/// that is not -1 is appended to `freed` and set to -1. Full pools release nothing.
void release_dead_blocks(const kv_pool_spec& spec, int64_t next_pos, std::vector<int32_t>& table,
                         std::vector<int32_t>& freed);

}  // namespace tandem
