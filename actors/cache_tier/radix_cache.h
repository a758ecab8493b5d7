#pragma once
/// Bookkeeping of the hierarchical prefix cache (HiCache-style): a radix tree whose edges are
/// full pages of tokens; each node may hold its chunk's KV in a device page (L1), a host page
/// (L2), and, keyed by the chain hash of its prefix, a file of the disk tier (L3, an index
/// here; files outlive the tree and the process). The class decides and records everything
/// (matches, allocations, LRU evictions per tier, write policy); the page data moves only
/// through the `copy_op`s it returns, which the cache tier actor has the worker run in order.
/// Because the worker runs copies and forward passes in its mailbox order, every decision can
/// be recorded when it is made: an op that reads a page always runs before a later op or
/// forward that overwrites it.
///
/// Invariants: every non-root node holds a device or a host page; device pages form a
/// prefix-closed subtree (a node with a device page has a parent with one), so a match is
/// device* host* then disk*. The cache holds one reference per device page of a node; a page
/// a request uses has refcount > 1 and is pinned. Host pages have refcount 1 (cache) + 1 per
/// pending load that reads them.
///
/// Layouts of several pools (kernels/model/kv_pools.h; pool 0 is a full-context pool): a node
/// holds pool 0's page as above and, per other pool, a device page or none. A window pool's
/// page is dropped once no sequence's window reads the block (a sequence releases it; the cache
/// may evict it alone), so a node may lack it: a match is only as long as `usable_prefix` allows
/// (the blocks the next token's window reads must be there, in some tier), never longer. Each
/// pool has its own host allocator (the host budget is split across the pools): a node with a
/// host page of pool 0 may hold one of another pool too (`xhost`), never without pool 0's; a
/// window pool's host pages are evicted alone (LRU) when that pool's host pages run out. The
/// disk tier has one file per pool and block.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "actors/cache_tier/page_allocator.h"
#include "actors/common/cache_config.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

/// One page copy for the worker (schema CacheOp).
struct copy_op {
  enum kind_t : uint8_t { device_to_host, host_to_device, host_to_disk, disk_to_host, drop_disk, device_to_device };
  kind_t kind = device_to_host;
  int32_t device = -1;
  int32_t device_to = -1;  ///< device_to_device (a fork's copy-on-write): the destination
  int32_t host = -1;
  uint64_t hash = 0, parent = 0;
  std::vector<int32_t> tokens;  ///< the page's tokens (disk ops)
  int32_t pool = 0;             ///< the pool of the layout set the pages belong to
};

class radix_cache {
 public:
  struct options {
    int32_t page_size = 16;
    cache_write_policy policy = cache_write_policy::write_through_selective;
    int32_t write_through_threshold = 2;
    int32_t min_load_back_tokens = 0;  ///< 0 = page_size
    int64_t disk_pages = 0;            ///< L3 bound in files; 0 = no disk tier
    /// The pools of the layout set (empty = one pool); pool 0 must be a full-context pool.
    kv_pools_layout pools;
  };
  /// `host` may be null (no L2). One pool.
  radix_cache(page_allocator& dev, page_allocator* host, const options& opt);
  /// One device allocator per pool of opt.pools (dev[0] = pool 0's); `host` may be null (no L2)
  /// or one allocator whose page ids every pool draws from. Throws tandem::error if they do not
  /// match the set or pool 0 is a window pool.
  radix_cache(std::vector<page_allocator*> dev, page_allocator* host, const options& opt);
  /// One device and one host allocator per pool (`host` empty = no L2): each pool's host pages
  /// are its own share of the host budget.
  radix_cache(std::vector<page_allocator*> dev, std::vector<page_allocator*> host, const options& opt);
  ~radix_cache();

  /// A disk-tier page being loaded for a match; attached to the tree by finish_disk_loads.
  struct disk_load {
    uint64_t hash = 0, parent = 0;
    std::vector<int32_t> tokens;
    int32_t host = -1, device = -1;
    size_t op_index = 0;  ///< index of its disk_to_host op in the batch
    uint32_t mask = 0;    ///< other pools read from disk (bit p-1) into the host slot
    std::vector<int32_t> xdevice;  ///< per other pool: the device page loaded (-1 = none)
    std::vector<int32_t> xhost;    ///< per other pool: the host page read into (-1 = none)
    std::vector<size_t> xop;       ///< per other pool: its disk_to_host op (when in mask)
  };
  struct match_result {
    /// Device pages covering the usable prefix, in order; each carries one reference for the
    /// caller. The first `device_tokens / page_size` were already there, the rest are
    /// load-back targets filled by `ops`.
    std::vector<int32_t> pages;
    int32_t tokens = 0;         ///< usable prefix (pages.size() * page_size)
    int32_t device_tokens = 0;  ///< of which L1 hits
    int32_t host_tokens = 0;    ///< L2 hits loaded back
    int32_t disk_tokens = 0;    ///< L3 hits loaded back (through L2)
    int32_t skipped_tokens = 0; ///< L2/L3 hits shorter than min_load_back_tokens, recomputed
    std::vector<disk_load> disk;
    std::vector<int32_t> pinned_host;  ///< host pages read by the ops (unpin after the batch)
    std::vector<std::pair<int32_t, int32_t>> pinned_xhost;  ///< (pool, host page) of pools 1..
    std::vector<uint64_t> pinned_disk;
    /// The path node the disk loads hang below (nullptr = the root).
    const void* attach = nullptr;
    /// Per other pool (index p-1), one entry per page of `pages`: the pool's device page of
    /// that block with a reference for the caller, or -1 where no window reads it (dead).
    std::vector<std::vector<int32_t>> xpages;
  };
  /// Longest cached prefix of `tokens` of at most `max_tokens` tokens (whole pages), with the
  /// device pages for its L2/L3 part allocated (evicting as needed) and the copies appended to
  /// `ops`. Touches the path (LRU, hit counts; may queue selective backups into `ops`).
  /// If device pages for the load-back cannot be found, the match shrinks to what fits.
  match_result match(std::span<const int32_t> tokens, int32_t max_tokens, std::vector<copy_op>& ops);
  /// After the batch of a match ran: attaches the disk loads that succeeded (in order, up to
  /// the first failure: `failed_ops` are op indices) and unpins. Returns the tokens of the
  /// usable prefix (m.tokens minus the failed disk tail); the device pages of a failed tail
  /// stay the caller's, as fresh pages to recompute into. With several pools a failed disk
  /// read gives -1: every page of the match stays the caller's to free (retry the lookup).
  int32_t finish_match(match_result& m, std::span<const uint32_t> failed_ops);

  /// `n` device pages for a request (refcount 1), evicting unpinned cached pages (LRU) if the
  /// free list is short; write-back copies of the victims go to `ops` (their data is copied
  /// before anything the caller runs on those pages). nullopt if not enough can be freed.
  std::optional<std::vector<int32_t>> alloc_device(int32_t n, std::vector<copy_op>& ops);
  /// Like alloc_device for pool `p` of the set (0 = alloc_device); other pools evict the pages
  /// of cached blocks no request holds (LRU), without their nodes.
  std::optional<std::vector<int32_t>> alloc_pool(size_t p, int32_t n, std::vector<copy_op>& ops);
  size_t n_pools() const { return dev_x_.size() + 1; }

  /// Caches the full pages of `tokens` (pages[i] holds tokens [i*ps, (i+1)*ps)). Chunks already
  /// cached keep their device page (a host-only node takes the request's page). Write-through
  /// backups go to `ops` unless !allow_backup (the copy queue is full: counted as skipped).
  /// Returns the number of nodes newly cached.
  /// `xpages[p-1]`: pool p's pages by block (-1 = none; a node without one takes it).
  int32_t insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, std::vector<copy_op>& ops,
                 bool allow_backup = true, std::span<const std::vector<int32_t>> xpages = {});

  /// Ops decided outside a batch (drops of bad disk files found by finish_match); the actor
  /// sends them with the next batch.
  std::vector<copy_op> take_pending_ops();
  int64_t disk_read_failures() const { return disk_read_failures_; }

  /// Forgets a disk entry whose file failed to read (bad checksum, missing); the file is
  /// dropped by an op appended to `ops`.
  void disk_read_failed(uint64_t hash, std::vector<copy_op>& ops);

  /// Drops every unpinned device page (tests, shutdown): nodes with a host copy stay.
  void clear_device();
  /// Drops every unpinned page of every tier held in memory (tests): the tree empties except
  /// pinned paths; disk files stay.
  void clear();

  int32_t cached_pages() const { return n_device_nodes_; }  ///< nodes with a device page
  int32_t host_cached_pages() const { return n_host_nodes_; }
  /// Host pages of pool p holding cached blocks (p = 0: host_cached_pages()).
  int32_t host_cached_pool_pages(size_t p) const;
  int64_t disk_pages() const { return static_cast<int64_t>(disk_.size()); }
  int64_t disk_bound() const { return opt_.disk_pages; }
  int32_t nodes() const { return n_nodes_; }
  /// Cached device pages no request references, by a walk of the tree (what the allocator's
  /// O(1) n_evictable() must equal; the tests compare them).
  int32_t evictable_pages() const;
  int64_t evictions(int tier) const { return evictions_[tier]; }  ///< 0 device, 1 host, 2 disk
  int64_t backup_tokens(int tier) const { return backup_tokens_[tier]; }  ///< 1 host, 2 disk
  int64_t backups_skipped() const { return backups_skipped_; }
  /// Tokens of the disk tier loaded on restart scan (index entries).
  void add_disk_entry(uint64_t hash);
  /// A file of pool p > 0 found on restart for a block whose pool-0 entry exists (else ignored).
  void add_disk_pool(uint64_t hash, size_t p);
  /// Pages of pool p > 0 cached on the device (nodes holding one).
  int32_t cached_pool_pages(size_t p) const;

 private:
  struct node {
    int32_t dev = -1, host = -1;
    std::vector<int32_t> xdev;   ///< per other pool: its device page (-1 = none)
    std::vector<int32_t> xhost;  ///< per other pool: its host page (-1 = none; only with `host`)
    uint64_t hash = 0;
    uint64_t last_use = 0;
    int32_t hits = 0;
    node* parent = nullptr;
    std::vector<int32_t> key;
    std::map<std::vector<int32_t>, std::unique_ptr<node>> children;
  };
  struct disk_entry {
    uint64_t last_use = 0;
    int32_t pins = 0;
    uint32_t mask = 0;  ///< other pools with a file (bit p-1)
  };
  bool host_tier() const { return host_ != nullptr; }
  /// Nodes of the tree for which `pred` holds (a walk: for metrics, not hot paths).
  int32_t count_nodes(const std::function<bool(const node*)>& pred) const;
  bool disk_tier() const { return opt_.disk_pages > 0; }
  bool device_child(const node* n) const;
  void walk(const node* n, std::vector<const node*>& out) const;
  /// One device page: from the free list or by evicting an LRU victim.
  std::optional<int32_t> take_device(std::vector<copy_op>& ops);
  std::optional<int32_t> take_host(std::vector<copy_op>& ops);
  bool evict_device(std::vector<copy_op>& ops);
  bool evict_host(std::vector<copy_op>& ops);
  /// One host page of pool p > 0: from its free list or by dropping a cached block's host page
  /// of that pool alone (LRU, not pinned by a load).
  std::optional<int32_t> take_xhost(size_t p);
  bool evict_xhost(size_t p);
  /// Releases n's host pages of the other pools.
  void drop_xhost(node* n);
  /// True when none of n's host pages (any pool) is pinned by a pending load.
  bool host_unpinned(const node* n) const;
  /// The disk mask (bit p-1) of the other pools whose host page n holds.
  uint32_t xhost_mask(const node* n) const;
  bool evict_disk(std::vector<copy_op>& ops);
  /// Adds a disk entry for `n` (evicting); false if the disk tier is full of pinned entries.
  bool put_disk(node* n, std::vector<copy_op>& ops);
  /// Backs `n`'s device page up to a host page (and to disk under write_through).
  void backup(node* n, std::vector<copy_op>& ops);
  void remove_leaf(node* n);
  /// Copies n's pool-0 device page into the new host slot `host` (which n then holds).
  void copy_to_host(node* n, int32_t host, std::vector<copy_op>& ops);
  /// The cached path of `tokens` (whole pages up to `limit` tokens) and, with a disk tier, the
  /// disk entries that continue it (by chain hash).
  void walk_path(std::span<const int32_t> tokens, size_t limit, std::vector<node*>& path, std::vector<disk_load>& dk);
  /// Releases n's pages of the other pools on the device (eviction of its pool-0 page).
  void drop_xdev(node* n);
  /// Copies n's other pools' device pages into host pages of their pools where it lacks them.
  void backup_xdev(node* n, std::vector<copy_op>& ops);
  /// Frees one page of pool p > 0 by dropping a cached block's page (LRU); false if none.
  bool evict_pool(size_t p, std::vector<copy_op>& ops);
  std::unique_ptr<node> new_node() const;
  bool multi() const { return !dev_x_.empty(); }
  /// match() for layouts of several pools (radix_match_pools.cpp).
  match_result match_pools(std::span<const int32_t> tokens, int32_t max_tokens, std::vector<copy_op>& ops);
  /// The tree takes (lets go of) its own reference to device page `page`; the allocator is
  /// told it is (no longer) a cached page, which its O(1) evictable count follows.
  void hold_device(int32_t page) {
    dev_.ref(page);
    dev_.set_cached(page, true);
  }
  void release_device(int32_t page) {
    dev_.set_cached(page, false);
    dev_.unref(page);
  }
  /// hold_device / release_device for a page of pool p > 0.
  void hold_pool(size_t p, int32_t page) {
    dev_x_[p - 1]->ref(page);
    dev_x_[p - 1]->set_cached(page, true);
  }
  void release_pool(size_t p, int32_t page) {
    dev_x_[p - 1]->set_cached(page, false);
    dev_x_[p - 1]->unref(page);
  }
  void touch_disk(uint64_t hash) { disk_[hash].last_use = ++clock_; }

  page_allocator& dev_;
  std::vector<page_allocator*> dev_x_;  ///< pools 1..
  page_allocator* host_;
  std::vector<page_allocator*> host_x_;  ///< host allocators of pools 1.. (with host_)
  options opt_;
  node root_;
  uint64_t clock_ = 0;
  int32_t n_nodes_ = 0, n_device_nodes_ = 0, n_host_nodes_ = 0;
  std::unordered_map<uint64_t, disk_entry> disk_;
  int64_t evictions_[3] = {0, 0, 0};
  int64_t backup_tokens_[3] = {0, 0, 0};
  int64_t backups_skipped_ = 0;
  int64_t disk_read_failures_ = 0;
  std::vector<copy_op> pending_drops_;
};

}  // namespace tandem
