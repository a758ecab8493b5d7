#include "actors/runtime/remote_link.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <caf/io/all.hpp>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include <optional>

#include "actors/common/metrics.h"
#include "actors/common/protocol.h"
#include "actors/common/request.h"
#include "actors/router/router.h"

namespace tandem {

std::vector<remote_node> node_links::with_role(const std::string& role) const {
  std::vector<remote_node> v;
  for (const auto& p : peers)
    if (std::find(p.roles.begin(), p.roles.end(), role) != p.roles.end()) v.push_back(p);
  return v;
}

void bounce(const peer_set& peers, const wire& w, const tandem::error& e) {
  try {
    wire_reader rd(w);
    auto env = rd.root();
    schema::SubmitRequest::Reader r;
    bool handoff = false;
    if (env.isPrefill() && env.getPrefill().isSubmit())
      r = env.getPrefill().getSubmit();
    else if (env.isPrefill() && env.getPrefill().isRequeue())
      r = env.getPrefill().getRequeue();
    else if (env.isRouter() && env.getRouter().isRequeue())
      r = env.getRouter().getRequeue();  // a decode node's requeue while the router's node is down
    else if (env.isDecode() && env.getDecode().isSubmit())
      r = env.getDecode().getSubmit();
    else if (env.isDecode() && env.getDecode().isHandoff()) {
      r = env.getDecode().getHandoff().getRequest();
      handoff = true;
    } else
      return;
    const std::string id = r.getId().cStr();
    // A refused handoff is the decode side's failure (state "decode"): the router counts it
    // against the decode node it names, and the request may continue on another one.
    if (peers.router)
      peers.router.send_anon(make_event(id, {}, finish_reason::error, &e, static_cast<int32_t>(r.getPrompt().size()),
                                        r.getCachedTokens(), handoff ? request_stage::decode : request_stage::refused,
                                        static_cast<int32_t>(r.getGenerated().size())));
    if (handoff && peers.prefill)
      peers.prefill.send_anon<msg::abort>([&](schema::Abort::Builder a) {
        a.setId(id);
        a.setHops(8);  // only the source's KV send; do not chase
      });
  } catch (const std::exception&) {
    // Malformed: nothing to answer.
  }
}

namespace {

struct ingress_state {
  std::string node;
  std::vector<std::string> local_roles;
  peer_set peers;
  std::shared_ptr<spdlog::logger> log;
  std::map<std::string, int64_t> delivered, refused;
  int64_t unknown = 0;
  int64_t version_mismatch = 0;  ///< messages of another schema::WIRE_VERSION
  static inline const char* name = "ingress";

  bool runs(const std::string& role) const {
    return std::find(local_roles.begin(), local_roles.end(), role) != local_roles.end();
  }
};

enum class admit_result { delivered, refused, not_wired, misrouted };

/// Hands `w` (a message of `Role`, read as `in`) to the local actor of that role through its
/// gate (the table in protocol.h), if this node runs the role and the kind may cross nodes.
template <class Role>
admit_result admit_local(const ingress_state& s, const role_handle<Role>& to, typename Role::in::Reader in,
                         const wire& w) {
  if (!s.runs(Role::name)) return admit_result::misrouted;
  if (!to) return admit_result::not_wired;
  bool known = false;
  gate_of<Role>(in.which(), &known);
  if (!known || !is_cast<Role>(in.which())) return admit_result::misrouted;  // local-only kinds never cross
  return to.forward_remote(w, in.which()) ? admit_result::delivered : admit_result::refused;
}

caf::behavior ingress_actor(caf::stateful_actor<ingress_state>* self, std::string node,
                            std::vector<std::string> local_roles, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.node = std::move(node);
  st.local_roles = std::move(local_roles);
  st.log = std::move(log);
  return {
      [self](peers_atom, const peer_set& p) { self->state.peers = p; },
      [self](wire_atom, const std::string& role, const wire& w) {
        auto& s = self->state;
        // The envelope names its role (the union branch): that decides where it goes; the
        // link's role string must agree.
        admit_result r = admit_result::misrouted;
        std::shared_ptr<mailbox_gate> gate;
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.getVersion() != schema::WIRE_VERSION) {
            ++s.version_mismatch;
            s.log->error("ingress: a message of wire protocol {} for role '{}' (node {} speaks {}); dropped: run the "
                         "same tandem build on every node",
                         env.getVersion(), role, s.node, schema::WIRE_VERSION);
            return;
          }
          if (env.isRouter() && role == router_role::name) {
            r = admit_local(s, s.peers.router, env.getRouter(), w);
            gate = s.peers.router.gate;
          } else if (env.isPrefill() && role == prefill_role::name) {
            r = admit_local(s, s.peers.prefill, env.getPrefill(), w);
            gate = s.peers.prefill.gate;
          } else if (env.isDecode() && role == decode_role::name) {
            r = admit_local(s, s.peers.decode, env.getDecode(), w);
            gate = s.peers.decode.gate;
          }
        } catch (const std::exception& e) {
          ++s.unknown;
          s.log->warn("ingress: malformed message for role '{}' dropped: {}", role, e.what());
          return;
        }
        switch (r) {
          case admit_result::delivered:
            ++s.delivered[role];
            return;
          case admit_result::refused:
            ++s.refused[role];
            bounce(s.peers, w, gate->overloaded_error());
            return;
          case admit_result::not_wired:
            // Arrived before this node's actors were wired (a first credit; the router asks again).
            ++s.unknown;
            s.log->info("ingress: message for role '{}' before node {} wired its actors; dropped", role, s.node);
            return;
          case admit_result::misrouted:
            ++s.unknown;
            s.log->warn("ingress: message for role '{}', which node {} does not run or which is not that role's "
                        "(or not one that crosses nodes); dropped",
                        role, s.node);
            return;
        }
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m;
        for (const auto& r : s.local_roles) {
          if (r != "router" && r != "prefill" && r != "decode") continue;
          auto lbl = fmt::format("role=\"{}\"", r);
          m.push_back({"ingress_delivered_total", lbl, double(s.delivered[r]), "counter",
                       "Messages from other nodes delivered to a local actor"});
          m.push_back({"ingress_refused_total", lbl, double(s.refused[r]), "counter",
                       "Work from other nodes refused at a full local mailbox (answered overloaded)"});
        }
        m.push_back({"ingress_misrouted_total", "", double(s.unknown), "counter",
                     "Messages from other nodes for a role this node does not run"});
        m.push_back({"ingress_version_mismatch_total", "", double(s.version_mismatch), "counter",
                     "Messages from other nodes of another wire protocol version (another tandem build), dropped"});
        return make_stats_wire("ingress", m, {});
      },
  };
}

struct proxy_target {
  remote_node node;
  bool up = true;
  int64_t sent = 0;
  int32_t redial_ms = 0;     ///< next redial backoff while down
  int64_t reconnects = 0;    ///< times the node came back after it went down
};

using redial_atom = caf::atom_constant<caf::atom("redial")>;
/// First redial of a node that went down, doubling up to the cap: a restarted node is found
/// again within about a second of listening, and a dead one costs one connect every 2 s.
constexpr int32_t redial_first_ms = 100, redial_max_ms = 2000;
/// Hops of a chased abort once a proxy fanned it out to several nodes: the schedulers chase while
/// hops < 8, so it goes one hop further at most.
constexpr int32_t max_fanout_abort_hops = 7;

struct proxy_state {
  std::string role;
  std::vector<proxy_target> targets;
  std::shared_ptr<mailbox_gate> gate;
  peer_set peers;
  std::shared_ptr<spdlog::logger> log;
  size_t next = 0;
  int64_t bounced = 0;
  int64_t aborts_capped = 0;  ///< chased aborts fanned out with their chase capped
  bool notify_router = false;
  /// Tell this node's scheduler on the other side of the KV handoff (prefill for a decode
  /// proxy, decode for a prefill proxy) which nodes of the role are down and up.
  bool notify_local = false;
  caf::actor dialer;  ///< answers redials instead of the middleman (tests)
  /// This node's scheduler on the other side of the KV handoff.
  bounded_actor local_peer() const { return role == "decode" ? peers.prefill.untyped() : peers.decode.untyped(); }
  static inline const char* name = "proxy";

  proxy_target* pick(bool round_robin) {
    for (size_t k = 0; k < targets.size(); ++k) {
      size_t i = round_robin ? (next + k) % targets.size() : k;
      if (!targets[i].up) continue;
      if (round_robin) next = i + 1;
      return &targets[i];
    }
    return nullptr;
  }
  std::string names() const {
    std::string v;
    for (const auto& t : targets) v += (v.empty() ? "" : ", ") + t.node.name;
    return v;
  }
  /// The route target `name` ("node/role"), or nullptr.
  proxy_target* named(const std::string& name) {
    for (auto& t : targets)
      if (t.node.name + "/" + role == name) return &t;
    return nullptr;
  }
};

/// The decode target a handoff names ("" for anything else, or a handoff naming none).
std::string handoff_target(schema::Envelope::Reader env) {
  if (!env.isDecode() || !env.getDecode().isHandoff()) return "";
  return env.getDecode().getHandoff().getRequest().getDecodeTarget().cStr();
}

/// The Abort in `env` (of whichever role), if it is one.
std::optional<schema::Abort::Reader> abort_of(schema::Envelope::Reader env) {
  if (env.isPrefill() && env.getPrefill().isAbort()) return env.getPrefill().getAbort();
  if (env.isDecode() && env.getDecode().isAbort()) return env.getDecode().getAbort();
  if (env.isRouter() && env.getRouter().isAbort()) return env.getRouter().getAbort();
  return std::nullopt;
}

/// A submission or requeue (round-robin over the role's nodes).
bool is_submission(schema::Envelope::Reader env) {
  return (env.isPrefill() && (env.getPrefill().isSubmit() || env.getPrefill().isRequeue())) ||
         (env.isDecode() && env.getDecode().isSubmit()) || (env.isRouter() && env.getRouter().isRequeue());
}

/// `env` (an abort) again, in its role, with `hops`.
wire with_hops(schema::Envelope::Reader env, int32_t hops) {
  capnp::MallocMessageBuilder mb;
  mb.setRoot(env);
  auto b = mb.getRoot<schema::Envelope>();
  if (b.isPrefill()) b.getPrefill().getAbort().setHops(hops);
  else if (b.isDecode()) b.getDecode().getAbort().setHops(hops);
  else b.getRouter().getAbort().setHops(hops);
  return make_wire(mb);
}

using proxy_actor_t = caf::stateful_actor<proxy_state>;

/// A target node's ingress went down: its messages are answered here from now on, the router
/// and this node's scheduler on the other side of the handoff hear it, and redialling starts.
void on_target_down(proxy_actor_t* self, caf::down_msg& dm) {
  auto& s = self->state;
  for (size_t i = 0; i < s.targets.size(); ++i) {
    auto& t = s.targets[i];
    if (t.node.ingress.address() != dm.source || !t.up) continue;
    t.up = false;
    s.log->warn("{} node {} is down ({}); its {} messages are answered here", s.role, t.node.name,
                self->system().render(dm.reason), s.role);
    if (s.notify_router && s.peers.router)
      // The router routes to this node by name: it stops choosing it and ends what it held.
      caf::anon_send(s.peers.router.handle, node_down_atom::value, s.role, t.node.name + "/" + s.role,
                     fmt::format("{} node {} is down ({})", s.role, t.node.name, self->system().render(dm.reason)));
    if (s.notify_local && s.local_peer())
      caf::anon_send(s.local_peer().handle, node_down_atom::value, s.role, t.node.name + "/" + s.role,
                     fmt::format("{} node {} is down", s.role, t.node.name));
    // A node that went down may come back (restarted by systemd or by hand, or a link that
    // recovers): dial it again with backoff, for as long as this proxy lives.
    t.redial_ms = redial_first_ms;
    self->delayed_send(self, std::chrono::milliseconds(t.redial_ms), redial_atom::value, static_cast<uint64_t>(i));
  }
}

/// Dials target `i` again (with backoff until it answers); a new or re-answering ingress
/// brings it back up.
void redial(proxy_actor_t* self, uint64_t i) {
  auto& s = self->state;
  if (i >= s.targets.size() || s.targets[i].up) return;
  const auto& n = s.targets[i].node;
  auto again = [self, i] {
    auto& t = self->state.targets[i];
    t.redial_ms = std::min(2 * t.redial_ms, redial_max_ms);
    self->delayed_send(self, std::chrono::milliseconds(t.redial_ms), redial_atom::value, i);
  };
  // The middleman dials on its own thread; this actor stays responsive meanwhile.
  auto mm = s.dialer ? s.dialer : caf::actor_cast<caf::actor>(self->system().middleman().actor_handle());
  self->request(mm, std::chrono::seconds(10), caf::connect_atom::value,
                n.host, static_cast<uint16_t>(n.cluster_port))
      .then(
          [self, i, again](const caf::node_id&, caf::strong_actor_ptr& ptr, const std::set<std::string>&) {
            auto& s = self->state;
            auto& t = s.targets[i];
            if (t.up) return;
            auto a = caf::actor_cast<caf::actor>(ptr);
            if (!a) {
              again();  // nothing answers yet
              return;
            }
            auto up = [self, i, a] {
              auto& s = self->state;
              auto& t = s.targets[i];
              if (t.up) return;
              t.node.ingress = a;
              t.up = true;
              t.reconnects += 1;
              self->monitor(a);
              s.log->warn("{} node {} is reachable again ({}:{}); its {} messages go there", s.role,
                          t.node.name, t.node.host, t.node.cluster_port, s.role);
              if (s.notify_router && s.peers.router)
                caf::anon_send(s.peers.router.handle, node_up_atom::value, s.role, t.node.name + "/" + s.role);
              if (s.notify_local && s.local_peer())
                caf::anon_send(s.local_peer().handle, node_up_atom::value, s.role, t.node.name + "/" + s.role);
            };
            if (a.address() != t.node.ingress.address()) {
              up();  // a restarted node: a new ingress
              return;
            }
            // The same ingress: a link that dropped while the node lived on (two nodes
            // dialing each other at once can lose one of the connections), or a stale
            // cached handle of a dead node. Only an answer tells them apart.
            self->request(a, std::chrono::seconds(1), stats_atom::value)
                .then([up](const wire&) { up(); }, [again](caf::error&) { again(); });
          },
          [again](caf::error&) { again(); });
}

/// Passes a message on to the role's nodes: an abort to every node, a handoff to the decode
/// node it names, a submission round-robin, anything else to the first node up; a message no
/// node can take is answered here (bounce).
void pass_on(proxy_actor_t* self, const wire& w) {
  auto& s = self->state;
  s.gate->leave();
  bool rr = false, all = false;
  std::string named;
  wire out = w;
  try {
    wire_reader rd(w);
    auto env = rd.root();
    rr = is_submission(env);
    const auto ab = abort_of(env);
    all = ab.has_value();
    named = handoff_target(env);
    if (all && s.targets.size() > 1 && ab->getHops() > 0 && ab->getHops() < max_fanout_abort_hops) {
      // A chased abort (a scheduler that did not hold the request follows it) reaches every
      // node of the role, and each that does not hold it either would chase it on to every
      // node of the other role: (prefill x decode nodes)^4 messages over the 8 hops. From a
      // fan-out on it may go one hop further only (the requeues that move a request back to
      // prefill go through the router, which ends them once the request is aborted).
      out = with_hops(env, max_fanout_abort_hops);
      ++s.aborts_capped;
    }
  } catch (const std::exception&) {
    s.log->error("proxy {}: malformed message dropped", s.role);
    return;
  }
  if (all) {
    for (auto& t : s.targets)
      if (t.up) {
        ++t.sent;
        caf::anon_send(t.node.ingress, wire_atom::value, s.role, out);
      }
    return;
  }
  if (!named.empty()) {
    // The router chose this decode node and the KV pages are on their way to it: it, or
    // an explicit error (which also stops the KV send), never another node.
    proxy_target* t = s.named(named);
    if (!t || !t->up) {
      ++s.bounced;
      bounce(s.peers, w,
             t ? tandem::error(error_kind::disconnected,
                               fmt::format("{} node {} the router chose is not reachable; retry the request",
                                           s.role, t->node.name))
               : tandem::error(error_kind::failed,
                               fmt::format("handoff names {} target {}, which is no {} node of this config "
                                           "(known: {}); give every node the same config",
                                           s.role, named, s.role, s.names())));
      return;
    }
    ++t->sent;
    caf::anon_send(t->node.ingress, wire_atom::value, s.role, w);
    return;
  }
  proxy_target* t = s.pick(rr);
  if (!t) {
    ++s.bounced;
    bounce(s.peers, w,
           tandem::error(error_kind::disconnected,
                         fmt::format("no {} node is reachable (configured: {}); retry when one is back", s.role,
                                     s.names())));
    return;
  }
  ++t->sent;
  caf::anon_send(t->node.ingress, wire_atom::value, s.role, w);
}

wire proxy_stats(proxy_actor_t* self) {
  auto& s = self->state;
  std::vector<metric_sample> m;
  for (const auto& t : s.targets) {
    auto lbl = fmt::format("role=\"{}\",peer=\"{}\"", s.role, t.node.name);
    m.push_back({"remote_node_up", lbl, t.up ? 1.0 : 0.0, "gauge",
                 "1 while the node running a remote role is connected, else 0"});
    m.push_back({"remote_sent_total", lbl, double(t.sent), "counter",
                 "Messages sent to a remote role's node"});
    m.push_back({"remote_reconnects_total", lbl, double(t.reconnects), "counter",
                 "Times a remote role's node was reached again after it went down"});
  }
  m.push_back({"remote_bounced_total", fmt::format("role=\"{}\",proxy=\"{}\"", s.role, s.gate->actor_name()),
               double(s.bounced), "counter",
               "Messages for a remote role answered locally because its node was not reachable"});
  m.push_back({"remote_aborts_chase_capped_total",
               fmt::format("role=\"{}\",proxy=\"{}\"", s.role, s.gate->actor_name()), double(s.aborts_capped),
               "counter", "Chased aborts sent to every node of a remote role with one hop of chase left"});
  // Named like its mailbox gate: per-node proxies of one role are told apart.
  return make_stats_wire(s.gate->actor_name(), m, {});
}

caf::behavior proxy_actor(caf::stateful_actor<proxy_state>* self, std::string role, std::vector<remote_node> targets,
                          std::shared_ptr<mailbox_gate> gate, bool notify_router, std::shared_ptr<spdlog::logger> log,
                          bool notify_local, caf::actor dialer) {
  auto& st = self->state;
  st.dialer = std::move(dialer);
  st.notify_router = notify_router;
  st.notify_local = notify_local;
  st.role = std::move(role);
  st.gate = std::move(gate);
  st.log = std::move(log);
  for (auto& t : targets) {
    self->monitor(t.ingress);
    st.targets.push_back({std::move(t)});
  }
  self->set_down_handler([self](caf::down_msg& dm) { on_target_down(self, dm); });
  return {
      [self](peers_atom, const peer_set& p) { self->state.peers = p; },
      [self](redial_atom, uint64_t i) { redial(self, i); },
      [self](wire_atom, const wire& w) { pass_on(self, w); },
      [self](stats_atom) -> wire { return proxy_stats(self); },
  };
}

}  // namespace

caf::actor spawn_ingress(caf::actor_system& sys, const std::string& node, std::vector<std::string> local_roles,
                         std::shared_ptr<spdlog::logger> log) {
  return sys.spawn(ingress_actor, node, std::move(local_roles), std::move(log));
}

node_links link_nodes(caf::actor_system& sys, const std::string& node, const std::string& host, int32_t port,
                      std::vector<std::string> local_roles, std::vector<remote_node> peers, int64_t timeout_ms,
                      std::shared_ptr<spdlog::logger> log) {
  node_links out;
  out.ingress = spawn_ingress(sys, node, std::move(local_roles), log);
  auto bound = sys.middleman().publish(out.ingress, static_cast<uint16_t>(port), host.c_str(), true);
  if (!bound) {
    caf::anon_send_exit(out.ingress, caf::exit_reason::user_shutdown);
    throw tandem::error(error_kind::failed,
                        fmt::format("node {}: cannot listen for the other nodes on {}:{}: {}; free the port or change "
                                    "cluster_port",
                                    node, host, port, sys.render(bound.error())));
  }
  out.port = *bound;
  log->info("node {}: ingress listening on {}:{} (cluster_port)", node, host, out.port);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (auto& p : peers) {
    std::string last;
    for (int attempt = 0;; ++attempt) {
      auto a = sys.middleman().remote_actor(p.host, static_cast<uint16_t>(p.cluster_port));
      if (a) {
        p.ingress = *a;
        break;
      }
      last = sys.render(a.error());
      if (std::chrono::steady_clock::now() >= until) {
        caf::anon_send_exit(out.ingress, caf::exit_reason::user_shutdown);
        throw tandem::error(error_kind::disconnected,
                            fmt::format("node {}: node {} at {}:{} did not answer within {} ms ({}); start it, or "
                                        "check its host and cluster_port",
                                        node, p.name, p.host, p.cluster_port, timeout_ms, last));
      }
      // Peers start in any order: back off and retry until the deadline.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20 * (attempt + 1), 200)));
    }
    log->info("node {}: linked to node {} ({}:{})", node, p.name, p.host, p.cluster_port);
  }
  out.peers = std::move(peers);
  return out;
}

bounded_actor spawn_remote_proxy(caf::actor_system& sys, const std::string& role, std::vector<remote_node> targets,
                                 int32_t bound, bool notify_router, std::shared_ptr<spdlog::logger> log,
                                 const std::string& name, bool notify_local, caf::actor dialer) {
  auto gate = std::make_shared<mailbox_gate>(name.empty() ? role : name, bound);
  auto h = sys.spawn(proxy_actor, role, std::move(targets), gate, notify_router, std::move(log), notify_local,
                     std::move(dialer));
  return bounded_actor{h, gate};
}

}  // namespace tandem
