#pragma once
/// actor_cluster's state and the pieces its files share (actor_cluster.cpp: start, supervision,
/// submissions, shutdown; actor_cluster_wiring.cpp: spawning and wiring a node's actor set from
/// the plan; actor_cluster_observe.cpp: stats, health, inspect, drain). Internal to actors/runtime.
#include "actors/runtime/actor_cluster.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <caf/all.hpp>
#include <caf/io/middleman.hpp>
#include <mutex>
#include <shared_mutex>

#include <unistd.h>

#include <fstream>
#include <map>
#include <optional>

#include "actors/cache_tier/cache_tier.h"
#include "actors/cache_tier/page_file.h"
#include "actors/common/drain_mode.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/runtime/node_drain.h"
#include "actors/runtime/readiness.h"
#include "actors/supervisor/supervisor.h"
#include "actors/worker/worker.h"

namespace tandem {

/// Ends the actor system unless it is the caller's (actor_cluster_options::system).
struct system_release {
  bool owned = true;
  void operator()(caf::actor_system* sys) const {
    if (owned) delete sys;
  }
};

struct actor_cluster::state {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system, system_release> sys;
  bounded_actor router, prefill, decode, worker, cache;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::atomic<bool> stopped{false};
  std::mutex stop_mu;
  /// submit() holds it shared while sending, shutdown() exclusively while setting `stopped`:
  /// every submission either reaches the router before its stop message or sees `stopped`.
  std::shared_mutex submit_mu;
  int64_t start_ms = 0;
  /// What the node runs with (sizes, pools, roles, limits), computed once at start: every
  /// restart spawns the same set from it.
  node_plan plan;
  /// Cluster time at which every actor last answered a stats query (a heartbeat round).
  std::atomic<int64_t> last_heartbeat_ms{0};
  std::shared_ptr<llama_model> model;  ///< moves into each worker spawned (start and restarts)
  std::shared_ptr<spdlog::sinks::sink> sink;
  caf::actor supervisor;
  /// Set once by the supervisor's escalation; submissions then fail fast. Guarded by submit_mu.
  std::string unhealthy_why;
  std::atomic<bool> unhealthy{false};
  std::atomic<bool> draining{false};  ///< tandem inspect --drain (re-applied to restarted actors)

  /// Multi-node: this node's ingress and the other nodes (empty for one process).
  node_links links;
  /// On the router's node, one stand-in per remote node and role: the router's targets
  /// ("node/role", the name that node's credits carry), so its policies, health checks and
  /// breakers see every node. `prefill`/`decode` above are then the local scheduler or the
  /// proxy over all nodes of the role that the local schedulers send to (none on a router-only node).
  std::vector<bounded_actor> route_proxies;
  bool has(node_role r) const { return plan.has(r); }

  /// The current actors, copied under the lock (the supervisor may replace them). Roles of
  /// other nodes are their local proxies; roles nobody here needs have no actor.
  std::vector<bounded_actor*> all() {
    std::vector<bounded_actor*> v;
    for (auto* a : {&router, &prefill, &decode, &worker, &cache})
      if (a->handle) v.push_back(a);
    for (auto& p : route_proxies) v.push_back(&p);
    return v;
  }
};

namespace cluster_detail {

/// Resident set size of this process (bytes), from /proc/self/statm; 0 if unreadable.
double process_rss_bytes();
/// Spawns and wires one set of the node's actors into `s` from s.plan (at start and on every
/// restart); `opt` gives what the running process adds (KV port, device, logging, test hooks).
void spawn_set(actor_cluster::state& s, const actor_cluster_options& opt);
/// The actors the supervisor watches.
std::vector<supervised_child> children_of(actor_cluster::state& s);

}  // namespace cluster_detail
}  // namespace tandem
