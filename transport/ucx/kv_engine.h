#pragma once
/// KV page transfer engine over UCX: registers every KV pool of the layout set once, runs the layout handshake
/// over active messages, writes pages with ucp_put_nbx and notifies the destination after a
/// flush. It is the `transfer_transport` of its own `transfer_table`, so the state machine,
/// deadlines, quarantine and metrics are those of transfer_state.h.
///
/// Single-threaded: the owner calls progress() from one thread (an actor's loop); every table
/// event is delivered from there. Peers either connect to us (listen) or are dialled
/// (add_peer); a peer is named by the node name it sends in its handshake.
///
/// Two endpoints per peer: a control endpoint (the sockaddr connection: handshake and
/// messages) and a data endpoint dialled to the worker address the peer sent in its hello,
/// for the puts; UCX connects that one with every transport it has (shared memory on one
/// host), while a sockaddr endpoint gets only the connection manager's tcp.
///
/// Protocol (active messages, eager, small):
///   challenge    both sides, first on a new endpoint, then flushed (UCX #6872: a large send
///                on an unflushed new endpoint can stall): node name and a fresh nonce
///   proof        both sides, on the peer's challenge: HMAC of the cluster secret over the
///                peer's nonce (kv_auth.h; empty without a secret)
///   hello        each side once the peer's proof passed: identity with the layout set, pool
///                base and packed rkey of pool 0 and one region per further pool; a peer that
///                fails the proof is refused and never gets them; a peer whose set differs is
///                refused naming both sides' values per pool
///   descriptors  destination -> source: transfer id + destination page ids per pool (the
///                addresses are base + page * page_bytes of that pool's region)
///   notify       either way: transfer id + notify_kind (done/failed only after a flush);
///                `done` carries the per-pool manifest (kv_manifest.h) the destination
///                verifies before the transfer counts as delivered
///
/// Pools in device memory (engine_options::device, a GPU's): UCX registers a bounded staging
/// area of pinned host slots per pool instead (kv_staging.h); the wire names slots, and pages
/// cross between the device and the slots on the device's copy stream.
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend/device.h"
#include "kernels/base/clock.h"
#include "kernels/model/kv_pools.h"
#include "transport/ucx/kv_auth.h"
#include "transport/ucx/kv_handshake.h"
#include "transport/ucx/kv_manifest.h"
#include "transport/ucx/kv_staging.h"
#include "transport/ucx/transfer_state.h"

// Opaque UCX handles (ucp/api/ucp_def.h), so users need not include UCX headers.
typedef struct ucp_context* ucp_context_h;
typedef struct ucp_config ucp_config_t;
typedef struct ucp_worker* ucp_worker_h;
typedef struct ucp_ep* ucp_ep_h;
typedef struct ucp_mem* ucp_mem_h;
typedef struct ucp_rkey* ucp_rkey_h;
typedef struct ucp_listener* ucp_listener_h;
typedef struct ucp_conn_request* ucp_conn_request_h;

namespace tandem::ucx {

/// How the source issues the puts of a transfer.
enum class put_mode : uint8_t {
  batched,   ///< one put per run of consecutive pages, all at once
  per_layer, ///< one put per (layer, page): the granularity of streaming layer by layer
};

struct engine_options {
  /// UCX transports (UCX_TLS); empty = UCX's default (or the UCX_TLS environment variable).
  /// Listening needs `tcp` in the list (the sockaddr connection manager); inside network
  /// namespaces use "tcp" alone (shared memory transports cannot see the peer).
  std::string tls;
  put_mode mode = put_mode::batched;
  transfer_limits limits;
  size_t max_peers = 64;  ///< endpoints; more incoming connections are rejected
  fault_hook faults;      ///< tests inject drops, delays and failures here
  /// The cluster secret ([security] api_key_file's first key): peers prove it in the handshake
  /// before any rkey is sent. Empty = the handshake is unauthenticated (and a peer that
  /// authenticates is refused: both sides must agree).
  std::string secret;
  /// UCX network devices (UCX_NET_DEVICES, e.g. "lo" for a node on 127.0.0.1; see
  /// net_devices_for_host); empty = UCX's default (every interface). The UCX_NET_DEVICES
  /// environment variable, when set, wins.
  std::string net_devices;
  /// Where the engine says what it uses and whom it refused (warning = true); none = silent.
  std::function<void(bool warning, const std::string& message)> log;
  /// The pools' memory: empty = host memory UCX allocates and registers; a device
  /// (kernels/backend/device.h, with staging) = its memory, staged through pinned slots.
  backend::device device;
  /// Bytes of staging slots per pool with a device (at most the pool's own size).
  size_t staging_bytes = size_t(256) << 20;
};

class kv_engine final : public transfer_transport {
 public:
  /// Registers `pool` (and only it) for remote writes; identity's layout set must be the
  /// single pool of its layout. Throws tandem::error naming the fix.
  /// Memory UCX did not allocate is reachable over tcp (and RDMA), but not by the shared
  /// memory transports: use the other constructors where peers share a host.
  kv_engine(const cluster_clock& clock, kv_pool& pool, kv_identity identity, engine_options options,
            transfer_table::release_fn release);
  /// Allocates the KV pool (`n_pages` of identity.layout, zeroed) in memory UCX allocates and
  /// registers (shared memory segments), so a peer on the same host writes it with plain
  /// memory copies. The pool is pool(); it lives as long as the engine.
  kv_engine(const cluster_clock& clock, int32_t n_pages, kv_identity identity, engine_options options,
            transfer_table::release_fn release);
  /// The same for every pool of identity.set(): `n_pages[p]` pages of pool p.
  kv_engine(const cluster_clock& clock, std::span<const int32_t> n_pages, kv_identity identity,
            engine_options options, transfer_table::release_fn release);
  ~kv_engine() override;
  kv_engine(const kv_engine&) = delete;
  kv_engine& operator=(const kv_engine&) = delete;

  /// Accept connections on ip:port (0 = any free port); returns the bound port.
  uint16_t listen(const std::string& ip, uint16_t port = 0);
  /// Declare a peer to dial at ip:port; it is connected when the table first needs it.
  peer_id add_peer(const std::string& ip, uint16_t port);
  /// The id of the connected peer whose handshake named it `node`.
  std::optional<peer_id> peer_named(const std::string& node) const;
  /// True once the handshake with `peer` completed in both directions.
  bool peer_ready(peer_id peer) const;

  /// Pool 0 of the set (the only one of a one-pool layout).
  kv_pool& pool() { return pools()[0]; }
  /// The pools the model uses (the device's when staged).
  kv_pools& pools() { return device_pools_ ? *device_pools_ : *pools_; }
  /// The staging area of device pools; null for pools in host memory.
  kv_staging* staging() { return staging_.get(); }
  const kv_staging* staging() const { return staging_.get(); }
  transfer_table& table() { return table_; }
  const transfer_table& table() const { return table_; }
  /// Progress UCX, deliver completions to the table, check deadlines. Returns true if
  /// anything happened (callers may back off when it returns false).
  bool progress();

  /// Why the last peer failed (handshake mismatch, connection error), for logs and tests.
  const std::string& last_peer_error() const { return last_peer_error_; }
  uint64_t puts_issued() const { return puts_issued_; }
  /// Peers refused in the handshake (no or wrong cluster secret, a message out of order).
  uint64_t handshakes_refused() const { return handshakes_refused_; }
  /// Hellos (rkeys) received from peers: a refused peer's never count.
  uint64_t hellos_received() const { return hellos_received_; }
  /// Hellos (rkeys) this engine sent: only to peers whose proof passed.
  uint64_t hellos_sent() const { return hellos_sent_; }
  /// What init() gave UCX as its network devices ("" = UCX's default), and where it came from.
  const std::string& net_devices_used() const { return net_devices_used_; }
  /// Bytes the manifests hashed (both roles) and the time it took: the manifest's cost.
  uint64_t manifest_bytes() const { return manifest_bytes_; }
  int64_t manifest_us() const { return manifest_us_; }

  // transfer_transport
  void connect(peer_id peer) override;
  void send_descriptors(peer_id peer, transfer_id id, const pool_pages& dst_pages) override;
  void put_pages(peer_id peer, transfer_id id, const pool_pages& src_pages, const pool_pages& dst_pages) override;
  std::string verify_received(peer_id peer, transfer_id id, const pool_pages& dst_pages,
                              fail_reason& reason) override;
  void notify(peer_id peer, transfer_id id, notify_kind kind) override;
  void close_peer(peer_id peer) override;

  // UCX callbacks (C linkage trampolines in the .cpp call these).
  void on_am(unsigned am_id, ucp_ep_h reply_ep, const void* data, size_t length);
  void on_conn_request(ucp_conn_request_h req);
  void on_ep_error(ucp_ep_h ep, int status);
  /// stage: 0 = puts of `id`, 1 = the hello on the control endpoint, 2 = the new data endpoint
  void on_flush_done(peer_id peer, transfer_id id, int stage, int status);

 private:
  static constexpr unsigned am_hello = 1;
  static constexpr unsigned am_descriptors = 2;
  static constexpr unsigned am_notify = 3;
  static constexpr unsigned am_challenge = 4;
  static constexpr unsigned am_proof = 5;
  static constexpr unsigned am_count = 5;

  /// Where a peer's pool lives (from its hello).
  struct remote_pool {
    ucp_rkey_h rkey = nullptr;  ///< unpacked on the data endpoint
    uint64_t base = 0;
    int32_t n_pages = 0;
  };
  struct peer {
    ucp_ep_h ep = nullptr;       ///< control: handshake, descriptors, notifications
    std::unique_ptr<kv_auth> auth;  ///< this handshake's nonce and secret
    bool authenticated = false;  ///< the peer's proof passed: our hello (rkey) may go
    ucp_ep_h data_ep = nullptr;  ///< puts; its rkey is `rkey`
    bool data_flushed = false;
    void* data_close_request = nullptr;
    std::string ip;
    uint16_t port = 0;
    bool dialable = false;
    bool hello_flushed = false;
    bool hello_received = false;
    bool ready_reported = false;
    bool failed = false;
    std::string fail_message;  ///< reported once our hello is flushed
    bool closing = false;
    void* close_request = nullptr;
    std::vector<remote_pool> remote;  ///< one per pool of the layout set, once the hello passed
    std::string node;
  };

  /// Registers `borrowed` (one pool) or allocates `alloc_pages[p]` pages per pool in UCX memory.
  void init(std::span<const int32_t> alloc_pages, kv_pool* borrowed);
  /// Registers (maps) the memory of pool `p`; allocates it when `alloc` (then `storage` is set).
  void register_pool(size_t p, void* address, size_t bytes, bool alloc, void*& storage, size_t& length);
  /// Destroys the rkeys of `p`'s remote pools.
  void drop_remote(peer& p);
  void create_ep(peer_id id, peer& p, ucp_conn_request_h req);
  void send_challenge(peer_id id, peer& p, kv_role role);
  void send_hello(peer_id id, peer& p);
  /// The handshake messages (kv_engine_handshake.cpp); throws tandem::error on bad bytes.
  void on_handshake_am(peer_id id, peer& p, unsigned am_id, const uint8_t* bytes, size_t length);
  /// Refuses the peer (counted): its endpoint closes, it never gets our hello.
  void refuse(peer_id id, peer& p, const std::string& why);
  void setup_ucx_config(ucp_config_t* config);
  void send_am(peer& p, unsigned am_id, std::vector<uint8_t> bytes);
  void peer_failed(peer_id id, peer& p, const std::string& why);
  void maybe_ready(peer_id id, peer& p);
  void finish_close(peer_id id, peer& p);
  bool flush(peer_id id, ucp_ep_h ep, transfer_id tid, int stage);
  void connect_data(peer_id id, peer& p, const std::vector<uint8_t>& address);
  std::optional<peer_id> peer_of(ucp_ep_h ep) const;
  void later(std::function<void()> f) { events_.push_back(std::move(f)); }
  fault_decision fault(fault_point p, transfer_id id, notify_kind k) const;
  /// `d`: the put fault of this batch (a pool to drop or corrupt).
  void do_put(peer_id peer, transfer_id id, const pool_pages& src, const pool_pages& dst, fault_decision d);
  /// Issues the puts of pool `k` (skipping -1 blocks); false when UCX refused one.
  bool put_pool(peer& p, size_t k, const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                const uint8_t* corrupt_first);
  void do_notify(peer_id peer, transfer_id id, notify_kind kind);
  /// Sends the descriptors of `id`, through staging slots when staged (waits for them).
  void send_descriptors_now(peer_id peer, transfer_id id, const pool_pages& dst_pages);
  /// `release` that first returns the transfer's staging slots.
  transfer_table::release_fn staged_release(transfer_table::release_fn release);

  const cluster_clock& clock_;
  /// Every pool of identity_.set() in registered memory: the pools themselves, or with a
  /// device the staging slots (what the wire reads and writes).
  std::unique_ptr<kv_pools> pools_;
  std::shared_ptr<kv_pools> device_pools_;  ///< with a device: the pools in its memory
  std::unique_ptr<kv_staging> staging_;     ///< with a device
  /// Steps waiting for staging slots, retried once per progress().
  std::vector<std::function<void()>> staging_waiting_;
  std::vector<std::unique_ptr<kv_pool>> owned_pools_;  ///< pools in UCX-allocated memory
  kv_identity identity_;
  engine_options options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_mem_h> memh_;  ///< one registration per pool
  ucp_listener_h listener_ = nullptr;
  std::map<peer_id, peer> peers_;
  peer_id next_peer_ = 1;
  std::deque<ucp_conn_request_h> conn_requests_;
  std::vector<std::function<void()>> events_;
  std::multimap<int64_t, std::function<void()>> delayed_;
  std::string last_peer_error_;
  uint64_t puts_issued_ = 0;
  uint64_t handshakes_refused_ = 0;
  uint64_t hellos_received_ = 0;
  uint64_t hellos_sent_ = 0;
  std::string net_devices_used_;
  /// Source: the manifest of each transfer whose puts were issued, sent with its `done`.
  struct sent_manifest {
    peer_id peer;
    kv_manifest manifest;
  };
  std::map<transfer_id, sent_manifest> sent_manifests_;
  /// Destination: the manifest of the `done` being delivered to the table right now.
  const kv_notify* arriving_done_ = nullptr;
  /// Page copies with a flipped byte (fault_action::corrupt) until their puts are flushed (or
  /// the peer's endpoint closed).
  struct corrupt_copy {
    peer_id peer;
    std::vector<uint8_t> bytes;
  };
  std::map<transfer_id, std::vector<corrupt_copy>> corrupt_copies_;
  uint64_t manifest_bytes_ = 0;
  int64_t manifest_us_ = 0;
  bool destroying_ = false;  ///< the destructor drains UCX without telling the table
  std::unique_ptr<std::pair<kv_engine*, unsigned>[]> am_args_;  ///< handler args, one per message id
  transfer_table table_;
};

}  // namespace tandem::ucx
