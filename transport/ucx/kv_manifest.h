#pragma once
/// The per-pool manifest of a KV transfer: after its puts are flushed, the source tells the
/// destination, for every pool of the layout set, how many pages it wrote and a checksum of
/// their bytes (XXH3-64, in page-list order); the destination recomputes both over the pages
/// it received and reports the transfer delivered only if every pool matches. A pool whose
/// puts never happened (count) or whose bytes differ (checksum) fails the transfer naming the
/// pool, so a sequence never decodes on stale KV.
///
/// Cost: one pass over the transferred bytes on each side (XXH3 runs at memory bandwidth;
/// docs/kv_transfer.md has the measured rate), on the worker's thread; the source hashes
/// while its puts are in flight.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/kv_pools.h"
#include "transport/ucx/transfer_state.h"

namespace tandem::ucx {

/// One pool's entry: pages written and XXH3-64 of their bytes in list order.
struct pool_digest {
  uint32_t pages = 0;
  uint64_t hash = 0;
  bool operator==(const pool_digest&) const = default;
};
using kv_manifest = std::vector<pool_digest>;

/// XXH3-64 over the bytes of `pool`'s pages `ids` in order, -1 entries skipped; `pages`
/// counts the others. Ids must be valid pages of the pool.
pool_digest digest_pages(const kv_pool& pool, std::span<const int32_t> ids);

/// Streaming form of digest_pages, for a source that hashes the pages it actually put.
class digest_builder {
 public:
  digest_builder();
  ~digest_builder();
  digest_builder(const digest_builder&) = delete;
  digest_builder& operator=(const digest_builder&) = delete;
  void add(const uint8_t* bytes, size_t n);
  void add_page() { ++pages_; }
  pool_digest finish() const;

 private:
  void* state_;  ///< XXH3_state_t
  uint32_t pages_ = 0;
};

/// A notification: transfer id, kind and (for `done`) the source's manifest.
struct kv_notify {
  transfer_id transfer = 0;
  notify_kind kind = notify_kind::started;
  kv_manifest manifest;  ///< `done` only
};

/// Wire form: id (8 bytes), kind (1); `done` adds the pool count (1) and per pool its page
/// count (4) and hash (8).
std::vector<uint8_t> encode_notify(const kv_notify& n);
/// Throws tandem::error on anything but exactly one notification (untrusted input).
kv_notify decode_notify(const uint8_t* data, size_t size);

/// Empty if `source` (the source's manifest) matches `received` (computed here over the
/// destination's pages) for every pool of `set`; otherwise the first difference naming the
/// pool, with `reason` manifest (a pool missing or its page count differs) or checksum.
std::string check_manifest(const kv_manifest& source, const kv_manifest& received, const kv_pools_layout& set,
                           fail_reason& reason);

}  // namespace tandem::ucx
