#pragma once
/// What two nodes check before exchanging KV pages: the same model, dtype and layout set
/// (every pool's page shape, layers and window).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "actors/common/pool_pages_wire.h"
#include "kernels/model/kv_pools.h"

namespace tandem::ucx {

/// One side's view of the KV layout it serves.
struct kv_identity {
  std::string node;          ///< node name, for messages and peer lookup
  std::string model;         ///< model name (e.g. the GGUF general.name)
  std::string dtype = "f32"; ///< element type of the pages: to_string(layout.dtype)
  kv_layout layout;          ///< pool 0's page
  /// Every pool of the layout set, pool 0 (whose page is `layout`) first; empty = the single
  /// full pool of `layout`.
  kv_pools_layout pools = {};
  /// `pools`, or the single full pool of `layout` when it is empty.
  kv_pools_layout set() const { return pools.pools.empty() ? kv_pools_layout::single(layout) : pools; }
  /// "model=r15m dtype=f32 layers=... page_size=16" (+ " pools: full: ...; window: ...")
  std::string describe() const;
};

/// Where a peer writes one pool (pool 0's region is the hello's own fields).
struct kv_region {
  uint64_t base = 0;          ///< remote virtual address of page 0
  int32_t n_pages = 0;
  std::vector<uint8_t> rkey;  ///< packed remote key of the pool's registration
};

/// The handshake message: the identity plus where and how to write into the pool.
struct kv_hello {
  kv_identity id;
  uint64_t pool_base = 0;   ///< remote virtual address of page 0
  int32_t n_pages = 0;      ///< pages in the remote pool
  std::vector<uint8_t> rkey;  ///< packed remote key of the pool registration
  /// The worker address: the peer dials it for a data endpoint with UCX's full transport
  /// selection (shared memory on one host); the sockaddr endpoint only gets the CM's tcp.
  std::vector<uint8_t> worker_address;
  std::vector<kv_region> extra_pools;  ///< pools 1.. of the layout set, one region each
};

std::vector<uint8_t> encode_hello(const kv_hello& h);
/// Throws tandem::error if the bytes are not a hello of this protocol version, its layout set
/// is invalid (read_kv_pools_layout) or it does not offer one region of at least one page per pool.
kv_hello decode_hello(const uint8_t* data, size_t size);

/// The descriptor message: destination -> source, where the pages of a transfer go.
struct kv_descriptors {
  uint64_t transfer = 0;
  pool_pages pages;  ///< destination page ids per pool, one per source page (-1: a released block)
};

std::vector<uint8_t> encode_descriptors(const kv_descriptors& d);
/// Throws tandem::error if the bytes are not exactly one descriptor message of 1 to
/// max_kv_pools pools.
kv_descriptors decode_descriptors(const uint8_t* data, size_t size);

/// Empty if every id of `pages` is a page of a pool of `n_pages` pages; otherwise a message
/// naming the first bad id. A peer's descriptors and hello are untrusted input.
std::string check_page_ids(const std::vector<int32_t>& pages, int32_t n_pages);

/// Empty if `local` and `remote` can exchange pages; otherwise a message that names both
/// sides' values of every field that differs (per pool for a layout set of several pools,
/// "pool 1 (window): window_tokens 32 here, 64 on decode-1") and the fix.
std::string check_compatible(const kv_identity& local, const kv_identity& remote);

}  // namespace tandem::ucx
