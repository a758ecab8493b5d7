#include "tests/sim/cluster_world.h"

#include <algorithm>

#include "actors/cache_tier/cache_tier.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/runtime/node_plan_views.h"
#include "actors/worker/worker.h"

namespace tandem::sim::cluster {

bool cworld::link_ok(int32_t a, int32_t b) const {
  auto it = down_until.find({std::min(a, b), std::max(a, b)});
  return it == down_until.end() || now() >= it->second;
}

void cworld::flush(link_actor_t* self) {
  auto& s = self->state;
  while (!s.q.empty() && s.q.front().first <= now()) {
    // The receiving side of BASP: the bytes become a message again.
    caf::message m;
    caf::binary_deserializer src{*sys, s.q.front().second};
    if (auto err = src(m)) violate(fmt::format("link {}->{}: a message does not deserialize", s.from, s.to));
    s.q.pop_front();
    if (nodes[size_t(s.to)].up) caf::anon_send(nodes[size_t(s.to)].ingress, std::move(m));
  }
  if (!s.q.empty() && !s.timer) {
    s.timer = true;
    self->delayed_send(self, std::chrono::milliseconds(s.q.front().first - now()), flush_atom::value);
  }
}

caf::actor cworld::link(int32_t from, int32_t to) {
  auto& l = links[{from, to}];
  if (l) return l;
  l = spawn_fn<link_actor_t>(*sys, [this, from, to](link_actor_t* self) -> caf::behavior {
    self->state.w = this;
    self->state.from = from;
    self->state.to = to;
    return {
        [self](wire_atom, const std::string& role, const wire& w) {
          auto& s = self->state;
          auto* world = s.w;
          std::vector<char> buf;
          caf::binary_serializer sink{*world->sys, buf};
          auto m = caf::make_message(wire_atom::value, role, w);
          if (auto err = sink(m)) world->violate("a cross-node message does not serialize");
          int64_t due = world->now();
          if (world->rng.chance(world->f.link_delay)) due += world->rng.between(1, world->f.max_link_delay_ms);
          if (!s.q.empty()) due = std::max(due, s.q.back().first);  // TCP keeps the order
          s.q.emplace_back(due, std::move(buf));
          world->flush(self);
        },
        [self](flush_atom) {
          self->state.timer = false;
          self->state.w->flush(self);
        },
    };
  });
  return l;
}

void cworld::cut(int32_t from, int32_t to) {
  auto it = links.find({from, to});
  if (it == links.end()) return;
  caf::anon_send_exit(it->second, caf::exit_reason::remote_link_unreachable);
  dead_links[{from, to}] = it->second;
  links.erase(it);
}

caf::actor cworld::spawn_dialer(int32_t from) {
  return spawn_fn<caf::event_based_actor>(*sys, [this, from](caf::event_based_actor*) -> caf::behavior {
    return {[this, from](caf::connect_atom, const std::string& host,
                         uint16_t) -> caf::result<caf::node_id, caf::strong_actor_ptr, std::set<std::string>> {
      int32_t to = -1;
      for (size_t i = 0; i < nodes.size(); ++i)
        if (nodes[i].name == host) to = int32_t(i);
      if (to < 0 || !nodes[size_t(to)].up || !nodes[size_t(from)].up || !link_ok(from, to)) {
        // Sometimes the middleman hands out its cached proxy of the dead connection: the proxy
        // must see that it is the handle it lost, probe it (stats) and back off.
        auto stale = dead_links.find({from, to});
        if (rng.chance(0.5) && stale != dead_links.end()) {
          note(fmt::format("dial {}->{}: the stale handle of the cut link", nodes[size_t(from)].name, host));
          return {caf::node_id{}, caf::actor_cast<caf::strong_actor_ptr>(stale->second), std::set<std::string>{}};
        }
        return caf::make_error(caf::sec::cannot_connect_to_node);
      }
      const bool fresh = !links.count({from, to});
      auto l = link(from, to);
      if (fresh) note(fmt::format("link {}->{} redialled", nodes[size_t(from)].name, host));
      return {caf::node_id{}, caf::actor_cast<caf::strong_actor_ptr>(l), std::set<std::string>{}};
    }};
  });
}

remote_node cworld::remote(int32_t from, int32_t to, const std::string& role) {
  remote_node r;
  r.name = nodes[size_t(to)].name;
  r.host = r.name;
  r.cluster_port = 1000 + to;
  r.roles = {role};
  r.ingress = link(from, to);  // cut at once if the peer is not reachable (cut_unreachable)
  return r;
}

node_spec cworld::spec_for(int32_t i) const {
  const auto& n = nodes[size_t(i)];
  auto role_of = [](role_kind k) {
    return k == role_kind::router ? node_role::router : k == role_kind::prefill ? node_role::prefill : node_role::decode;
  };
  node_spec s;
  s.lim = lim;
  s.lim.device_pages = n.n_pages;  // this node's drawn pool size
  // The sim caches prefixes on prefill nodes only (a decode node's cache tier caches nothing).
  s.lim.prefix_cache = lim.prefix_cache && n.role == role_kind::prefill;
  s.node_name = n.name;
  s.roles = {role_of(n.role)};
  if (n.role != role_kind::router) s.roles.insert(s.roles.end(), {node_role::cache, node_role::worker});
  for (size_t j = 0; j < nodes.size(); ++j)
    if (int32_t(j) != i)
      s.remote_nodes.push_back({nodes[j].name, nodes[j].name, 1000 + int32_t(j), {to_string(role_of(nodes[j].role))}, {}});
  s.transfer_failure_policy = parse_kv_failure_policy(f.failure_policy).value();
  return s;
}

std::vector<int32_t> cworld::with(role_kind k) const {
  std::vector<int32_t> v;
  for (size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].role == k) v.push_back(int32_t(i));
  return v;
}

void cworld::spawn_node(int32_t i) {
  auto& n = nodes[size_t(i)];
  n.up = true;
  n.proxies.clear();
  n.dialer = spawn_dialer(i);
  const std::string role = n.role == role_kind::router ? "router" : n.role == role_kind::prefill ? "prefill" : "decode";
  n.ingress = spawn_ingress(*sys, n.name, {role}, lg("ingress"));
  auto proxy = [&](const std::string& r, std::vector<int32_t> to, bool notify_router, const std::string& name,
                   bool notify_local) {
    std::vector<remote_node> t;
    for (int32_t j : to) t.push_back(remote(i, j, r));
    auto p = spawn_remote_proxy(*sys, r, std::move(t), r == "router" ? lim.router_mailbox
                                                       : r == "prefill" ? lim.prefill_mailbox
                                                                        : lim.decode_mailbox,
                                notify_router, lg("proxy"), name, notify_local, n.dialer);
    p.gate->set_fault(shared_self());
    n.proxies.push_back(p);
    return p;
  };
  if (n.role == role_kind::router) {
    std::vector<route_target> pre, dec;
    for (int32_t j : with(role_kind::prefill))
      pre.push_back({nodes[size_t(j)].name + "/prefill", proxy("prefill", {j}, true, nodes[size_t(j)].name + "/prefill", false)});
    for (int32_t j : with(role_kind::decode))
      dec.push_back({nodes[size_t(j)].name + "/decode", proxy("decode", {j}, true, nodes[size_t(j)].name + "/decode", false)});
    const router_options ro = router_options_of(sim_plan(spec_for(i), *model));
    n.sched = spawn_router(*sys, ro, std::move(pre), std::move(dec), clk, lg("router"));
    n.sched.gate->set_fault(shared_self());
    peer_set peers{n.sched, {}, {}, {}, {}};
    for (auto& p : n.proxies) caf::anon_send(p.handle, peers_atom::value, peers);
    caf::anon_send(n.ingress, peers_atom::value, peers);
    cut_unreachable(i);
    return;
  }
  const node_plan plan = sim_plan(spec_for(i), *model);
  worker_options wo = worker_options_of(plan);
  wo.detached = false;
  wo.kv_transfer = fabric->factory(n.name);
  n.worker = spawn_worker(*sys, model, wo, lg("worker"));
  n.worker.gate->set_fault(shared_self());
  const cache_tier_options co = cache_tier_options_of(plan);
  n.cache = spawn_cache_tier(*sys, co, n.worker, lg("cache_tier"));
  n.cache.gate->set_fault(shared_self());
  scheduler_options so = scheduler_options_of(plan);
  auto router = proxy("router", with(role_kind::router), false, "", false);
  bounded_actor prefill, decode;
  if (n.role == role_kind::prefill) {
    so.remote_decode_node = nodes[size_t(with(role_kind::decode).front())].name;
    n.sched = spawn_prefill_scheduler(*sys, so, clk, lg("prefill"));
    prefill = n.sched;
    decode = proxy("decode", with(role_kind::decode), false, "", true);
  } else {
    n.sched = spawn_decode_scheduler(*sys, so, clk, lg("decode"));
    decode = n.sched;
    prefill = proxy("prefill", with(role_kind::prefill), false, "", true);
  }
  n.sched.gate->set_fault(shared_self());
  peer_set peers{router, prefill, decode, n.worker, n.cache};
  caf::anon_send(n.worker.handle, peers_atom::value, peers);  // first, as the wiring does
  caf::anon_send(n.sched.handle, peers_atom::value, peers);
  for (auto& p : n.proxies) caf::anon_send(p.handle, peers_atom::value, peers);
  caf::anon_send(n.ingress, peers_atom::value, peers);
  cut_unreachable(i);
}

void cworld::cut_unreachable(int32_t i) {
  for (size_t j = 0; j < nodes.size(); ++j)
    if (int32_t(j) != i && (!nodes[j].up || !link_ok(i, int32_t(j)))) cut(i, int32_t(j));
}

void cworld::kill_node(int32_t i, const char* why, bool fault) {
  auto& n = nodes[size_t(i)];
  if (!n.up) return;
  if (fault) {
    ++faults;
    note(fmt::format("fault: node {} {}", n.name, why));
  }
  n.up = false;
  fabric->node_down(n.name);
  for (size_t j = 0; j < nodes.size(); ++j) {
    cut(i, int32_t(j));
    cut(int32_t(j), i);
  }
  for (auto* a : n.gated()) caf::anon_send_exit(a->handle, caf::exit_reason::kill);
  caf::anon_send_exit(n.ingress, caf::exit_reason::kill);
  caf::anon_send_exit(n.dialer, caf::exit_reason::kill);
  n.sched = n.worker = n.cache = bounded_actor{};
  n.proxies.clear();
}

void cworld::restart_node(int32_t i) {
  auto& n = nodes[size_t(i)];
  if (n.up) return;
  ++restarts;
  ++n.incarnation;
  note(fmt::format("node {} restarts", n.name));
  spawn_node(i);
}

void cworld::flap(int32_t a, int32_t b, int64_t ms) {
  ++faults;
  note(fmt::format("fault: link {}<->{} down for {} ms", nodes[size_t(a)].name, nodes[size_t(b)].name, ms));
  down_until[{std::min(a, b), std::max(a, b)}] = now() + ms;
  fabric->partition(nodes[size_t(a)].name, nodes[size_t(b)].name, now() + ms);  // the KV connection too
  cut(a, b);
  cut(b, a);
}

void cworld::start() {
  start_system();
  model = std::make_shared<test::fake_model>();
  kv_fault_menu kf;
  kf.drop = f.kv_drop;
  kf.delay = f.kv_delay;
  kf.max_delay_ms = f.kv_max_delay_ms;
  kf.duplicate = f.kv_duplicate;
  kf.corrupt = f.kv_corrupt;
  kf.put_fail = f.kv_put_fail;
  ucx::transfer_limits tl;
  tl.bootstrap_ms = rng.between(100, 1000);
  tl.waiting_ms = rng.between(200, 2000);
  tl.transferring_ms = rng.between(100, 1000);
  tl.quarantine_ms = rng.between(100, 1000);
  tl.max_transfers = size_t(rng.between(1, 8));
  fabric = std::make_unique<kv_fabric>(*clk, rng, kf, tl, [this](std::string s) { note(std::move(s)); });
  nodes.push_back({"r", role_kind::router});
  for (int i = 0; i < f.prefill_nodes; ++i) nodes.push_back({fmt::format("p{}", i), role_kind::prefill});
  for (int i = 0; i < f.decode_nodes; ++i) nodes.push_back({fmt::format("d{}", i), role_kind::decode});
  for (auto& n : nodes) n.n_pages = static_cast<int32_t>(rng.between(6, 32));
  for (size_t i = 0; i < nodes.size(); ++i) fabric->factory(nodes[i].name);  // stable peer ids
  for (size_t i = 0; i < nodes.size(); ++i) spawn_node(int32_t(i));
}

}  // namespace tandem::sim::cluster
