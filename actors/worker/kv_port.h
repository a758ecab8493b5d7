#pragma once
/// The worker's side of cross-node KV page transfers, as an interface so the actors do not
/// depend on the transport library: `transport/ucx/kv_port_ucx.h` implements it over the
/// UCX kv_engine. The port owns the worker's KV pool (in memory the transport registered,
/// so a peer writes it directly) and is used from the worker's thread only.
#include <caf/atom.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/common/metrics.h"
#include "kernels/model/kv_pool.h"

namespace spdlog {
class logger;
}

namespace tandem {

/// Tags KV transfer orders to the worker and its kvDone answers. Not gated: an order follows a
/// request the scheduler already holds pages for, so they are bounded by the live requests.
using kv_atom = caf::atom_constant<caf::atom("kv")>;

/// Hands the pages of a transfer back to the worker's owner, exactly once per transfer.
/// `delivered`: destination: the KV is in the pages; source: it was written out. `why`
/// names what failed otherwise.
using kv_release_fn = std::function<void(uint64_t transfer_id, bool delivered, const std::vector<int32_t>& pages,
                                         const std::string& why)>;

class kv_port {
 public:
  virtual ~kv_port() = default;
  /// The worker's device KV pool (allocated and registered by the port).
  virtual kv_pool& pool() = 0;
  /// Source: write `pages` (which hold their final KV) to the destination node's pages once
  /// it sends their descriptors. Throws tandem::error when it cannot start (the pages stay the caller's).
  virtual void send(uint64_t transfer_id, const std::string& destination_node, std::vector<int32_t> pages) = 0;
  /// Destination: receive the KV of `transfer_id` from `source_node` into `pages`.
  /// Throws tandem::error when it cannot start (the pages stay the caller's).
  virtual void receive(uint64_t transfer_id, const std::string& source_node, std::vector<int32_t> pages) = 0;
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

/// Builds the port for a pool of `n_pages` pages of `layout`; called once on the worker's thread.
/// `log` is the worker's logger (what the transport uses, refused peers).
using kv_port_factory = std::function<std::unique_ptr<kv_port>(const kv_layout& layout, int32_t n_pages,
                                                               kv_release_fn release,
                                                               std::shared_ptr<spdlog::logger> log)>;

}  // namespace tandem
