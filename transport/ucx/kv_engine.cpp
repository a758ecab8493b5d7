#include "transport/ucx/kv_engine.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "kernels/base/error.h"

namespace tandem::ucx {
namespace {

[[noreturn]] void ucx_fail(const std::string& what, ucs_status_t s, const std::string& fix) {
  throw tandem::error(fmt::format("{}: {}; {}", what, ucs_status_string(s), fix));
}

ucs_status_t am_cb(void* arg, const void* /*header*/, size_t /*header_length*/, void* data, size_t length,
                   const ucp_am_recv_param_t* param) {
  auto* c = static_cast<std::pair<kv_engine*, unsigned>*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;  // never sent: all our messages are eager
  ucp_ep_h reply = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  c->first->on_am(c->second, reply, data, length);
  return UCS_OK;
}

void conn_cb(ucp_conn_request_h req, void* arg) { static_cast<kv_engine*>(arg)->on_conn_request(req); }

struct flush_ctx {
  kv_engine* engine;
  peer_id peer;
  transfer_id id;
  int stage;
};
void flush_cb(void* request, ucs_status_t status, void* user_data) {
  auto* f = static_cast<flush_ctx*>(user_data);
  f->engine->on_flush_done(f->peer, f->id, f->stage, status);
  delete f;
  ucp_request_free(request);
}

void send_cb(void* request, ucs_status_t /*status*/, void* user_data) {
  delete static_cast<std::vector<uint8_t>*>(user_data);
  ucp_request_free(request);
}

}  // namespace

kv_engine::kv_engine(const cluster_clock& clock, kv_pool& pool, kv_identity identity, engine_options options,
                     transfer_table::release_fn release)
    : clock_(clock),
      identity_(std::move(identity)),
      options_(std::move(options)),
      table_(clock, *this, options_.limits, staged_release(std::move(release))) {
  if (options_.device.make_pools)
    throw tandem::error(error_kind::unimplemented,
                        "a KV engine over a borrowed pool keeps it in host memory; let the engine allocate "
                        "device pools (the page-count constructor)");
  if (!(identity_.layout == pool.layout()))
    throw tandem::error(fmt::format("KV engine identity says {} but the pool is {}; pass the pool's layout",
                                    identity_.layout.describe(), pool.layout().describe()));
  init({}, &pool);
}

kv_engine::kv_engine(const cluster_clock& clock, int32_t n_pages, kv_identity identity, engine_options options,
                     transfer_table::release_fn release)
    : kv_engine(clock, std::span<const int32_t>(&n_pages, 1), std::move(identity), std::move(options),
                std::move(release)) {}

kv_engine::kv_engine(const cluster_clock& clock, std::span<const int32_t> n_pages, kv_identity identity,
                     engine_options options, transfer_table::release_fn release)
    : clock_(clock),
      identity_(std::move(identity)),
      options_(std::move(options)),
      table_(clock, *this, options_.limits, staged_release(std::move(release))) {
  for (int32_t n : n_pages)
    if (n <= 0) throw tandem::error(fmt::format("a KV pool needs at least one page, got {}", n));
  init(n_pages, nullptr);
}

void kv_engine::init(std::span<const int32_t> alloc_pages, kv_pool* borrowed) {
  const kv_pools_layout set = identity_.set();
  if (!(set.pools.front().page == identity_.layout))
    throw tandem::error(fmt::format("KV engine identity: layout {} is not pool 0's page {}; pass the set's pool 0",
                                    identity_.layout.describe(), set.pools.front().page.describe()));
  const size_t n_pools = set.pools.size();
  if (borrowed ? n_pools != 1 : alloc_pages.size() != n_pools)
    throw tandem::error(fmt::format("KV engine: {} page counts for a layout set of {} pools ({})",
                                    borrowed ? 1 : alloc_pages.size(), n_pools, set.describe()));
  identity_.dtype = to_string(identity_.layout.dtype);  // what the hello carries is the layout's
  // Pools in device memory: UCX registers staging slots instead (a bounded area per pool).
  std::vector<int32_t> wire_pages(alloc_pages.begin(), alloc_pages.end());
  if (options_.device.make_pools && !borrowed) {
    device_pools_ = options_.device.make_pools(set, alloc_pages);
    for (size_t p = 0; p < n_pools; ++p) {
      const size_t pb = std::max<size_t>(set.pools[p].page.page_bytes(), 1);
      wire_pages[p] = kv_staging::slots_for(
          alloc_pages[p], int32_t(std::min<size_t>(options_.staging_bytes / pb, size_t(INT32_MAX))));
    }
  }
  // The listener's port can be reused right after a restart (TIME_WAIT otherwise blocks it).
  // UCX 1.13 reads the connection manager's settings only from the environment
  // (ucp_config_modify rejects TCP_CM_REUSEADDR), so set it there unless the user did; create
  // engines before starting threads that touch the environment.
  setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) ucx_fail("reading the UCX configuration failed", s, "check the UCX_* environment variables");
  setup_ucx_config(config);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM;
  params.name = "tandem-kv";
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) ucx_fail("ucp_init failed", s, "check that UCX is installed (libucx0) and UCX_TLS names usable transports");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // progress() runs on one thread
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) {
    ucp_cleanup(context_);
    ucx_fail("ucp_worker_create failed", s, "check UCX_TLS");
  }

  // Register only the KV pools: they are the only memory remote peers may write.
  std::vector<kv_pool*> ptrs;
  for (size_t p = 0; p < n_pools; ++p) {
    const bool alloc = borrowed == nullptr;
    void* storage = nullptr;
    size_t length = 0;
    register_pool(p, alloc ? nullptr : borrowed->data(),
                  alloc ? kv_pool::bytes_for(set.pools[p].page, wire_pages[p]) : borrowed->bytes(), alloc, storage,
                  length);
    if (alloc) {
      owned_pools_.push_back(std::make_unique<kv_pool>(set.pools[p].page, wire_pages[p], storage, length));
      ptrs.push_back(owned_pools_.back().get());
    } else {
      ptrs.push_back(borrowed);
    }
  }
  pools_ = std::make_unique<kv_pools>(set, std::move(ptrs));
  if (device_pools_) {
    staging_ = std::make_unique<kv_staging>(options_.device, *device_pools_, *pools_);
    size_t bytes = 0;
    for (size_t p = 0; p < n_pools; ++p) bytes += (*pools_)[p].bytes();
    if (options_.log)
      options_.log(false, fmt::format("KV pools in {} memory; transfers stage through {:.1f} MiB of pinned host pages",
                                      options_.device.name, double(bytes) / 1048576.0));
  }
  std::vector<std::string> names;
  for (const auto& p : set.pools) names.push_back(p.name);
  table_.name_pools(std::move(names));

  am_args_ = std::make_unique<std::pair<kv_engine*, unsigned>[]>(am_count);
  for (unsigned i = 0; i < am_count; ++i) {
    am_args_[i] = {this, i + 1};
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = i + 1;
    hp.cb = am_cb;
    hp.arg = &am_args_[i];
    s = ucp_worker_set_am_recv_handler(worker_, &hp);
    if (s != UCS_OK) ucx_fail("registering the KV active message handlers failed", s, "upgrade UCX to >= 1.13");
  }
}

void kv_engine::register_pool(size_t p, void* address, size_t bytes, bool alloc, void*& storage, size_t& length) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = address;
  mp.length = bytes;
  if (alloc) {
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) {
    for (ucp_mem_h m : memh_) ucp_mem_unmap(context_, m);
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    ucx_fail(fmt::format("registering KV pool {} ({} bytes) failed", p, bytes), s,
             "lower the number of KV pages or raise the locked-memory limit (ulimit -l)");
  }
  memh_.push_back(memh);
  if (!alloc) return;
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK) ucx_fail("querying the KV pool allocation failed", s, "report this UCX error");
  std::memset(attr.address, 0, bytes);
  storage = attr.address;
  length = attr.length;
}

void kv_engine::drop_remote(peer& p) {
  for (auto& r : p.remote)
    if (r.rkey) ucp_rkey_destroy(r.rkey);
  p.remote.clear();
}

kv_engine::~kv_engine() {
  destroying_ = true;
  for (auto* req : conn_requests_) ucp_listener_reject(listener_, req);
  if (listener_) ucp_listener_destroy(listener_);
  for (auto& [id, p] : peers_)
    if ((p.ep || p.data_ep) && !p.closing) close_peer(id);
  // Bounded drain: a forced close completes locally without the peer.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    ucp_worker_progress(worker_);
    bool open = false;
    for (auto& [id, p] : peers_) {
      for (void** r : {&p.close_request, &p.data_close_request})
        if (*r && ucp_request_check_status(*r) != UCS_INPROGRESS) {
          ucp_request_free(*r);
          *r = nullptr;
        }
      open = open || p.close_request || p.data_close_request;
    }
    if (!open || std::chrono::steady_clock::now() > until) break;
  }
  for (auto& [id, p] : peers_) drop_remote(p);
  staging_.reset();  // unpins the slots before UCX unmaps them
  device_pools_.reset();
  pools_.reset();
  owned_pools_.clear();
  for (ucp_mem_h m : memh_) ucp_mem_unmap(context_, m);
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

uint16_t kv_engine::listen(const std::string& ip, uint16_t port) {
  if (!options_.tls.empty() && options_.tls.find("tcp") == std::string::npos && options_.tls != "all")
    throw tandem::error(fmt::format("listening for KV transfers needs the tcp transport but TLS={}; add tcp "
                                    "(e.g. --ucx-tls {},tcp)",
                                    options_.tls, options_.tls));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  if (inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1)
    throw tandem::error("KV transfer listen address '" + ip + "' is not an IPv4 address");
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
  lp.sockaddr.addrlen = sizeof(sa);
  lp.conn_handler.cb = conn_cb;
  lp.conn_handler.arg = this;
  ucs_status_t s = ucp_listener_create(worker_, &lp, &listener_);
  if (s != UCS_OK)
    ucx_fail(fmt::format("listening for KV transfers on {}:{} failed", ip, port), s,
             "pick a free port and make sure UCX_TLS includes tcp");
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  s = ucp_listener_query(listener_, &attr);
  if (s != UCS_OK) ucx_fail("querying the KV listener failed", s, "report this UCX error");
  return ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
}

peer_id kv_engine::add_peer(const std::string& ip, uint16_t port) {
  if (peers_.size() >= options_.max_peers)
    throw tandem::error(error_kind::overloaded, fmt::format("KV engine has {} peers (max_peers); raise it",
                                                            options_.max_peers));
  peer_id id = next_peer_++;
  auto& p = peers_[id];
  p.ip = ip;
  p.port = port;
  p.dialable = true;
  return id;
}

std::optional<peer_id> kv_engine::peer_named(const std::string& node) const {
  for (auto& [id, p] : peers_)
    if (p.hello_received && p.node == node && !p.closing) return id;
  return std::nullopt;
}

bool kv_engine::peer_ready(peer_id peer) const {
  auto it = peers_.find(peer);
  return it != peers_.end() && it->second.ready_reported && !it->second.closing;
}

std::optional<peer_id> kv_engine::peer_of(ucp_ep_h ep) const {
  for (auto& [id, p] : peers_)
    if (ep && (p.ep == ep || p.data_ep == ep)) return id;
  return std::nullopt;
}

bool kv_engine::flush(peer_id id, ucp_ep_h ep, transfer_id tid, int stage) {
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = flush_cb;
  auto* f = new flush_ctx{this, id, tid, stage};
  rp.user_data = f;
  ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &rp);
  if (UCS_PTR_IS_PTR(r)) return true;
  delete f;
  on_flush_done(id, tid, stage, UCS_PTR_STATUS(r));
  return false;
}

void kv_engine::connect_data(peer_id id, peer& p, const std::vector<uint8_t>& address) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  // Peer-failure handling would exclude the shared memory transports from this endpoint's
  // lanes; the control endpoint (PEER mode) detects a dead peer and closes both.
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  ucs_status_t s = ucp_ep_create(worker_, &ep, &p.data_ep);
  if (s != UCS_OK) {
    p.data_ep = nullptr;
    peer_failed(id, p, fmt::format("connecting the data endpoint to KV peer '{}' failed: {}; inside network "
                                   "namespaces set UCX_TLS=tcp",
                                   p.node, ucs_status_string(s)));
    return;
  }
  // Flush the new endpoint (this completes its wireup) before the first large put (UCX #6872).
  flush(id, p.data_ep, 0, 2);
}

void kv_engine::send_am(peer& p, unsigned am_id, std::vector<uint8_t> bytes) {
  auto* buf = new std::vector<uint8_t>(std::move(bytes));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  rp.cb.send = send_cb;
  rp.user_data = buf;
  rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, am_id, nullptr, 0, buf->data(), buf->size(), &rp);
  if (!UCS_PTR_IS_PTR(r)) delete buf;  // done (or failed: the endpoint error handler reports it)
}

void kv_engine::on_flush_done(peer_id id, transfer_id tid, int stage, int status) {
  if (stage == 0) corrupt_copies_.erase(tid);  // nothing reads them any more
  if (destroying_) return;
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  auto& p = it->second;
  if (status != UCS_OK) {
    // A failed flush says nothing about which writes landed: only closing the endpoint does,
    // so the table learns of it as a peer failure (released on close), never as put_failed.
    if (stage == 1) p.hello_flushed = true;
    if (p.closing) return;
    if (p.failed)
      maybe_ready(id, p);
    else
      peer_failed(id, p, fmt::format("KV peer '{}' ({}:{}): flush failed: {}", p.node, p.ip, p.port,
                                     ucs_status_string(ucs_status_t(status))));
    return;
  }
  if (stage != 0) {
    (stage == 1 ? p.hello_flushed : p.data_flushed) = true;
    maybe_ready(id, p);
    return;
  }
  later([this, tid] { table_.on_put_complete(tid, true, ""); });
}

void kv_engine::maybe_ready(peer_id id, peer& p) {
  if (!p.hello_flushed || p.closing) return;
  if (p.failed) {
    if (!p.fail_message.empty()) {
      std::string why = std::move(p.fail_message);
      p.fail_message.clear();
      later([this, id, why] { table_.on_peer_failed(id, why); });
    }
    return;
  }
  if (p.hello_received && p.data_flushed && !p.ready_reported) {
    p.ready_reported = true;
    later([this, id] { table_.on_peer_ready(id); });
  }
}

void kv_engine::peer_failed(peer_id id, peer& p, const std::string& why) {
  if (p.failed) return;
  p.failed = true;
  last_peer_error_ = why;
  // Report once our hello is out, so the peer reads our identity before the endpoint closes.
  p.fail_message = why;
  if (!p.ep) p.hello_flushed = true;
  maybe_ready(id, p);
}

void kv_engine::on_conn_request(ucp_conn_request_h req) { conn_requests_.push_back(req); }

void kv_engine::on_ep_error(ucp_ep_h ep, int status) {
  if (destroying_) return;
  auto id = peer_of(ep);
  if (!id) return;
  auto& p = peers_[*id];
  if (p.closing) return;
  peer_failed(*id, p, fmt::format("KV peer '{}' disconnected: {}; the node is down or unreachable",
                                  p.node.empty() ? p.ip : p.node, ucs_status_string(ucs_status_t(status))));
  p.hello_flushed = true;  // nothing more will flush on a failed endpoint
  maybe_ready(*id, p);
}

void kv_engine::on_am(unsigned am_id, ucp_ep_h reply_ep, const void* data, size_t length) {
  if (destroying_) return;
  auto id = peer_of(reply_ep);
  if (!id) return;
  peer_id pid = *id;
  auto& p = peers_[pid];
  if (p.closing || p.failed) return;
  auto bytes = static_cast<const uint8_t*>(data);
  try {
    if (am_id == am_hello || am_id == am_challenge || am_id == am_proof) {
      on_handshake_am(pid, p, am_id, bytes, length);
    } else if (!p.hello_received) {
      // Descriptors and notifications only from a peer that passed the handshake.
      refuse(pid, p, fmt::format("KV peer '{}' sent message {} before its handshake completed", p.node, am_id));
    } else if (am_id == am_descriptors) {
      kv_descriptors d = decode_descriptors(bytes, length);
      transfer_id tid = d.transfer;
      pool_pages pages = std::move(d.pages);
      later([this, pid, tid, pages = std::move(pages)]() mutable { table_.on_descriptors(pid, tid, std::move(pages)); });
    } else if (am_id == am_notify) {
      later([this, pid, n = decode_notify(bytes, length)] {
        // verify_received reads the manifest while the table handles the `done`.
        arriving_done_ = &n;
        table_.on_notify(pid, n.transfer, n.kind);
        arriving_done_ = nullptr;
      });
    }
  } catch (const std::exception& e) {
    peer_failed(pid, p, fmt::format("KV peer '{}': {}", p.node, e.what()));
  }
}

fault_decision kv_engine::fault(fault_point fp, transfer_id id, notify_kind k) const {
  return options_.faults ? options_.faults(fp, id, k) : fault_decision{};
}

void kv_engine::connect(peer_id id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) {
    later([this, id] { table_.on_peer_failed(id, fmt::format("unknown KV peer {}", id)); });
    return;
  }
  auto& p = it->second;
  if (p.ready_reported && !p.closing) {
    later([this, id] { table_.on_peer_ready(id); });
    return;
  }
  if (p.ep) return;  // handshake in progress: maybe_ready reports
  if (!p.dialable) {
    later([this, id] { table_.on_peer_failed(id, fmt::format("KV peer {} is not connected; it must dial again", id)); });
    return;
  }
  create_ep(id, p, nullptr);
}

void kv_engine::send_descriptors(peer_id peer, transfer_id id, const pool_pages& dst_pages) {
  auto d = fault(fault_point::descriptors, id, notify_kind::started);
  if (d.action == fault_action::drop || d.action == fault_action::fail) return;
  auto send = [this, peer, id, dst_pages] { send_descriptors_now(peer, id, dst_pages); };
  if (d.action == fault_action::delay)
    delayed_.emplace(clock_.now_ms() + d.delay_ms, std::move(send));
  else
    send();
}

void kv_engine::notify(peer_id peer, transfer_id id, notify_kind kind) {
  auto d = fault(fault_point::notify, id, kind);
  if (d.action == fault_action::drop || d.action == fault_action::fail) {
    if (kind != notify_kind::started) sent_manifests_.erase(id);
    return;
  }
  if (d.action == fault_action::delay)
    delayed_.emplace(clock_.now_ms() + d.delay_ms, [this, peer, id, kind] { do_notify(peer, id, kind); });
  else
    do_notify(peer, id, kind);
}

void kv_engine::do_notify(peer_id peer, transfer_id id, notify_kind kind) {
  kv_notify n{id, kind, {}};
  if (auto m = sent_manifests_.find(id); m != sent_manifests_.end()) {
    // The table sends `done` or `failed` once the puts are flushed: the manifest goes with it.
    if (kind == notify_kind::done) n.manifest = std::move(m->second.manifest);
    if (kind != notify_kind::started) sent_manifests_.erase(m);
  }
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.ep || it->second.closing || it->second.failed) return;
  send_am(it->second, am_notify, encode_notify(n));
}

void kv_engine::close_peer(peer_id id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) {
    if (!destroying_) later([this, id] { table_.on_peer_closed(id); });
    return;
  }
  auto& p = it->second;
  if (p.closing) return;
  p.closing = true;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;  // abort in-flight puts: after this nothing more lands
  // The rkeys belong to the data endpoint: destroy them before the endpoint goes.
  drop_remote(p);
  for (auto [ep, req] : {std::pair{&p.ep, &p.close_request}, std::pair{&p.data_ep, &p.data_close_request}}) {
    if (!*ep) continue;
    ucs_status_ptr_t r = ucp_ep_close_nbx(*ep, &rp);
    if (UCS_PTR_IS_PTR(r)) *req = r;
  }
  if (!p.close_request && !p.data_close_request) finish_close(id, p);
}

void kv_engine::finish_close(peer_id id, peer& p) {
  p.ep = nullptr;
  p.data_ep = nullptr;
  if (destroying_) return;
  // Nothing of this peer's transfers is in flight any more: no manifest will be sent.
  std::erase_if(sent_manifests_, [id](const auto& m) { return m.second.peer == id; });
  std::erase_if(corrupt_copies_, [id](const auto& c) { return !c.second.empty() && c.second.front().peer == id; });
  if (p.dialable) {
    // Keep the address so a later transfer can dial again.
    std::string ip = p.ip;
    uint16_t port = p.port;
    p = peer{};
    p.ip = ip;
    p.port = port;
    p.dialable = true;
  } else {
    peers_.erase(id);
  }
  later([this, id] { table_.on_peer_closed(id); });
}

bool kv_engine::progress() {
  bool any = ucp_worker_progress(worker_) > 0;
  if (!staging_waiting_.empty()) {
    // Steps that found the staging area full try once more (a step still short waits again).
    auto waiting = std::move(staging_waiting_);
    staging_waiting_.clear();
    for (auto& f : waiting) f();
  }
  while (!conn_requests_.empty()) {
    ucp_conn_request_h req = conn_requests_.front();
    conn_requests_.pop_front();
    any = true;
    if (peers_.size() >= options_.max_peers) {
      ucp_listener_reject(listener_, req);
      continue;
    }
    peer_id id = next_peer_++;
    create_ep(id, peers_[id], req);
  }
  std::vector<peer_id> closed;
  for (auto& [id, p] : peers_) {
    if (!p.close_request && !p.data_close_request) continue;
    for (void** r : {&p.close_request, &p.data_close_request})
      if (*r && ucp_request_check_status(*r) != UCS_INPROGRESS) {
        ucp_request_free(*r);
        *r = nullptr;
      }
    if (!p.close_request && !p.data_close_request) closed.push_back(id);
  }
  for (peer_id id : closed) finish_close(id, peers_[id]);
  int64_t now = clock_.now_ms();
  while (!delayed_.empty() && delayed_.begin()->first <= now) {
    auto f = std::move(delayed_.begin()->second);
    delayed_.erase(delayed_.begin());
    f();
    any = true;
  }
  while (!events_.empty()) {
    auto batch = std::move(events_);
    events_.clear();
    for (auto& f : batch) f();
    any = true;
  }
  table_.tick();
  return any;
}

}  // namespace tandem::ucx
