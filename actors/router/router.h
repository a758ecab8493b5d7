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
#include "actors/common/clock.h"
#include "actors/common/limits.h"
#include "actors/common/request.h"
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

struct router_options {
  limits lim;
  model_facts model;
  int32_t tick_ms = 5;  ///< how often deadlines are checked (real time)
};

/// Messages: (submit_atom, wire{submit}, callback_box), (wire_atom, wire{event|abort}),
/// (stats_atom) -> wire, (inflight_atom) -> inflight_list, (stop_atom) -> bool. `prefill` must be set before traffic arrives.
bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, bounded_actor prefill,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log);

/// Converts an API error into the finished event a rejected submission gets.
token_event error_event(const std::string& request_id, const tandem::error& e, int32_t prompt_tokens = 0);

}  // namespace tandem

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tandem::callback_box)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(tandem::inflight_list)
