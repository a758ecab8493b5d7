/// The router's metrics (the stats_atom reply).
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem::router_impl {

wire router_stats(router_state& s) {
  std::vector<metric_sample> m = {
      {"requests_total", "", double(s.requests_total), "counter", "Requests accepted by the router"},
      {"requests_inflight", "", double(s.table.size()), "gauge",
       "Requests in the router's in-flight table"},
      {"requests_inflight_bound", "", double(s.opt.lim.max_inflight_requests), "gauge",
       "Bound of the in-flight table"},
      {"queue_wait_bound_ms", "", double(s.opt.lim.max_queue_wait_ms), "gauge",
       "Queue-wait bound the router admits by now (limits.max_queue_wait_ms; 0 = off)"},
      {"tokens_generated_total", "", double(s.tokens_generated), "counter",
       "Completion tokens delivered"},
      {"prompt_tokens_total", "", double(s.prompt_tokens_total), "counter",
       "Prompt tokens of the requests accepted by the router"},
  };
  for (const auto& [r, n] : s.finished_by_reason)
    m.push_back({"requests_finished_total", fmt::format("reason=\"{}\"", r), double(n), "counter",
                 "Requests ended, by finish reason"});
  m.push_back({"router_retries_total", "", double(s.retries_total), "counter",
               "Requests re-routed after a target refused them before their first token"});
  m.push_back({"router_migrations_total", "", double(s.migrations_total), "counter",
               "Streams moved to another target after theirs was lost"});
  for (const auto& [r, n] : s.migration_failures)
    m.push_back({"router_migration_failures_total", fmt::format("reason=\"{}\"", r), double(n), "counter",
                 "Streams that lost their target and could not move, by reason"});
  m.push_back({"router_local_prefill_candidates_total", "", double(s.local_prefill_candidates), "counter",
               "Requests the conditional-disaggregation rule would prefill on their decode node"});
  m.push_back({"router_local_prefill_total", "", double(s.local_prefills), "counter",
               "Requests sent to their decode target to be prefilled there (conditional disaggregation)"});
  m.push_back({"router_prefix_index_nodes", "", double(s.policy->index().size()), "gauge",
               "Nodes of the cache_aware prefix index (bounded, LRU)"});
  m.push_back({"router_balance_fallbacks_total", "", double(s.policy->balance_fallbacks()), "counter",
               "cache_aware choices overridden by the balance thresholds"});
  const int64_t now = s.clk->now_ms();
  auto target_metrics = [&](const std::string& name, const target_health& h, const circuit_breaker& b,
                            int64_t routed, const liveness& live) {
    auto l = fmt::format("target=\"{}\"", name);
    m.push_back({"router_target_healthy", l, h.healthy(now, s.start_ms) && !live.lost ? 1.0 : 0.0, "gauge",
                 "1 while the target's credits are fresh (3 heartbeats) and it is not lost, else 0"});
    m.push_back({"router_target_lost_total", l, double(live.lost_total), "counter",
                 "Times the target was lost (node down, or silent 1.5 heartbeats with requests there)"});
    m.push_back({"router_target_credit_age_ms", l, double(h.age_ms(now, s.start_ms)), "gauge",
                 "Age of the target's last credit"});
    m.push_back({"router_breaker_state", l, double(static_cast<int>(b.current(now))), "gauge",
                 "Circuit breaker of the target: 0 closed, 1 open, 2 half-open"});
    m.push_back({"router_breaker_opens_total", l, double(b.opens()), "counter",
                 "Times the target's circuit breaker opened"});
    m.push_back({"router_routed_total", l, double(routed), "counter", "Requests sent to the target"});
  };
  for (const auto& p : s.prefills) {
    target_metrics(p.t.name, p.health, p.breaker, p.routed, p.live);
    auto l = fmt::format("target=\"{}\"", p.t.name);
    m.push_back({"router_target_draining", l, p.draining ? 1.0 : 0.0, "gauge",
                 "1 while the target drains (tandem inspect --drain): no new requests go there"});
    m.push_back({"router_target_queued_tokens", l, double(p.backlog_tokens()), "gauge",
                 "Prompt tokens ahead of a new request at the prefill target (credits + in transit)"});
    m.push_back({"router_target_queue_wait_ms", l,
                 double(estimate_queue_wait_ms(p.backlog_tokens(), p.load.prefill_tokens_per_s)), "gauge",
                 "Estimated queue wait of the prefill target (-1 = drain rate not measured yet)"});
  }
  for (const auto& d : s.decodes) {
    target_metrics(d.t.name, d.health, d.breaker, d.routed, d.live);
    m.push_back({"router_target_draining", fmt::format("target=\"{}\"", d.t.name), d.draining ? 1.0 : 0.0, "gauge",
                 "1 while the target drains (tandem inspect --drain): no new requests go there"});
    m.push_back({"router_target_free_pages", fmt::format("target=\"{}\"", d.t.name), double(d.load.free_pages),
                 "gauge", "KV pages free or evictable at the decode target's last allocation (-1 = unknown)"});
  }
  // Readiness (actors/runtime/readiness.h): a role with targets and none of them live
  // means every request fails, whatever the process's own health.
  // Routable only: not draining, and a decode target only once a live prefill target reaches it
  // (a restarted decode node is not routable while the prefill nodes are still redialing it).
  auto live_prefill = [&](const prefill_target& p) {
    return p.health.healthy(now, s.start_ms) && !p.live.lost && !p.draining;
  };
  double live_p = 0, live_d = 0;
  for (const auto& p : s.prefills) live_p += live_prefill(p) ? 1 : 0;
  for (const auto& d : s.decodes) {
    bool reached = false;
    for (const auto& p : s.prefills) reached = reached || (live_prefill(p) && s.reaches(p, d));
    live_d += d.health.healthy(now, s.start_ms) && !d.live.lost && !d.draining && reached ? 1 : 0;
  }
  m.push_back({"router_targets", "role=\"prefill\"", double(s.prefills.size()), "gauge",
               "Targets the router routes to, by role"});
  m.push_back({"router_targets", "role=\"decode\"", double(s.decodes.size()), "gauge",
               "Targets the router routes to, by role"});
  m.push_back({"router_live_targets", "role=\"prefill\"", live_p, "gauge",
               "Routable targets (fresh credits, not lost, not draining; decode: reached by a live prefill target), by role"});
  m.push_back({"router_live_targets", "role=\"decode\"", live_d, "gauge",
               "Routable targets (fresh credits, not lost, not draining; decode: reached by a live prefill target), by role"});
  m.push_back({"router_draining", "", s.draining ? 1.0 : 0.0, "gauge",
               "1 while this router drains (tandem inspect --drain): new requests are refused"});
  for (const auto& [r, n] : s.rejected_by_reason)
    m.push_back({"rejections_total", fmt::format("actor=\"router\",reason=\"{}\"", r), double(n),
                 "counter", "Requests refused or ended early, by reason"});
  for (auto& x : s.box.metrics()) m.push_back(std::move(x));
  return make_stats_wire("router", m, {&s.ttft, &s.tpot, &s.e2e});
}

}  // namespace tandem::router_impl
