#pragma once
/// The router actor's state and the functions its behaviour (router.cpp) is built from, one
/// file per concern: the in-flight table (router_table.cpp), admission and placement
/// (router_admission.cpp), target liveness (router_liveness.cpp), migration
/// (router_migration.cpp) and metrics (router_metrics.cpp). Internal to actors/router.
#include <spdlog/logger.h>

#include <caf/all.hpp>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/common/logprobs_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/receive.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"

namespace tandem::router_impl {

using retry_atom = caf::atom_constant<caf::atom("retry")>;
using heartbeat_atom = caf::atom_constant<caf::atom("heartbt")>;

/// Whether a target still answers while requests are there: any credit or event from it is a
/// sign of life. Silent for 1.5 heartbeats with work in flight (after queries every half
/// heartbeat) = lost, as is a target whose node went down; a later credit brings it back.
struct liveness {
  int64_t heard_ms = 0;   ///< last credit or event from it
  int64_t query_ms = -1;  ///< last credit query sent while requests were there
  bool lost = false;
  std::string lost_why;
  int64_t lost_total = 0;
  int64_t back_ms = -1;  ///< when it answered again after it was lost (-1: never lost)
};

/// A prefill target as the router sees it: its last credit plus what was sent since.
struct prefill_target {
  typed_target<prefill_role> t;
  target_load load;            ///< from the last credit (queued_* without the in-transit part)
  int64_t active_tokens = 0;
  uint64_t sent = 0;           ///< submissions sent to it
  std::deque<int64_t> in_transit;  ///< prompt tokens of submissions it has not taken yet
  int64_t in_transit_tokens = 0;
  uint64_t last_seq = 0;
  target_health health;
  circuit_breaker breaker;
  int64_t routed = 0;
  liveness live;
  bool draining = false;                 ///< its credits say so: no new work goes there
  int64_t credit_ms = -1;                ///< when its last (in-order) credit arrived
  std::vector<std::string> unreachable;  ///< decode targets its node cannot reach (its last credit)

  int64_t queued_requests() const { return load.queued_requests + int64_t(in_transit.size()); }
  int64_t queued_tokens() const { return load.queued_tokens + in_transit_tokens; }
  /// Everything ahead of a new request: waiting, in transit and not yet computed.
  int64_t backlog_tokens() const { return queued_tokens() + active_tokens; }
};

struct decode_target {
  typed_target<decode_role> t;
  target_load load;
  uint64_t last_seq = 0;
  target_health health;
  circuit_breaker breaker;
  int64_t routed = 0;
  liveness live;
  bool draining = false;  ///< its credits say so: no new work goes there
};

/// One stage event, read off the wire (kept while an earlier one is missing).
struct stage_event {
  std::vector<int32_t> tokens;
  std::vector<token_logprobs> logprobs;  ///< parallel to tokens when the request asked
  bool finished = false;
  finish_reason reason = finish_reason::none;
  std::optional<tandem::error> err;
};

struct entry {
  event_callback cb;
  /// Kept for re-routing. Its id is the current attempt's: the client's id, or after a
  /// migration `id#mN`, so events of an attempt given up on are told apart and dropped.
  seq_request req;
  std::string id;    ///< the client's id (the table's key)
  int prefill = 0;   ///< index of its prefill target
  int decode = -1;   ///< index of its decode target (-1: the prefill's own)
  bool local = false;  ///< prefilled on its decode target (conditional disaggregation)
  int32_t retries = 0;
  std::vector<int> tried;  ///< prefill targets that refused it
  int64_t submit_ms = 0;
  int64_t first_token_ms = -1;
  int64_t last_token_ms = -1;
  int64_t deadline_ms = 0;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  request_stage state = request_stage::queued;
  int64_t stage_since_ms = 0;  ///< when it reached its current stage (silence counts from here at most)
  std::vector<int32_t> emitted;  ///< tokens delivered (with migration on: the continuation's `generated`)
  int32_t migrations = 0;
  std::vector<int> lost_prefill, lost_decode;  ///< targets it lost: never again for this request
  /// Events that overtook an earlier one, by completion index (at most max_new_tokens + 1).
  std::map<int32_t, stage_event> early;
  /// n > 1: choices 1..n-1 (choice 0 is the fields above); the entry ends once every choice
  /// ended (router_choices.cpp).
  struct choice_track {
    int32_t completion_tokens = 0;
    std::map<int32_t, stage_event> early;
    bool done = false;
  };
  std::vector<choice_track> choices;
  bool done0 = false;  ///< n > 1: choice 0 ended (its finished event went out)
  finish_reason reason0 = finish_reason::none;
  int32_t completion_total() const {
    int32_t t = completion_tokens;
    for (const auto& c : choices) t += c.completion_tokens;
    return t;
  }
};

/// Where a request goes, or why it cannot go anywhere now.
struct placement {
  int prefill = -1, decode = -1;
  bool local = false;  ///< send it to the decode target to be prefilled there
  std::optional<tandem::error> err;
  std::string reason;
  int64_t retry_after_ms = 0;
};

struct router_state {
  router_options opt;
  std::vector<prefill_target> prefills;
  std::vector<decode_target> decodes;
  std::optional<route_policy> policy;
  std::mt19937_64 jitter;
  int64_t start_ms = 0;
  int64_t retries_total = 0, local_prefill_candidates = 0, local_prefills = 0;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  inbox box;  ///< the receive side (gate, log, unexpected-message counters)
  std::unordered_map<std::string, entry> table;
  std::unordered_map<std::string, std::string> attempt_ids;  ///< `id#mN` -> id, one per migrated entry
  int64_t migrations_total = 0;
  std::unordered_map<std::string, int64_t> migration_failures;  ///< by reason
  uint64_t next_order = 1;
  bool tick_pending = false;
  bool stopped = false;
  bool draining = false;  ///< this node drains: new submissions are refused, the table empties
  int64_t requests_total = 0, tokens_generated = 0, prompt_tokens_total = 0;
  std::unordered_map<std::string, int64_t> finished_by_reason;
  std::unordered_map<std::string, int64_t> rejected_by_reason;
  histogram ttft{"ttft_ms", "Time to first token (ms)", histogram::latency_ms_buckets()};
  histogram tpot{"tpot_ms", "Time per output token after the first (ms)", histogram::latency_ms_buckets()};
  histogram e2e{"e2e_ms", "Request latency from submit to finish (ms)", histogram::latency_ms_buckets()};
  static inline const char* name = "router";

  static void deliver(const event_callback& cb, token_event ev, spdlog::logger& log);
  void reject(const std::string& id, const event_callback& cb, const tandem::error& e,
              const std::string& reason, int32_t prompt_tokens, int64_t retry_after_ms = 0);
  /// Ends an in-flight request with a final event it did not get from a stage.
  void finish_here(const std::string& id, finish_reason reason, const tandem::error* err,
                   const std::string& reject_reason = "", int64_t retry_after_ms = 0);
  using entry_it = std::unordered_map<std::string, entry>::iterator;
  /// The entry whose current attempt is `wid` (the client's id, or `id#mN` after a
  /// migration), or table.end() (ended, or an attempt given up on).
  entry_it find_attempt(const std::string& wid);
  void erase(entry_it it);
  /// A router that exits with requests in flight (a failure, or the supervisor restarting the
  /// node's actors) ends each with `disconnected`, so no client waits for events that never come.
  ~router_state();
  void account_finish(const entry& e, finish_reason reason);
  int32_t pages_for(int64_t tokens) const;
  /// Time until target `p` could take `n` more tokens under the bound that refused it.
  int64_t drain_ms(const prefill_target& p, int64_t excess_tokens) const;
  /// Empty if target `p` can place a request of `n` prompt tokens now, else why not.
  /// A continuation (a migrated stream) skips the queue-wait estimate: it was admitted already.
  std::optional<placement> check_prefill(const prefill_target& p, int64_t n, bool continuation = false) const;
  /// A refusal because the decode target is backed up: overloaded, retry in a second (a
  /// decode backlog drains by whole sequences, not at a rate the router measures).
  static placement decode_busy(placement& out, const char* reason, std::string what);
  /// Chooses a (prefill, decode) pair that can place `r`, avoiding `avoid` where another
  /// target exists, and never one in `never_prefill` / `never_decode` (targets the request
  /// lost). A continuation (`r.generated` set: a migrated stream) skips the soft admission
  /// estimates (queue wait, decode pages, decode queue); the hard queue bounds still hold.
  placement place(const seq_request& r, const std::vector<int>& avoid, const std::vector<int>& never_prefill = {},
                  const std::vector<int>& never_decode = {});
  /// A sign of life of a target: a lost one is back (its node restarted or its link healed).
  /// True when it was lost.
  bool heard(liveness& l, const std::string& name, int64_t now);
  /// A lost target that answers again is a fresh start: the breaker that its lost requests
  /// opened closes, and a restarted node numbers its credits from 1 again.
  template <class T>
  void back(T& t) {
    t.breaker.on_success();
    t.last_seq = 0;
  }
  /// Applies a target's credit; true if it brought a lost decode target back (the prefill
  /// targets are then asked for fresh credits: it is routable once they reach it).
  bool on_credit(schema::Credit::Reader c);
  /// Whether prefill target `p` can hand off to decode target `d` now: its node reaches it
  /// (its last credit does not list it unreachable) and, if `d` was lost and is back, `p`
  /// reported after that (its node may still be redialing `d`, up to 2 s).
  bool reaches(const prefill_target& p, const decode_target& d) const;
  /// A decode target that can take new work at all: credits fresh, breaker closed, not lost,
  /// not draining.
  bool decode_eligible(const decode_target& d, int64_t now) const;
  /// Requests in the table that still need target `i` (a draining target reports drained
  /// once this is 0): at a prefill target until they leave it, at a decode target until they end.
  int32_t holds(int i, bool decode) const;
  std::string validate(const seq_request& r) const;
};

using router_actor_t = caf::stateful_actor<router_state>;

// router_table.cpp
void schedule_tick(router_actor_t* self);
/// Delivers `ev`, whose tokens start at completion index `first`, trimming tokens delivered
/// already (a duplicate). Returns true if the request ended.
bool deliver_in_order(router_state& s, std::unordered_map<std::string, entry>::iterator it, int32_t first,
                      stage_event ev);
/// Aborts `id` at one target (hops 0: the target chases it if the request moved on).
template <class Role>
void send_abort_to(router_actor_t* self, const role_handle<Role>& a, const std::string& id) {
  if (!a) return;
  a.template send<msg::abort>(self, [&](schema::Abort::Builder b) {
    b.setId(id);
    b.setHops(0);
  });
}
void send_abort(router_actor_t* self, const std::string& id, int target, int local_decode = -1);
/// Where a request is now: at its decode target or at its prefill target.
bool is_at_decode(const entry& e);
void on_event(router_actor_t* self, schema::TokenEvent::Reader r);

// router_choices.cpp
/// An event of choice `choice` >= 1 of an n > 1 request (its fork at the decode target).
void on_choice_event(router_actor_t* self, router_state::entry_it it, int32_t choice, int32_t first, stage_event ev);
/// Choice `choice` of `it` ended with `reason` (its finished event went out); true when that
/// was the last open choice: the request is accounted and erased.
bool end_choice(router_state& s, router_state::entry_it it, int32_t choice, finish_reason reason);
/// The stop string of one choice matched at the front end: that choice ends as `stop` and its
/// fork is aborted (Abort.choice).
void stop_choice(router_actor_t* self, const std::string& id, int32_t choice);
/// n > 1: `err` ends every open choice (the request is accounted once) and its forks are aborted.
void fail_choices(router_actor_t* self, router_state::entry_it it, const tandem::error& err);
void on_tick(router_actor_t* self);

// router_admission.cpp
/// Sends `e`'s request to the placement's targets; false (and the request ended) if the
/// target's mailbox is full.
bool dispatch(router_actor_t* self, entry& e, const placement& pl);
/// A new request from the front end (read by the receive wrapper; a malformed one is answered
/// there); `cb` gets its events.
void on_submit(router_actor_t* self, seq_request r, event_callback cb);
/// A refused request's backoff is over: place it again, on a fresh target if there is one.
void on_retry(router_actor_t* self, const std::string& id);

// router_liveness.cpp
/// Marks a target lost (node down, or silent): no new request goes there until it answers again.
void mark_lost(router_state& s, liveness& l, const std::string& name, const std::string& why);
/// Loses targets with requests in flight that stopped answering (1.5 heartbeats).
void check_silence(router_actor_t* self, int64_t now);
/// (node_down_atom, what, why): that role, target or node is unreachable.
void on_node_down(router_actor_t* self, const std::string& what, const std::string& why);
/// Credit queries to targets whose credits are older than a heartbeat, and to every draining one.
void on_heartbeat(router_actor_t* self);
/// Asks a target for a credit now (one query at a time); `holds` >= 0 for a draining target.
template <class Role>
void query_credit(router_actor_t* self, const role_handle<Role>& a, int32_t holds = -1) {
  // A target with messages still waiting (an earlier query among them) answers when it gets
  // to them, or is gone: one query at a time keeps a dead target's mailbox bounded.
  if (!a || a.gate->depth() > 0) return;
  a.template send<msg::credit_query>(self, [&](schema::StatsQuery::Builder q) {
    q.setFrom("router");
    q.setHolds(holds);
  });
}
/// Asks every prefill target for a credit (a decode target came back: which of them reach it).
void query_prefills(router_actor_t* self);

// router_migration.cpp
/// Ends `id` with `disconnected`: `cause` and what the client can do.
void end_lost(router_state& s, const std::string& id, const std::string& cause, const std::string& what_to_do);
/// Request `id` lost the stage that served it: it moves (migration) or ends.
void lose(router_actor_t* self, const std::string& id, bool decode_side, const std::string& cause);
/// A sequence its decode target sent back for recompute.
void on_requeue(router_actor_t* self, schema::SubmitRequest::Reader r);

// router_metrics.cpp
/// The stats_atom reply.
wire router_stats(router_state& s);

}  // namespace tandem::router_impl
