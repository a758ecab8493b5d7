// kv_engine: the handshake (challenge, proof, hello) and the UCX configuration the engine
// derives from its options. The pure parts are kv_auth.h and kv_handshake.h.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>

#include <cstdlib>

#include "kernels/base/error.h"
#include "transport/ucx/kv_engine.h"

namespace tandem::ucx {

void kv_engine::setup_ucx_config(ucp_config_t* config) {
  auto modify = [&](const char* name, const std::string& value, const char* fix) {
    ucs_status_t s = ucp_config_modify(config, name, value.c_str());
    if (s == UCS_OK) return;
    ucp_config_release(config);
    throw tandem::error(fmt::format("UCX rejected {}={}: {}; {}", name, value, ucs_status_string(s), fix));
  };
  if (!options_.tls.empty()) modify("TLS", options_.tls, "list transports known to `ucx_info -d`");
  // The operator's UCX_NET_DEVICES wins; otherwise only the configured interface, so UCX's
  // tcp transport does not listen on every interface of the machine.
  if (const char* env = std::getenv("UCX_NET_DEVICES"); env && *env)
    net_devices_used_ = fmt::format("{} (UCX_NET_DEVICES from the environment)", env);
  else if (!options_.net_devices.empty()) {
    modify("NET_DEVICES", options_.net_devices, "unset UCX_NET_DEVICES or check the node's host address");
    net_devices_used_ = fmt::format("{} (the interface of the node's host)", options_.net_devices);
  } else {
    net_devices_used_ = "all (UCX's default)";
  }
  if (options_.log)
    options_.log(false, fmt::format("KV transport: UCX network devices {}, transports {}", net_devices_used_,
                                    options_.tls.empty() ? "UCX's default" : options_.tls));
}

void kv_engine::create_ep(peer_id id, peer& p, ucp_conn_request_h req) {
  sockaddr_in sa{};
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its endpoint instead of hanging
  ep.err_handler.cb = [](void* arg, ucp_ep_h e, ucs_status_t status) {
    static_cast<kv_engine*>(arg)->on_ep_error(e, status);
  };
  ep.err_handler.arg = this;
  if (req) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = req;
  } else {
    sa.sin_family = AF_INET;
    sa.sin_port = htons(p.port);
    inet_pton(AF_INET, p.ip.c_str(), &sa.sin_addr);
    ep.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep.sockaddr.addrlen = sizeof(sa);
  }
  ucs_status_t s = ucp_ep_create(worker_, &ep, &p.ep);
  if (s != UCS_OK) {
    p.ep = nullptr;
    std::string why = fmt::format("connecting to KV peer {}:{} failed: {}; check the address and that UCX_TLS "
                                  "includes tcp",
                                  p.ip, p.port, ucs_status_string(s));
    last_peer_error_ = why;
    later([this, id, why] { table_.on_peer_failed(id, why); });
    return;
  }
  send_challenge(id, p, req ? kv_role::acceptor : kv_role::dialer);
}

void kv_engine::send_challenge(peer_id id, peer& p, kv_role role) {
  p.auth = std::make_unique<kv_auth>(options_.secret, role, random_nonce());
  send_am(p, am_challenge, encode_challenge(p.auth->challenge(identity_.node)));
  flush(id, p.ep, 0, 1);
}

void kv_engine::send_hello(peer_id id, peer& p) {
  // One region per pool; each rkey is packed for this peer and its buffer released once
  // copied into the message.
  kv_hello h;
  h.id = identity_;
  for (size_t k = 0; k < pools_->size(); ++k) {
    void* rkey_buf = nullptr;
    size_t rkey_size = 0;
    ucs_status_t s = ucp_rkey_pack(context_, memh_[k], &rkey_buf, &rkey_size);
    if (s != UCS_OK) {
      peer_failed(id, p, fmt::format("packing the rkey of KV pool {} failed: {}", k, ucs_status_string(s)));
      return;
    }
    kv_region r{reinterpret_cast<uint64_t>((*pools_)[k].data()), (*pools_)[k].n_pages(), {}};
    r.rkey.assign(static_cast<uint8_t*>(rkey_buf), static_cast<uint8_t*>(rkey_buf) + rkey_size);
    ucp_rkey_buffer_release(rkey_buf);
    if (k == 0) {
      h.pool_base = r.base;
      h.n_pages = r.n_pages;
      h.rkey = std::move(r.rkey);
    } else {
      h.extra_pools.push_back(std::move(r));
    }
  }
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  ucs_status_t s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) {
    peer_failed(id, p, fmt::format("querying the UCX worker address failed: {}", ucs_status_string(s)));
    return;
  }
  h.worker_address.assign(reinterpret_cast<uint8_t*>(addr), reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);
  send_am(p, am_hello, encode_hello(h));
  ++hellos_sent_;
}

void kv_engine::refuse(peer_id id, peer& p, const std::string& why) {
  ++handshakes_refused_;
  // Powers of two: a peer hammering the port cannot flood the log.
  if (options_.log && (handshakes_refused_ & (handshakes_refused_ - 1)) == 0)
    options_.log(true, fmt::format("KV handshake refused ({} so far): {}", handshakes_refused_, why));
  peer_failed(id, p, why);
}

void kv_engine::on_handshake_am(peer_id id, peer& p, unsigned am_id, const uint8_t* bytes, size_t length) {
  if (!p.auth) throw tandem::error("KV handshake message on an endpoint without a handshake");
  if (am_id == am_challenge) {
    kv_challenge c = decode_challenge(bytes, length);
    p.node = c.node;
    if (std::string why = p.auth->on_challenge(c); !why.empty()) return refuse(id, p, why);
    send_am(p, am_proof, encode_proof(p.auth->prove(identity_.node)));
    return;
  }
  if (am_id == am_proof) {
    if (p.authenticated) return refuse(id, p, fmt::format("KV peer '{}' sent a second proof", p.node));
    if (std::string why = p.auth->verify(decode_proof(bytes, length)); !why.empty()) return refuse(id, p, why);
    p.authenticated = true;
    send_hello(id, p);
    return;
  }
  // The hello: only from a peer whose proof passed, under the name it proved.
  if (!p.authenticated || p.hello_received)
    return refuse(id, p, fmt::format("KV peer '{}' sent its hello out of order (before its proof, or twice)", p.node));
  kv_hello h = decode_hello(bytes, length);
  if (h.id.node != p.node)
    return refuse(id, p, fmt::format("KV peer '{}' says it is '{}' in its hello", p.node, h.id.node));
  ++hellos_received_;
  if (std::string why = check_compatible(identity_, h.id); !why.empty()) {
    peer_failed(id, p, why);
    return;
  }
  connect_data(id, p, h.worker_address);
  if (!p.data_ep) return;
  // The sets are equal (check_compatible), so the hello has one region per pool of ours.
  h.extra_pools.insert(h.extra_pools.begin(), kv_region{h.pool_base, h.n_pages, std::move(h.rkey)});
  for (size_t k = 0; k < h.extra_pools.size(); ++k) {
    const kv_region& r = h.extra_pools[k];
    remote_pool rp{nullptr, r.base, r.n_pages};
    ucs_status_t s = ucp_ep_rkey_unpack(p.data_ep, r.rkey.data(), &rp.rkey);
    if (s != UCS_OK) {
      peer_failed(id, p, fmt::format("unpacking the rkey of pool {} of KV peer '{}' failed: {}; the peers need a "
                                     "common transport (UCX_TLS)",
                                     k, p.node, ucs_status_string(s)));
      return;
    }
    p.remote.push_back(rp);
  }
  p.hello_received = true;
  maybe_ready(id, p);
}

}  // namespace tandem::ucx
