#pragma once
#include <functional>
/// The actors of one node wired together around an already loaded model: router ->
/// prefill scheduler -> (KvHandoff) -> decode scheduler, sharing one worker and one cache
/// tier (same pool, so the handoff moves page ownership without copying).
/// `embedded_cluster` wraps this with model loading; tests build it with a fake model.
/// Its files: node_plan.cpp (what the node runs with, computed once), actor_cluster.cpp (start,
/// supervision, submissions, shutdown), actor_cluster_wiring.cpp (spawn and connect an actor
/// set from the plan), actor_cluster_observe.cpp (stats, health, inspect, drain).
#include <spdlog/sinks/sink.h>

#include <memory>
#include <string>
#include <vector>

#include "actors/common/cache_config.h"
#include "kernels/backend/device.h"
#include "kernels/base/clock.h"
#include "actors/common/limits.h"
#include "actors/common/metrics.h"
#include "actors/runtime/node_plan.h"
#include "actors/runtime/remote_link.h"
#include "actors/router/router_policy.h"
#include "actors/runtime/serving_api.h"
#include "actors/worker/kv_port.h"
#include "kernels/grammar/matcher.h"
#include "kernels/model/llama.h"

namespace tandem {

/// A node's settings (node_spec: limits, cache, roles, links, policies; what plan_node reads)
/// and what the running process adds to them: the model's names, the device, logging, the KV
/// transfer port and the supervision hooks.
struct actor_cluster_options : node_spec {
  std::string model_id = "model";
  std::string kernels = "cpu";                 ///< the model's kernel path, for the start-up log line
  /// The device the model runs on and its KV pools live in (kernels/backend/device.h); empty = CPU.
  backend::device device;
  int32_t eos_id = -1;
  /// The vocabulary the worker masks with for response_format (kernels/grammar); null = none.
  std::shared_ptr<const grammar::token_trie> grammar_vocab;
  std::string log_level = "info";
  bool log_json = false;
  std::shared_ptr<spdlog::sinks::sink> sink;   ///< default: stderr
  /// The worker's KV transfer port (cross-node handoffs); required on prefill and decode nodes
  /// whose counterpart runs elsewhere.
  kv_port_factory kv_transfer;
  /// Test hook (`TANDEM_WORKER_FAULT=start`): every worker this node spawns fails as it starts,
  /// so supervision's restart budget can be checked on a real process.
  bool worker_fails_at_start = false;
  /// Called once when the supervisor gives up (restart budget spent), with its report; the
  /// serving process exits on it (non-zero, so systemd's Restart=on-failure takes over).
  std::function<void(const std::string&)> on_escalate;
  /// Test hook: the actors run on this actor system (tests/actors: CAF's deterministic test
  /// scheduler), which the caller owns and ends after the cluster; null = the cluster's own. The
  /// worker then runs on that system's scheduler, not on a thread of its own. One process only.
  caf::actor_system* system = nullptr;
};

class actor_cluster {
 public:
  /// Plans the node (plan_node: limits, context, KV pools; throws tandem::error with the
  /// plan's error), then spawns and wires the actors.
  actor_cluster(std::shared_ptr<llama_model> model, actor_cluster_options opt);
  /// shutdown() and wait for every actor.
  ~actor_cluster();
  actor_cluster(const actor_cluster&) = delete;
  actor_cluster& operator=(const actor_cluster&) = delete;

  /// Thread-safe. Exactly one finished event per call, through `cb`.
  void submit(completion_request req, event_callback cb);
  /// Thread-safe, best effort. `why` is the reason the request finishes with: abort (the
  /// client's), or stop (the front end cut the text at a stop string).
  void abort(const std::string& request_id, finish_reason why = finish_reason::abort, int32_t choice = -1);
  health_info health() const;
  stats_info stats() const;
  std::string metrics_text() const;
  /// Actors, in-flight requests and KV pools, for `tandem inspect`.
  node_report inspect() const;
  /// Starts (`on`) or ends draining this node's router and schedulers (actors/runtime/node_drain.h).
  node_report drain(bool on);
  /// Sets limits.max_queue_wait_ms (0 = off) in this node's running router; returns the bound
  /// it replaced. Throws tandem::error if `ms` < 0 or this node has no router.
  int32_t set_max_queue_wait_ms(int32_t ms);
  /// Every actor's metrics plus the mailbox gates (actor "mailboxes"). The worker answers
  /// between forward passes; `include_worker = false` skips it (stats() does).
  std::vector<stats_snapshot> snapshots(bool include_worker = true) const;
  int32_t max_context() const;
  int32_t n_pages() const;
  const std::string& model_id() const { return opt_.model_id; }
  /// What this node runs with (computed once at start; restarts reuse it).
  const node_plan& plan() const;
  /// Ends running requests with `disconnected`, stops the actors. Idempotent.
  void shutdown();
  /// Makes the actor of `role` (router, prefill, decode, worker, cache_tier) exit with an
  /// error, as a crash would, so the supervisor's restart and escalation can be exercised
  /// (failure drills, tests). Throws tandem::error naming the roles if `role` is unknown.
  void inject_failure(const std::string& role, const std::string& cause = "injected failure");

  struct state;

 private:
  /// The settings as given (its node_spec part is plan().spec: plan_node copies it).
  actor_cluster_options opt_;
  std::unique_ptr<state> st_;
};

}  // namespace tandem
