#pragma once
/// Actors of different nodes talk through CAF's middleman. Each node publishes one ingress
/// actor on its `cluster_port`; a role that lives on another node is represented locally by
/// a proxy actor with the usual mailbox gate. Between nodes the message is
/// (wire_atom, role, wire): still the Cap'n Proto envelope bytes.
///
/// The envelope's branch (RouterIn, PrefillIn, DecodeIn) names the role a message is for, so
/// the ingress routes it without reading the message itself, and refuses one of another wire
/// protocol version (schema::WIRE_VERSION) or of a kind that never crosses nodes.
/// Mailbox gates are shared-memory counters, so a remote sender cannot pass the receiver's:
/// the ingress applies the local gate on arrival by the same table as a local sender
/// (actors/common/protocol.h: work may be refused, control never) and answers a refused one with an explicit
/// `overloaded` error event to the router (and, for a handoff, an abort of the source's KV
/// send), so a remote sender never blocks and never waits for an answer.
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/protocol.h"
#include "kernels/base/error.h"
#include "actors/common/wire.h"

namespace tandem {

/// Another node's ingress.
struct remote_node {
  std::string name;
  std::string host;
  int32_t cluster_port = 0;
  std::vector<std::string> roles;
  caf::actor ingress;  ///< set by link_nodes
};

struct node_links {
  caf::actor ingress;               ///< this node's, published on its cluster_port
  uint16_t port = 0;                ///< the bound port
  std::vector<remote_node> peers;   ///< connected
  /// The peers with role `role`, in config order.
  std::vector<remote_node> with_role(const std::string& role) const;
};

/// This node's ingress actor, unpublished (link_nodes publishes it; the deterministic
/// simulation, tests/sim, connects it through its own stand-in of the link).
caf::actor spawn_ingress(caf::actor_system& sys, const std::string& node, std::vector<std::string> local_roles,
                         std::shared_ptr<spdlog::logger> log);

/// Spawns and publishes this node's ingress (delivering to `local_roles`), then connects to
/// every peer's ingress, retrying refused connections until `timeout_ms` (the peers may start
/// after us). Throws tandem::error naming the node that could not be reached.
node_links link_nodes(caf::actor_system& sys, const std::string& node, const std::string& host, int32_t port,
                      std::vector<std::string> local_roles, std::vector<remote_node> peers, int64_t timeout_ms,
                      std::shared_ptr<spdlog::logger> log);

/// A local stand-in for `role` on `targets` (one or more nodes with that role): submissions
/// and requeues go round-robin over the reachable ones, aborts to all, a handoff to the node
/// its request's decode_target names ("node/decode"; refused with an explicit error if that
/// node is down, never sent elsewhere: its KV pages go there), the rest to the first
/// reachable. When no target is reachable, work is answered like a refusal at the ingress
/// (`disconnected` instead of `overloaded`). Messages: (wire_atom, wire), (peers_atom,
/// peer_set), (stats_atom) -> wire.
/// With `notify_router` (the router runs on this node), the proxy tells the router when one
/// of its targets goes down (node_down_atom with the target "node/role", router.h), so the
/// router routes around it and ends the requests it held at once.
/// `name` names its mailbox gate and stats (default: `role`); per-node proxies of one role
/// need distinct names. `dialer` (tests): redials go to it instead of the middleman actor, with
/// the middleman's (connect_atom, host, port) request and answer. With `notify_local`, the scheduler of this node on the other side of
/// the KV handoff hears the same down/up notices (node_down_atom / node_up_atom with the target
/// "node/role"): a prefill scheduler passes its unreachable decode nodes on to the router
/// (Credit.unreachable: a decode node is routable only once the prefill nodes reach it again);
/// a decode scheduler fails at once, by policy, the handoffs whose KV was on a prefill node
/// that died.
bounded_actor spawn_remote_proxy(caf::actor_system& sys, const std::string& role, std::vector<remote_node> targets,
                                 int32_t bound, bool notify_router, std::shared_ptr<spdlog::logger> log,
                                 const std::string& name = "", bool notify_local = false,
                                 caf::actor dialer = {});

/// Answers an envelope that cannot be delivered: a submission or requeue gets an error event
/// to the router; a handoff an error event and an abort of the source's send to the prefill.
/// Everything else is dropped (control messages of requests that end anyway).
void bounce(const peer_set& peers, const wire& w, const tandem::error& e);

}  // namespace tandem
