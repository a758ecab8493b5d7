#pragma once
/// The worker's side of cross-node KV page transfers, as an interface so the actors do not
/// depend on the transport library: `transport/ucx/kv_port_ucx.h` implements it over the
/// UCX kv_engine. The port owns the worker's KV pools, one per pool of the model's layout set
/// (in memory the transport registered, so a peer writes it directly), and is used from the
/// worker's thread only.
///
/// Pages travel per pool (pool_pages, pool 0 first, indexed by block). The source's and the
/// destination's lists of a pool have the same length; -1 entries (window blocks already
/// released) sit at the same indices on both sides and move nothing; a transfer whose masks
/// differ fails naming the pool.
#include <caf/atom.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "actors/common/metrics.h"
#include "actors/common/pool_pages_wire.h"
#include "actors/common/wire.h"  // kv_atom
#include "kernels/model/kv_pools.h"

namespace spdlog {
class logger;
}

namespace tandem {

/// Hands the pages of a transfer back to the worker's owner, exactly once per transfer.
/// `delivered`: destination: the KV is in the pages; source: it was written out. `why`
/// names what failed otherwise.
using kv_release_fn =
    std::function<void(uint64_t transfer_id, bool delivered, const pool_pages& pages, const std::string& why)>;

class kv_port {
 public:
  virtual ~kv_port() = default;
  /// The worker's device KV pools (allocated and registered by the port): a one-pool set for
  /// every model without sliding-window layers.
  virtual kv_pools& pools() = 0;
  /// Source: write `pages` of every pool (which hold their final KV) to the destination
  /// node's pages once it sends their descriptors; then a per-pool manifest (page counts and
  /// checksums) the destination verifies. Throws tandem::error when it cannot start (the
  /// pages stay the caller's).
  virtual void send(uint64_t transfer_id, const std::string& destination_node, pool_pages pages) = 0;
  /// Destination: receive the KV of `transfer_id` from `source_node` into `pages` (every
  /// pool); delivered only once every pool's count and checksum matched the source's.
  /// Throws tandem::error when it cannot start (the pages stay the caller's).
  virtual void receive(uint64_t transfer_id, const std::string& source_node, pool_pages pages) = 0;
  /// Give up on a transfer (request aborted); its pages come back through release
  /// (possibly later: after quarantine). Unknown ids are ignored.
  virtual void abort(uint64_t transfer_id) = 0;
  /// Progress the transport, deliver completions, check deadlines; true if anything happened.
  virtual bool progress() = 0;
  /// Transfers in flight (live, quarantined or waiting for their peer): progress often.
  virtual bool busy() const = 0;
  /// tandem_kv_transfer_* metrics.
  virtual std::vector<metric_sample> metrics() const = 0;
};

/// Builds the port for the pools of `set`, `n_pages[p]` pages for pool p; called once on the
/// worker's thread. `log` is the worker's logger (what the transport uses, refused peers).
using kv_port_factory =
    std::function<std::unique_ptr<kv_port>(const kv_pools_layout& set, std::span<const int32_t> n_pages,
                                           kv_release_fn release, std::shared_ptr<spdlog::logger> log)>;

}  // namespace tandem
