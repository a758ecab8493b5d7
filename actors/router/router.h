#pragma once
/// Router actor: the front door. Holds the bounded in-flight table with each request's
/// event callback, validates and stamps requests (deadline, arrival order), forwards them
/// to the prefill scheduler, and turns TokenEvents from the stages into callback calls.
/// It is the authority on a request's end: exactly one finished event per accepted
/// request (completion, abort, deadline, error, or `disconnected` at shutdown).
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <memory>
#include <string>
#include <vector>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/protocol.h"
#include "kernels/base/clock.h"
#include "actors/common/limits.h"
#include "actors/common/request.h"
#include "actors/router/router_policy.h"
#include "actors/runtime/serving_api.h"

namespace tandem {

/// The local-only part of a submission (never serialized). A submission that is never read
/// (the router failed or was restarted with it still in its mailbox, where CAF discards it)
/// would leave its client waiting forever: the last copy of an untaken box ends the request
/// with `disconnected` instead.
class callback_box {
 public:
  callback_box() = default;
  explicit callback_box(event_callback cb, std::string request_id = "", int32_t prompt_tokens = 0);
  /// The callback; afterwards the box stays silent (the router owns the request's end).
  event_callback take() const;

 private:
  struct guard;
  std::shared_ptr<guard> g_;
};

/// The in-flight table as `tandem inspect` shows it (local-only reply, never serialized).
struct inflight_list {
  std::vector<request_report> requests;
};

/// Asks the router for its in-flight table: (inflight_atom) -> inflight_list.
using inflight_atom = caf::atom_constant<caf::atom("inflight")>;

/// Sets the router's queue-wait bound (limits.max_queue_wait_ms, 0 = off) while it runs:
/// (queue_wait_atom, int32_t ms) -> int32_t, the bound it replaced. An operator retunes it from
/// the normal-load TTFT measured on the running cluster (and `tandem bench burst` calibrates
/// the bounded cluster on its own normal load) without a restart that would empty the caches.
using queue_wait_atom = caf::atom_constant<caf::atom("qwaitbound")>;

/// A node is unreachable (sent by the proxy of a remote role on the router's node):
/// (node_down_atom, what, why) with `what` a role (every node of it: "decode", "prefill") or
/// a target / node name ("n1/decode", "n1"), or (node_down_atom, role, target, why). The
/// target is lost (not chosen until it answers again); the requests on it (for a decode
/// target also those still at prefill that would hand off to it) move to another target
/// (limits.router_migration) or end with `disconnected`.
using node_down_atom = caf::atom_constant<caf::atom("nodedown")>;

/// The node of a route target that went down is reachable again (its proxy redialed it):
/// (node_up_atom, role, target). The router asks it for a credit, which brings it back.
using node_up_atom = caf::atom_constant<caf::atom("nodeup")>;

struct router_options {
  limits lim;
  model_facts model;
  int32_t tick_ms = 5;  ///< how often deadlines are checked (real time)
  route_policy_options policy;        ///< which prefill/decode target a request goes to
  /// Conditional disaggregation (router_policy.h): a short uncached prompt goes to its decode
  /// target, on another node than the prefill target, to be prefilled in the decode batch
  /// while the prefill queues are long.
  local_prefill_rule local_prefill;
  uint64_t seed = 0x7a6e64656d;       ///< the policy's and the retry jitter's RNG
};

/// A scheduler the router can send work to, named like its credits ("node/prefill").
struct route_target {
  std::string name;
  bounded_actor actor;
};

/// A route target typed by its role (the router's own tables).
template <class Role>
struct typed_target {
  std::string name;
  role_handle<Role> actor;
};

/// Messages: its protocol, `RouterIn` (actors/common/protocol.h: submit_atom with a callback_box,
/// wire_atom for the rest),
/// (stats_atom) -> wire, (inflight_atom) -> inflight_list, (stop_atom) -> bool.
/// Routes over `prefill` targets (at least one) and `decode` targets (may be empty: each
/// prefill then hands off to its own decode peer). Admission uses the targets' credits.
bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, std::vector<route_target> prefill,
                           std::vector<route_target> decode, std::shared_ptr<const cluster_clock> clk,
                           std::shared_ptr<spdlog::logger> log);
/// One prefill target named "local/prefill", no decode targets.
bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, bounded_actor prefill,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log);

/// Converts an API error into the finished event a rejected submission gets.
token_event error_event(const std::string& request_id, const tandem::error& e, int32_t prompt_tokens = 0);

}  // namespace tandem

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tandem::callback_box)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tandem::inflight_list)
