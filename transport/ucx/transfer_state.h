#pragma once
/// Per-request KV page transfer state machine, independent of UCX so it can be driven
/// deterministically by a fake transport in tests.
///
/// Both sides keep one `transfer_table`. The destination (decode) owns the pages the KV lands
/// in; the source (prefill) owns the pages it reads from. A transfer goes
///   bootstrapping (peer connect + layout handshake)
///   -> waiting (destination: descriptors sent, waiting for the source to start writing;
///               source: waiting for the descriptors and for its pages to be ready)
///   -> transferring (puts in flight)
///   -> done | failed,
/// with a deadline on every non-terminal state. Pages are per pool of the KV layout set
/// (pool_pages); a destination verifies what landed (transfer_transport::verify_received)
/// before it reports a transfer delivered. The pages of a transfer are handed back to
/// their owner exactly once (`release_fn`), either delivered (done) or to be freed (failed).
/// A failed transfer whose pages a put may still touch (the remote may still write into the
/// destination pages, or the NIC may still read the source pages) is quarantined: its pages
/// are released only when the put is known complete (the source's final notification / the
/// put completion) or the endpoint to the peer is closed. A quarantine that outlives its
/// deadline asks the transport to close the peer, which is what finally frees the pages.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "actors/common/metrics.h"
#include "actors/common/pool_pages_wire.h"
#include "kernels/base/clock.h"

namespace tandem::ucx {

using transfer_id = uint64_t;
using peer_id = uint32_t;

enum class transfer_phase : uint8_t { bootstrapping, waiting, transferring, done, failed };
enum class transfer_role : uint8_t { source, destination };
/// What the source tells the destination (and the destination tells the source: cancel).
enum class notify_kind : uint8_t {
  started = 0,  ///< source -> destination: puts are being issued
  done = 1,     ///< source -> destination: every put landed (sent after a flush)
  failed = 2,   ///< source -> destination: no put of this transfer is in flight any more
  cancel = 3,   ///< destination -> source: stop; answer with `failed` once nothing is in flight
};

std::string_view to_string(transfer_phase p);
std::string_view to_string(notify_kind k);

/// Deadlines per state and bounds of the table.
/// The timeouts come from [transfer] timeout_ms, the bounds from limits.kv_transfer_* (cmd_serve).
struct transfer_limits {
  int64_t bootstrap_ms = 5000;
  int64_t waiting_ms = 30000;
  int64_t transferring_ms = 10000;
  int64_t quarantine_ms = 10000;
  size_t max_transfers = 1024;        ///< live transfers (not counting quarantine)
  size_t max_quarantined = 1024;      ///< quarantined transfers; beyond, the peer is closed
  size_t max_early_descriptors = 256; ///< descriptors that arrived before start_send
};

/// Why a transfer failed (metric label). manifest: a pool's page count differs from what the
/// source wrote (a pool missing); checksum: the bytes that landed differ from the source's.
enum class fail_reason : uint8_t {
  timeout_bootstrapping, timeout_waiting, timeout_transferring, aborted, peer_failed,
  peer_closed, put_failed, remote_failed, remote_cancel, bad_descriptors, manifest, checksum
};
std::string_view to_string(fail_reason r);

/// The actions the table asks of a transport. Completions come back through the table's
/// on_* methods later (from the transport's progress loop), never from inside these calls.
class transfer_transport {
 public:
  virtual ~transfer_transport() = default;
  /// Connect to `peer` and run the layout handshake: answer on_peer_ready or on_peer_failed.
  virtual void connect(peer_id peer) = 0;
  /// Destination: tell the source where the pages of `id` go.
  virtual void send_descriptors(peer_id peer, transfer_id id, const pool_pages& dst_pages) = 0;
  /// Source: write `src_pages[p][i]` into the remote `dst_pages[p][i]` of every pool p
  /// (skipping -1 entries, which sit at the same indices on both sides), flush, then answer
  /// on_put_complete(id, ok, why).
  virtual void put_pages(peer_id peer, transfer_id id, const pool_pages& src_pages, const pool_pages& dst_pages) = 0;
  /// Destination, on the source's `done`: empty if what landed in `dst_pages` is what the
  /// source wrote (its manifest); otherwise why not, with `reason` manifest or checksum.
  virtual std::string verify_received(peer_id peer, transfer_id id, const pool_pages& dst_pages,
                                      fail_reason& reason) {
    return {};
  }
  /// Either side: a small notification (best effort; may be lost when the peer is gone).
  virtual void notify(peer_id peer, transfer_id id, notify_kind kind) = 0;
  /// Close the endpoint to `peer` (aborting whatever is in flight): answer on_peer_closed.
  virtual void close_peer(peer_id peer) = 0;
};

/// Fault injection (tc netem / iptables are not available everywhere): a transport asks the
/// hook before each put batch, notification and descriptor message.
enum class fault_point : uint8_t { put, notify, descriptors };
enum class fault_action : uint8_t {
  pass,     ///< do it
  drop,     ///< silently never do it (a put that never completes, a lost message); with a
            ///< pool: skip only that pool's puts (the transfer completes without it)
  delay,    ///< do it `delay_ms` later
  fail,     ///< report failure (a put completes with an error; a message is lost)
  corrupt,  ///< puts only, with a pool: one byte of that pool's first page flips in transit
};
struct fault_decision {
  fault_action action = fault_action::pass;
  int64_t delay_ms = 0;
  int32_t pool = -1;  ///< drop/corrupt of puts: only this pool of the layout set (-1: all)
};
using fault_hook = std::function<fault_decision(fault_point, transfer_id, notify_kind)>;


class transfer_table {
 public:
  /// Hands the pages of a transfer back to their owner, exactly once per transfer.
  /// `delivered`: the transfer is done (destination: the pages hold the KV; source: the KV
  /// was written out) — otherwise the owner frees them.
  using release_fn = std::function<void(transfer_id, transfer_role, const pool_pages& pages, bool delivered)>;

  transfer_table(const cluster_clock& clock, transfer_transport& transport, transfer_limits limits,
                 release_fn release);

  /// Destination: receive the KV of `id` from `source` into `dst_pages` (already allocated).
  /// Throws tandem::error(overloaded) when the table is full (the pages stay the caller's).
  void start_receive(transfer_id id, peer_id source, pool_pages dst_pages);
  /// Source: send `src_pages` of `id` to `destination` once source_ready(id) is called.
  void start_send(transfer_id id, peer_id destination, pool_pages src_pages);
  /// The names of the layout set's pools, for messages ("pool 1 (window)").
  void name_pools(std::vector<std::string> names) { pool_names_ = std::move(names); }
  /// Source: the pages of `id` hold their final KV (prefill done).
  void source_ready(transfer_id id);
  /// Either side: give up on `id` (request aborted). Unknown ids are ignored.
  void abort(transfer_id id);
  /// Checks every deadline against the clock.
  void tick();

  // Transport events.
  void on_peer_ready(peer_id peer);
  /// The handshake failed or the connection broke: fail every transfer with `peer` and
  /// close the endpoint (quarantined pages are released by the on_peer_closed that follows).
  void on_peer_failed(peer_id peer, const std::string& why);
  /// The endpoint is closed: nothing more can land or be read; releases its quarantine.
  void on_peer_closed(peer_id peer);
  /// Source: the destination's descriptors for `id`.
  void on_descriptors(peer_id peer, transfer_id id, pool_pages dst_pages);
  /// Source: the puts of `id` completed (ok) or failed.
  void on_put_complete(transfer_id id, bool ok, const std::string& why);
  /// A notification from `peer`.
  void on_notify(peer_id peer, transfer_id id, notify_kind kind);

  /// Phase of a live transfer, or none if unknown/finished (quarantined counts as failed).
  std::optional<transfer_phase> phase(transfer_id id) const;
  bool quarantined(transfer_id id) const { return quarantine_.count(id) > 0; }
  size_t live() const { return live_.size(); }
  size_t quarantined_transfers() const { return quarantine_.size(); }
  size_t quarantined_pages() const;
  /// The last failure message (for logs and tests).
  const std::string& last_error() const { return last_error_; }

  /// tandem_kv_transfer_* metrics.
  std::vector<metric_sample> metrics() const;
  uint64_t late_events() const { return late_events_; }
  uint64_t completed() const { return completed_; }
  uint64_t failed(fail_reason r) const;

 private:
  struct transfer {
    transfer_role role;
    peer_id peer;
    transfer_phase phase = transfer_phase::bootstrapping;
    int64_t deadline_ms = 0;
    pool_pages pages;
    pool_pages remote_pages;  ///< source: the destination's page ids
    bool have_descriptors = false;
    bool ready = false;         ///< source: pages hold the KV
    bool io_in_flight = false;  ///< destination: descriptors sent; source: puts issued
  };
  struct quarantined_transfer {
    transfer_role role;
    peer_id peer;
    int64_t deadline_ms;
    pool_pages pages;
    bool close_requested = false;
  };
  enum class peer_state : uint8_t { connecting, ready, closing };
  struct early_descriptors {
    peer_id peer;
    int64_t deadline_ms;
    pool_pages pages;
  };

  void admit(transfer_id id, transfer t);
  void on_ready_peer(transfer_id id, transfer& t);
  void maybe_put(transfer_id id, transfer& t);
  void enter(transfer& t, transfer_phase p);
  /// `nothing_in_flight`: the endpoint is gone, so no put can still touch the pages.
  void fail(transfer_id id, fail_reason r, const std::string& why, bool nothing_in_flight = false);
  void finish(transfer_id id);
  void release_quarantine(transfer_id id);
  void release(transfer_id id, transfer_role role, pool_pages pages, bool delivered);
  /// "pool 1 (window)", or "pool 1" when the pools were not named.
  std::string pool_label(size_t p) const;
  /// Empty if the destination's `dst` fits the source's `src` pool by pool (same pools, same
  /// lengths, -1 at the same indices); otherwise the first difference, naming the pool.
  std::string check_descriptors(const pool_pages& src, const pool_pages& dst) const;
  void request_close(peer_id peer);

  const cluster_clock& clock_;
  transfer_transport& transport_;
  transfer_limits limits_;
  release_fn release_;
  std::map<transfer_id, transfer> live_;
  std::map<transfer_id, quarantined_transfer> quarantine_;
  std::map<transfer_id, early_descriptors> early_;
  std::map<peer_id, peer_state> peers_;
  std::vector<std::string> pool_names_;
  std::string last_error_;
  uint64_t started_ = 0, completed_ = 0, late_events_ = 0, rejected_ = 0, early_dropped_ = 0;
  uint64_t pages_released_ = 0;
  std::map<fail_reason, uint64_t> failures_;
};

}  // namespace tandem::ucx
