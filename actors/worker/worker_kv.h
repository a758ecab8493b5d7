#pragma once
/// The worker's cross-node KV handoffs: its transport port, the handoff table
/// (actors/worker/kv_handoff.h) and what happens when a transfer ends. Plain logic over the
/// `kv_port` interface with two outputs, so the worker actor is a thin shell (it parses the
/// orders and binds the outputs to its typed handles) and the tests drive it with a fake port.
///
/// - send (the prefill's handoff order, "hand these pages of request R to node X as transfer
///   T"): the pages are the worker's from then on. Whenever the send ends (written out,
///   failed, aborted, refused by the bound or by the port) they go back to the cache tier
///   (`free_pages`), exactly once; nothing goes back to the prefill.
/// - receive (the decode scheduler's order, into pages it allocated): its end is answered
///   with `receive_done` (arrived, or failed with why), exactly once, refused ones included;
///   the decode scheduler keeps the recompute-or-fail decision and its pages.
/// - abort by request id (and transfer id, 0 = the request's newest): idempotent; unknown ids
///   and transfers that already ended are ignored.
#include <spdlog/logger.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/common/metrics.h"
#include "actors/worker/kv_handoff.h"
#include "actors/worker/kv_port.h"

namespace tandem {

/// One transfer order as the worker takes it (schema::KvTransferOrder).
struct kv_order {
  uint64_t transfer_id = 0;
  std::string id;    ///< the request
  std::string peer;  ///< the other node
  pool_pages pages;  ///< send: the source pages; receive: the destination pages
};

/// Where the worker's transfer ends go (the shell binds them to its cache tier and decode handles).
struct kv_handoff_outputs {
  /// An ended send's source pages, back to the cache tier (empties `pages`).
  std::function<void(const std::string& id, pool_pages& pages)> free_pages;
  /// A receive ended: the KV arrived in `pages` (delivered) or not, and why.
  std::function<void(uint64_t tid, const std::string& id, bool delivered, const pool_pages& pages,
                     const std::string& why)>
      receive_done;
};

class worker_kv {
 public:
  /// `max_live`: limits.kv_transfer_max_live, per side.
  worker_kv(size_t max_live, kv_handoff_outputs out, std::shared_ptr<spdlog::logger> log);
  worker_kv(const worker_kv&) = delete;
  worker_kv& operator=(const worker_kv&) = delete;

  /// Builds the port (it allocates the KV pools) with this object as its release callback.
  void open(const kv_port_factory& factory, const kv_pools_layout& set, std::span<const int32_t> n_pages);
  kv_port& port() { return *port_; }

  void send(kv_order o);
  void receive(kv_order o);
  /// Aborts the live transfers of request `id` (only `tid` when non-zero), on either side.
  void abort(const std::string& id, uint64_t tid);

  const kv_handoff_table& table() const { return table_; }
  /// worker_kv_* and worker_transfer* metrics, the port's tandem_kv_transfer_* ones and the
  /// refusals (rejections_total{actor="worker"}).
  std::vector<metric_sample> metrics() const;

 private:
  /// An order of either side: into the table (or refused) and to the port (or failed).
  void start(kv_side side, kv_order o);
  /// The port handed a transfer's pages back (kv_release_fn).
  void on_release(uint64_t tid, bool delivered, const pool_pages& pages, const std::string& why);
  /// The end of a transfer the table held (or refused: `side` and `id` from the order).
  void ended(kv_side side, uint64_t tid, const std::string& id, bool delivered, pool_pages pages,
             const std::string& why);

  kv_handoff_table table_;
  kv_handoff_outputs out_;
  std::shared_ptr<spdlog::logger> log_;
  std::unique_ptr<kv_port> port_;
  int64_t orders_ = 0, order_failures_ = 0;
};

}  // namespace tandem
