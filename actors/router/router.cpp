#include "actors/router/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/drain_mode.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem {

token_event error_event(const std::string& request_id, const tandem::error& e, int32_t prompt_tokens) {
  token_event ev;
  ev.request_id = request_id;
  ev.finished = true;
  ev.reason = finish_reason::error;
  ev.err = e;
  ev.prompt_tokens = prompt_tokens;
  return ev;
}

struct callback_box::guard {
  event_callback cb;
  std::string id;
  int32_t prompt_tokens = 0;
  bool taken = false;
  ~guard() {
    if (taken || !cb) return;
    try {
      cb(error_event(id,
                     tandem::error(error_kind::disconnected,
                                   "the router failed before it read the request; retry it"),
                     prompt_tokens));
    } catch (...) {  // a destructor must not throw; the callback's failure has nowhere to go
    }
  }
};

callback_box::callback_box(event_callback cb, std::string request_id, int32_t prompt_tokens)
    : g_(std::make_shared<guard>()) {
  g_->cb = std::move(cb);
  g_->id = std::move(request_id);
  g_->prompt_tokens = prompt_tokens;
}

event_callback callback_box::take() const {
  if (!g_ || g_->taken) return {};
  g_->taken = true;
  return std::move(g_->cb);
}

namespace router_impl {

namespace {

/// The front end ended a request (a client that went away, or a stop string).
void on_client_abort(router_actor_t* self, schema::Abort::Reader a) {
  auto& s = self->state;
  std::string id = a.getId().cStr();
  if (a.getChoice() >= 0) {
    stop_choice(self, id, a.getChoice());  // one choice of n > 1
    return;
  }
  auto it = s.table.find(id);
  if (it == s.table.end()) return;
  const int target = it->second.state == request_stage::retrying ? -1 : it->second.prefill;
  const std::string wid = it->second.req.id;  // the current attempt's
  const auto& ie = it->second;
  const int local_decode = ie.state != request_stage::retrying && ie.local && is_at_decode(ie) ? ie.decode : -1;
  // A stop string ends the request at the front end: a normal finish, counted as stop.
  const bool stop_string = a.getStopString();
  if (stop_string)
    s.log->debug("request {}: ended at a stop string", id);
  else
    s.log->info("request {}: aborted by the client", id);
  s.finish_here(id, stop_string ? finish_reason::stop : finish_reason::abort, nullptr);
  send_abort(self, wid, target, local_decode);
}

/// A target's proxy reached its node again: ask for a credit now, which brings a lost target
/// back (a credit is the sign of life that counts).
void on_node_up(router_actor_t* self, const std::string& target) {
  auto& s = self->state;
  auto ask = [&](const auto& t) {
    if (t.name != target || !t.actor || t.actor.gate->depth() > 0) return;
    s.log->info("target {} is reachable again; asking for its credit", target);
    t.actor.template send<msg::credit_query>(self, [](schema::StatsQuery::Builder q) { q.setFrom("router"); });
  };
  for (const auto& p : s.prefills) ask(p.t);
  for (const auto& d : s.decodes) ask(d.t);
}

/// The cluster shuts down: every request in flight ends with `disconnected`.
void on_stop(router_actor_t* self) {
  auto& s = self->state;
  s.stopped = true;
  std::vector<std::string> ids;
  for (const auto& [id, e] : s.table) ids.push_back(id);
  tandem::error err(error_kind::disconnected, "the cluster shut down before the request finished; retry");
  for (const auto& id : ids) s.finish_here(id, finish_reason::error, &err);
}

/// The in-flight table for `tandem inspect`, oldest first.
inflight_list inflight_of(const router_state& s) {
  inflight_list out;
  int64_t now = s.clk->now_ms();
  out.requests.reserve(s.table.size());
  for (const auto& [id, e] : s.table)
    out.requests.push_back({id, to_string(e.state), now - e.submit_ms, e.prompt_tokens, e.completion_tokens});
  std::sort(out.requests.begin(), out.requests.end(),
            [](const request_report& a, const request_report& b) { return a.age_ms > b.age_ms; });
  return out;
}

}  // namespace

caf::behavior router_actor(router_actor_t* self, router_options opt, std::vector<route_target> prefill,
                           std::vector<route_target> decode, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.box = inbox{"router", st.gate, st.log};
  st.start_ms = st.clk->now_ms();
  const int64_t stale = 3 * int64_t(opt.lim.router_heartbeat_ms);
  for (auto& t : prefill) {
    prefill_target p;
    p.live.heard_ms = st.start_ms;
    p.t = typed_target<prefill_role>{std::move(t.name), std::move(t.actor)};
    p.health = target_health(stale);
    p.breaker = circuit_breaker(opt.lim.breaker_failures, opt.lim.breaker_cooldown_ms);
    st.prefills.push_back(std::move(p));
  }
  for (auto& t : decode) {
    decode_target d;
    d.live.heard_ms = st.start_ms;
    d.t = typed_target<decode_role>{std::move(t.name), std::move(t.actor)};
    d.health = target_health(stale);
    d.breaker = circuit_breaker(opt.lim.breaker_failures, opt.lim.breaker_cooldown_ms);
    st.decodes.push_back(std::move(d));
  }
  auto po = opt.policy;
  po.block_tokens = opt.lim.page_size;
  st.policy.emplace(po, opt.seed);
  st.jitter.seed(opt.seed ^ 0x9e3779b97f4a7c15ull);
  // Every reason the router can refuse for is exported from the start (at 0), so dashboards
  // and alerts see the series before the first rejection.
  for (const char* r : {"malformed", "shutdown", "invalid", "duplicate_id", "inflight_full", "prefill_mailbox", "deadline",
                        "queue_requests", "queue_tokens", "queue_wait", "queue_timeout", "decode_pages", "decode_queue", "no_target",
                        "target_lost", "draining"})
    st.rejected_by_reason[r] = 0;
  for (const char* r : {"budget", "deadline", "no_target"}) st.migration_failures[r] = 0;
  self->delayed_send(self, std::chrono::milliseconds(opt.lim.router_heartbeat_ms), heartbeat_atom::value);
  return {
      [self](submit_atom, const wire& w, const callback_box& cb) {
        // Read before the callback is taken: a submit that cannot be read answers it (malformed).
        receive<router_role, submit_atom>(
            self->state.box, w,
            overloaded{[self, &cb](msg::submit, schema::SubmitRequest::Reader r) {
              auto req = seq_request::read(r);
              on_submit(self, std::move(req), cb.take());
            }},
            [self, &cb](const tandem::error& e) { self->state.reject("?", cb.take(), e, "malformed", 0); });
      },
      [self](wire_atom, const wire& w) {
        receive<router_role>(
            self->state.box, w,
            overloaded{
                [self](msg::event, schema::TokenEvent::Reader r) { on_event(self, r); },
                [self](msg::credit, schema::Credit::Reader c) {
                  if (self->state.on_credit(c)) query_prefills(self);
                },
                [self](msg::requeue, schema::SubmitRequest::Reader r) { on_requeue(self, r); },
                [self](msg::abort, schema::Abort::Reader a) { on_client_abort(self, a); },
            });
      },
      [self](tick_atom) { on_tick(self); },
      [self](node_down_atom, const std::string& what, const std::string& why) { on_node_down(self, what, why); },
      [self](node_down_atom, const std::string&, const std::string& target, const std::string& why) {
        on_node_down(self, target, why);  // (role, "node/role" target, why): per-target proxies
      },
      [self](node_up_atom, const std::string&, const std::string& target) { on_node_up(self, target); },
      [self](drain_atom, bool on) -> bool {
        // This node drains: new submissions are refused; the in-flight table empties.
        auto& s = self->state;
        s.draining = on;
        s.log->info("router {}", on ? "drains: new requests are refused" : "takes requests again");
        return true;
      },
      [self](retry_atom, const std::string& id) { on_retry(self, id); },
      [self](heartbeat_atom) { on_heartbeat(self); },
      [self](stop_atom) -> bool {
        on_stop(self);
        return true;
      },
      [self](queue_wait_atom, int32_t ms) -> int32_t {
        auto& s = self->state;
        const int32_t before = s.opt.lim.max_queue_wait_ms;
        s.opt.lim.max_queue_wait_ms = std::max<int32_t>(ms, 0);
        s.log->info("limits.max_queue_wait_ms set to {} (was {})", s.opt.lim.max_queue_wait_ms, before);
        return before;
      },
      [self](inflight_atom) -> inflight_list { return inflight_of(self->state); },
      [self](stats_atom) -> wire { return router_stats(self->state); },
  };
}

}  // namespace router_impl

using router_impl::router_actor;

bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, std::vector<route_target> prefill,
                           std::vector<route_target> decode, std::shared_ptr<const cluster_clock> clk,
                           std::shared_ptr<spdlog::logger> log) {
  if (prefill.empty()) throw tandem::error(error_kind::failed, "the router needs at least one prefill target");
  auto gate = std::make_shared<mailbox_gate>("router", opt.lim.router_mailbox);
  auto h = sys.spawn(router_actor, opt, std::move(prefill), std::move(decode), gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, bounded_actor prefill,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  return spawn_router(sys, opt, {route_target{"local/prefill", std::move(prefill)}}, {}, std::move(clk),
                      std::move(log));
}

}  // namespace tandem
