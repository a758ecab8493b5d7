#pragma once
// A fake KV transport for the multi-node simulation (tests/sim/cluster_sim.h): each node's
// worker gets a kv_port whose transfer_table (transport/ucx/transfer_state, through its public
// API only) drives this in-process fabric instead of UCX. Descriptors use the engine's own
// codec (encode_descriptors / decode_descriptors) and notifications its 9-byte framing; puts
// copy page bytes between the nodes' pools. Every message may be dropped, delayed, duplicated
// or corrupted by the seed; a corrupted control message is seen by the receiver as malformed
// (a checksum, as TCP's or the fabric's ICRC, catches it), which fails the peer as the engine
// does; a corrupted put writes garbage into the destination pages and completes with an error.
// Connections are per node pair with an epoch: whatever was in flight on a closed connection
// never lands.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "actors/worker/kv_port.h"
#include "kernels/base/clock.h"
#include "tests/sim/sim.h"
#include "transport/ucx/transfer_state.h"

namespace tandem::sim {

/// Faults of the KV fabric (per message).
struct kv_fault_menu {
  double drop = 0;       ///< a control message is lost; a put never completes
  double delay = 0;      ///< held 1..max_delay_ms
  int32_t max_delay_ms = 1;
  double duplicate = 0;  ///< a control message arrives twice
  double corrupt = 0;    ///< bytes flipped on the way
  double put_fail = 0;   ///< a put completes with an error
};

class sim_kv_port;

class kv_fabric {
 public:
  kv_fabric(const cluster_clock& clock, sim_rng& rng, kv_fault_menu faults, ucx::transfer_limits limits,
            std::function<void(std::string)> note);
  kv_fabric(const kv_fabric&) = delete;
  kv_fabric& operator=(const kv_fabric&) = delete;
  ~kv_fabric();

  /// The factory for `node`'s worker (worker_options::kv_transfer).
  kv_port_factory factory(const std::string& node);
  /// `node`'s process is gone: its connections break (the peers hear a peer failure) and
  /// nothing more lands in its pool.
  void node_down(const std::string& node);

  /// The network between `a` and `b` fails until `until_ms`: an open connection breaks (both
  /// sides hear a peer failure) and connecting fails meanwhile.
  void partition(const std::string& a, const std::string& b, int64_t until_ms);

  /// Live (not down) ports with a transfer still live or quarantined: "node: N live, M quarantined".
  std::vector<std::string> in_flight() const;
  /// Bugs seen by the fabric itself (a put landing in pages the destination had released).
  const std::vector<std::string>& violations() const { return violations_; }
  int64_t faults() const { return faults_; }
  int64_t transfers_done() const { return done_; }

 private:
  friend class sim_kv_port;
  enum class kind : uint8_t { ready, failed, closed, descriptors, notify, put, put_done };
  struct packet {
    int64_t due_ms = 0;
    uint64_t seq = 0;
    int32_t to = 0, from = 0;
    uint64_t epoch = 0;  ///< 0: a connection event, delivered regardless
    uint64_t to_gen = 0; ///< the receiving port (a restarted node's port is another)
    kind k = kind::ready;
    ucx::transfer_id id = 0;
    std::vector<uint8_t> bytes;  ///< descriptors / notification / put data (+ 8-byte checksum)
    std::vector<int32_t> dst_pages;
    bool ok = true;
    std::string why;
  };

  int32_t id_of(const std::string& node);
  uint64_t pair_key(int32_t a, int32_t b) const { return (uint64_t(std::min(a, b)) << 32) | uint32_t(std::max(a, b)); }
  uint64_t epoch(int32_t a, int32_t b) const;
  void push(packet p, bool faultable);
  void attach(sim_kv_port* p);
  void detach(sim_kv_port* p);
  void break_pair(int32_t a, int32_t b, int32_t closer, const std::string& why);
  /// Delivers `port`'s due packets; true if any.
  bool deliver(sim_kv_port& port);

  // transfer_transport of one port
  void connect(int32_t from, int32_t to);
  void send_control(int32_t from, int32_t to, kind k, ucx::transfer_id id, std::vector<uint8_t> bytes);
  void put(sim_kv_port& src, int32_t to, ucx::transfer_id id, const std::vector<int32_t>& src_pages,
           const std::vector<int32_t>& dst_pages);
  void close(int32_t from, int32_t to);

  const cluster_clock& clock_;
  sim_rng& rng_;
  kv_fault_menu f_;
  ucx::transfer_limits limits_;
  std::function<void(std::string)> note_;
  std::vector<std::string> names_;
  std::map<int32_t, sim_kv_port*> ports_;  ///< the live port of each node
  std::map<uint64_t, uint64_t> conn_;      ///< pair -> epoch of its open connection
  std::map<uint64_t, int64_t> partitioned_until_;
  uint64_t next_epoch_ = 1, next_seq_ = 0, next_gen_ = 0;
  std::multimap<std::pair<int64_t, uint64_t>, packet> q_;
  std::vector<std::string> violations_;
  int64_t faults_ = 0, done_ = 0;
};

}  // namespace tandem::sim
