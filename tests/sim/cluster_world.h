#pragma once
// The world of the multi-node simulation (tests/sim/cluster_sim.h): the nodes and their actors,
// the link actors that stand in for the CAF middleman, the dialer the proxies redial through,
// and the faults on them (node loss and restart, link flaps). Internal to tests/sim.
#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>

#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/limits.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "actors/runtime/remote_link.h"
#include "actors/runtime/serving_api.h"
#include "tests/actors/support.h"
#include "tests/sim/cluster_sim.h"
#include "tests/sim/kv_fabric.h"
#include "tests/sim/world_base.h"

namespace tandem::sim::cluster {

using flush_atom = caf::atom_constant<caf::atom("simflush")>;

enum class role_kind { router, prefill, decode };

struct cnode {
  std::string name;
  role_kind role = role_kind::router;
  bool up = true;
  int32_t incarnation = 0;
  int32_t n_pages = 0;
  caf::actor ingress, dialer;
  bounded_actor sched, worker, cache;   ///< the router, or the prefill/decode scheduler and its worker and cache
  std::vector<bounded_actor> proxies;
  std::vector<bounded_actor*> gated() {
    std::vector<bounded_actor*> v;
    for (auto* a : {&sched, &worker, &cache})
      if (a->handle) v.push_back(a);
    for (auto& p : proxies) v.push_back(&p);
    return v;
  }
};

struct cworld;

/// One direction of the connection between two nodes (the middleman's stand-in).
struct link_state {
  cworld* w = nullptr;
  int32_t from = 0, to = 0;
  std::deque<std::pair<int64_t, std::vector<char>>> q;  ///< serialized messages, due time
  bool timer = false;
  static inline const char* name = "sim_link";
};
using link_actor_t = caf::stateful_actor<link_state>;

struct cworld : gate_fault, world_base {
  uint64_t seed;
  cluster_menu f;
  limits lim;
  std::shared_ptr<test::fake_model> model;
  std::unique_ptr<kv_fabric> fabric;
  std::vector<cnode> nodes;
  std::map<std::pair<int32_t, int32_t>, caf::actor> links;  ///< live link actors (from, to)
  std::map<std::pair<int32_t, int32_t>, caf::actor> dead_links;  ///< the last cut one of each direction
  std::map<std::pair<int32_t, int32_t>, int64_t> down_until;  ///< flapped links (min, max)
  int32_t faults = 0, restarts = 0;

  explicit cworld(uint64_t s) : world_base(s * 0x9E3779B97F4A7C15ull + 7, 80), seed(s) {}
  bool reject(const std::string& actor_name) override {
    if (!rng.chance(f.gate_reject)) return false;
    ++faults;
    note(fmt::format("fault: {} mailbox full", actor_name));
    return true;
  }
  std::shared_ptr<gate_fault> shared_self() { return std::shared_ptr<gate_fault>(std::shared_ptr<void>{}, this); }
  /// TANDEM_SIM_LOG=info|debug: the actors' logs on stderr (replaying one seed).
  std::shared_ptr<spdlog::logger> lg(const std::string& n) {
    static const char* level = std::getenv("TANDEM_SIM_LOG");
    if (!level) return make_actor_logger(n, sink, "off");
    static auto err = make_stderr_sink(false);
    return make_actor_logger(n, err, level);
  }

  bool link_ok(int32_t a, int32_t b) const;
  void flush(link_actor_t* self);
  caf::actor link(int32_t from, int32_t to);
  /// A link's connection breaks: what it holds is lost, the proxies that use it hear `down`.
  void cut(int32_t from, int32_t to);
  /// The middleman's connect for node `from`: host is the target node's name.
  caf::actor spawn_dialer(int32_t from);
  remote_node remote(int32_t from, int32_t to, const std::string& role);
  std::vector<int32_t> with(role_kind k) const;
  /// What serve would be asked to run on node `i` (its roles, drawn pool size, the other
  /// nodes); the node's actor options are views of its plan (sim_plan).
  node_spec spec_for(int32_t i) const;
  void spawn_node(int32_t i);
  /// A (re)started node whose peer is down or cut off: its proxies hear `down` and redial (in
  /// production link_nodes would wait for the peer; the other nodes' proxies redial it).
  void cut_unreachable(int32_t i);
  void kill_node(int32_t i, const char* why, bool fault = true);
  void restart_node(int32_t i);
  void flap(int32_t a, int32_t b, int64_t ms);
  void start();
  void submit(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens, int64_t deadline_in_ms) {
    send_submit(nodes[0].sched, make_request(id, std::move(prompt), max_tokens, deadline_in_ms));
  }
};

}  // namespace tandem::sim::cluster
