/// Spawning and wiring one set of a node's actors (at start and on every restart): the worker,
/// cache tier, schedulers and router, or proxies for the roles other nodes run.
#include "actors/runtime/actor_cluster_state.h"
#include "actors/runtime/node_plan_views.h"

namespace tandem::cluster_detail {

namespace {


/// The proxy for a role of other nodes, over all its nodes (what a local scheduler sends
/// to: handoffs go to the decode node the router chose), or an empty handle if no other node
/// has it.
bounded_actor remote_role(actor_cluster::state& s, const actor_cluster_options& opt, node_role kind, int32_t bound) {
  const std::string role = to_string(kind);
  auto targets = s.links.with_role(role);
  if (targets.empty()) return {};
  return spawn_remote_proxy(*s.sys, role, std::move(targets), bound, false,
                            make_actor_logger("proxy_" + role, s.sink, opt.log_level), "",
                            (kind == node_role::decode && s.has(node_role::prefill)) ||
                                (kind == node_role::prefill && s.has(node_role::decode)));
}

/// The router's targets for `role`: the local scheduler (named `node/role`, as its credits),
/// or one proxy per other node with the role (added to s.route_proxies). A proxy's mailbox is
/// named after the role when it is the role's only stand-in here, else after its target.
std::vector<route_target> route_targets(actor_cluster::state& s, const actor_cluster_options& opt,
                                        node_role kind, const bounded_actor& local, int32_t bound) {
  const std::string role = to_string(kind);
  if (s.has(kind)) return {route_target{s.plan.spec.node_name + "/" + role, local}};
  std::vector<route_target> v;
  auto nodes = s.links.with_role(role);
  const bool alone = nodes.size() == 1 && !local;
  for (auto& n : nodes) {
    const std::string target = n.name + "/" + role;
    auto a = spawn_remote_proxy(*s.sys, role, {n}, bound, true,
                                make_actor_logger("proxy_" + role, s.sink, opt.log_level), alone ? role : target);
    s.route_proxies.push_back(a);
    v.push_back(route_target{target, a});
  }
  return v;
}

/// The router over every prefill and decode target this node reaches (local or proxied).
bounded_actor spawn_router_for(actor_cluster::state& s, const actor_cluster_options& opt) {
  const router_options ro = router_options_of(s.plan);
  auto prefills = route_targets(s, opt, node_role::prefill, s.prefill, ro.lim.prefill_mailbox);
  auto decodes = route_targets(s, opt, node_role::decode, s.decode, ro.lim.decode_mailbox);
  if (prefills.empty())
    throw tandem::error(error_kind::failed,
                        fmt::format("node {} runs the router but no node has the prefill role; give one node it",
                                    s.plan.spec.node_name));
  return spawn_router(*s.sys, ro, std::move(prefills), std::move(decodes), s.clk,
                      make_actor_logger("router", s.sink, opt.log_level));
}

/// Sends the peer set to the proxies (they answer undeliverable work to the router through it).
void send_peers_to_proxies(actor_cluster::state& s, const peer_set& peers) {
  for (auto& p : s.route_proxies) caf::anon_send(p.handle, peers_atom::value, peers);
}

}  // namespace

void spawn_set(actor_cluster::state& s, const actor_cluster_options& opt) {
  s.route_proxies.clear();  // a restart sent the old ones their exit with the rest
  if (!s.has(node_role::worker)) {
    // A router-only node: the front ends and the router over one proxy per remote node.
    s.worker = s.cache = s.prefill = s.decode = bounded_actor{};
    s.router = spawn_router_for(s, opt);
    peer_set peers{s.router, {}, {}, {}, {}};
    send_peers_to_proxies(s, peers);
    if (s.links.ingress) caf::anon_send(s.links.ingress, peers_atom::value, peers);
    return;
  }
  const limits& lim = s.plan.spec.lim;
  // The plan's view for each role, plus what only this process has.
  worker_options wo = worker_options_of(s.plan);
  wo.kv_transfer = opt.kv_transfer;
  wo.device = opt.device;
  wo.detached = opt.system == nullptr;  // a given system's scheduler (the test scheduler) runs it
  wo.fail_at_start = opt.worker_fails_at_start;
  wo.grammar_vocab = opt.grammar_vocab;
  s.worker = spawn_worker(*s.sys, s.model, wo, make_actor_logger("worker", s.sink, opt.log_level));

  const cache_tier_options co = cache_tier_options_of(s.plan);
  s.cache = spawn_cache_tier(*s.sys, co, s.worker, make_actor_logger("cache_tier", s.sink, opt.log_level));

  const scheduler_options so = scheduler_options_of(s.plan);
  s.prefill = s.has(node_role::prefill)
                  ? spawn_prefill_scheduler(*s.sys, so, s.clk, make_actor_logger("prefill", s.sink, opt.log_level))
                  : remote_role(s, opt, node_role::prefill, lim.prefill_mailbox);
  s.decode = s.has(node_role::decode)
                 ? spawn_decode_scheduler(*s.sys, so, s.clk, make_actor_logger("decode", s.sink, opt.log_level))
                 : remote_role(s, opt, node_role::decode, lim.decode_mailbox);

  s.router = s.has(node_role::router) ? spawn_router_for(s, opt) : remote_role(s, opt, node_role::router, lim.router_mailbox);

  peer_set peers{s.router, s.prefill, s.decode, s.worker, s.cache};
  // The worker first: it frees the pages of the KV sends the prefill orders once it has them.
  caf::anon_send(s.worker.handle, peers_atom::value, peers);
  for (auto* a : {&s.prefill, &s.decode, &s.router})
    if (a->handle && (a != &s.router || !s.has(node_role::router))) caf::anon_send(a->handle, peers_atom::value, peers);
  send_peers_to_proxies(s, peers);
  if (s.links.ingress) caf::anon_send(s.links.ingress, peers_atom::value, peers);
  if (s.draining)  // restarted while draining: the new actors drain too
    for (auto [role, a] : {std::pair{node_role::router, &s.router}, std::pair{node_role::prefill, &s.prefill},
                           std::pair{node_role::decode, &s.decode}})
      if (s.has(role) && a->handle) caf::anon_send(a->handle, drain_atom::value, true);
}

std::vector<supervised_child> children_of(actor_cluster::state& s) {
  std::vector<supervised_child> v;
  for (auto [name, a] : {std::pair{"router", &s.router}, std::pair{"prefill", &s.prefill},
                         std::pair{"decode", &s.decode}, std::pair{"worker", &s.worker},
                         std::pair{"cache_tier", &s.cache}})
    if (a->handle) v.push_back({name, a->handle});
  for (auto& p : s.route_proxies) v.push_back({p.gate->actor_name(), p.handle});
  return v;
}


}  // namespace tandem::cluster_detail
