#include "tests/sim/cluster_sim.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "tests/sim/cluster_world.h"

namespace tandem::sim {

using namespace cluster;

namespace {

cluster_menu pick_menu(sim_rng& r) {
  cluster_menu f;
  f.prefill_nodes = static_cast<int32_t>(r.between(1, 2));
  f.decode_nodes = static_cast<int32_t>(r.between(1, 2));
  f.failure_policy = r.chance(0.7) ? "recompute" : "fail";
  f.max_time_step_ms = static_cast<int32_t>(r.between(1, 20));
  f.time_step = 0.05 + 0.2 * double(r.below(4)) / 4.0;
  // One run in eight is fault free (a baseline the others must match).
  if (r.below(8) == 0) return f;
  auto some = [&](double p) { return r.chance(0.6) ? p * double(r.between(1, 4)) / 4.0 : 0.0; };
  f.gate_reject = some(0.04);
  f.link_delay = some(0.4);
  f.max_link_delay_ms = static_cast<int32_t>(r.between(1, 40));
  f.node_losses = r.chance(0.35) ? static_cast<int32_t>(r.between(1, 2)) : 0;
  f.restart_lost = r.chance(0.5);
  f.link_flaps = r.chance(0.4) ? static_cast<int32_t>(r.between(1, 3)) : 0;
  f.max_flap_ms = static_cast<int32_t>(r.between(1, 400));
  f.kv_drop = some(0.1);
  f.kv_delay = some(0.3);
  f.kv_max_delay_ms = static_cast<int32_t>(r.between(1, 60));
  f.kv_duplicate = some(0.2);
  f.kv_corrupt = some(0.1);
  f.kv_put_fail = some(0.1);
  // TANDEM_SIM_OFF=reject,delay,loss,flap,kv: the same run without those faults (every choice is still drawn).
  if (const char* off = std::getenv("TANDEM_SIM_OFF")) {
    std::string o = off;
    auto has = [&](const char* k) { return o.find(k) != std::string::npos; };
    if (has("reject")) f.gate_reject = 0;
    if (has("delay")) f.link_delay = 0;
    if (has("loss")) f.node_losses = 0;
    if (has("flap")) f.link_flaps = 0;
    if (has("kv")) f.kv_drop = f.kv_delay = f.kv_duplicate = f.kv_corrupt = f.kv_put_fail = 0;
  }
  return f;
}

limits pick_limits(sim_rng& r) {
  limits l;
  l.page_size = 4;
  draw_limits(r, l, 300);
  l.max_new_tokens = 64;
  return l;
}

}  // namespace

sim_result run_cluster_seed(uint64_t seed, const cluster_menu* menu) {
  cworld w(seed);
  w.lim = pick_limits(w.rng);
  w.f = pick_menu(w.rng);
  if (menu) w.f = *menu;
  w.start();
  const auto& f = w.f;
  w.note(fmt::format("cluster seed {}: {} prefill, {} decode nodes, policy {}, chunk {}, running {}, prefix cache {}, "
                     "timeout {} ms; faults: reject {:.3f} link delay {:.2f}/{}ms losses {}{} flaps {}/{}ms kv drop "
                     "{:.2f} delay {:.2f}/{}ms dup {:.2f} corrupt {:.2f} put fail {:.2f}",
                     seed, f.prefill_nodes, f.decode_nodes, f.failure_policy, w.lim.prefill_chunk_tokens,
                     w.lim.max_running_seqs, w.lim.prefix_cache ? "on" : "off", w.lim.request_timeout_ms,
                     f.gate_reject, f.link_delay, f.max_link_delay_ms, f.node_losses,
                     f.restart_lost ? " (restarted)" : "", f.link_flaps, f.max_flap_ms, f.kv_drop, f.kv_delay,
                     f.kv_max_delay_ms, f.kv_duplicate, f.kv_corrupt, f.kv_put_fail));

  // The workload (as the one-node simulation's; some arrive after the faults, to nodes that came
  // back, over links that recovered) and the faults' times within the busy period.
  const int64_t t0 = w.now();
  const std::vector<arrival> arrivals = w.make_workload(workload_shape{2, 10, 0.6, 800, 0.2});
  const int n_req = static_cast<int>(arrivals.size());
  struct fault_event {
    int64_t at_ms;
    int kind;  // 0 loss, 1 restart, 2 flap
    int32_t a, b;
    int64_t ms;
  };
  std::vector<fault_event> events;
  const int32_t n_nodes = int32_t(w.nodes.size());
  for (int i = 0; i < f.node_losses; ++i) {
    const int32_t victim = int32_t(w.rng.between(1, n_nodes - 1));  // never the router node
    const int64_t at = t0 + w.rng.between(0, 300);
    events.push_back({at, 0, victim, 0, 0});
    if (f.restart_lost) events.push_back({at + w.rng.between(20, 400), 1, victim, 0, 0});
  }
  for (int i = 0; i < f.link_flaps; ++i) {
    int32_t a = int32_t(w.rng.below(uint64_t(n_nodes))), b = int32_t(w.rng.below(uint64_t(n_nodes - 1)));
    if (b >= a) ++b;
    events.push_back({t0 + w.rng.between(0, 400), 2, a, b, w.rng.between(1, f.max_flap_ms)});
  }
  std::stable_sort(events.begin(), events.end(), [](auto& x, auto& y) { return x.at_ms < y.at_ms; });

  sim_result res;
  res.seed = seed;
  res.replay = fmt::format("TANDEM_SIM_CLUSTER_SEED={} build/dev/tests/test_sim -tc='sim cluster: replay*'   "
                           "(TANDEM_SIM_OFF=reject,delay,loss,flap,kv: the same run without those faults)",
                           seed);
  size_t next_arrival = 0, next_event = 0;
  const int64_t max_steps = 300000;
  const int64_t settle_ms = 5000;
  int64_t settle_until = -1, steps = 0;
  auto& sched = *w.sched;
  while (true) {
    if (++steps > max_steps) {
      w.violate(fmt::format("no quiescence after {} steps", max_steps));
      break;
    }
    while (next_arrival < arrivals.size() && arrivals[next_arrival].at_ms <= w.now()) {
      auto& a = arrivals[next_arrival++];
      w.submit(a.id, a.prompt, a.max_tokens, a.deadline_in_ms);
    }
    while (next_event < events.size() && events[next_event].at_ms <= w.now()) {
      auto& e = events[next_event++];
      if (e.kind == 0) w.kill_node(e.a, "is lost");
      if (e.kind == 1) w.restart_node(e.a);
      if (e.kind == 2) w.flap(e.a, e.b, e.ms);
    }
    if (sched.has_job()) {
      if (w.rng.chance(w.f.time_step))
        sched.advance_time(std::chrono::milliseconds(w.rng.between(1, w.f.max_time_step_ms)));
      w.step();
      continue;
    }
    int64_t next = INT64_MAX;
    if (next_arrival < arrivals.size()) next = arrivals[next_arrival].at_ms;
    if (next_event < events.size()) next = std::min(next, events[next_event].at_ms);
    if (next != INT64_MAX) {
      sched.advance_time(std::chrono::milliseconds(std::max<int64_t>(1, next - w.now())));
      continue;
    }
    bool all_done = true;
    for (const auto& a : arrivals) all_done = all_done && w.reqs[a.id].finished > 0;
    if (all_done && settle_until < 0) settle_until = w.now() + settle_ms;
    if (settle_until >= 0 && w.now() >= settle_until) {
      bool quiet = true;
      for (auto& n : w.nodes)
        for (auto* a : n.gated()) quiet = quiet && a->gate->depth() == 0;
      if (quiet || w.now() >= settle_until + 10 * settle_ms) break;
    }
    if (sched.has_pending_timeout()) {
      sched.trigger_timeout();
      continue;
    }
    break;
  }
  res.steps = steps;
  res.sim_ms = w.now() - t0;

  // --- invariants
  w.check_requests(arrivals, res);
  for (auto& n : w.nodes) {
    if (!n.up) continue;
    if (n.cache.handle) w.check_pages(n.cache.handle, n.n_pages, "node " + n.name);
    // Every table that holds a request or a transfer is empty once every request ended.
    auto expect_zero = [&](const bounded_actor& a, std::initializer_list<const char*> gauges) {
      if (!a.handle) return;
      auto st = w.stats_of(a.handle);
      if (!st) return w.violate(fmt::format("node {}: {} does not answer a stats query", n.name, a.gate->actor_name()));
      for (const char* g : gauges)
        if (st->value(g) != 0)
          w.violate(fmt::format("node {}: {} = {} after every request ended (want 0)", n.name, g, st->value(g)));
    };
    if (n.role == role_kind::router) expect_zero(n.sched, {"requests_inflight"});
    if (n.role == role_kind::prefill)
      expect_zero(n.sched, {"prefill_queued_requests", "prefill_active_requests"});
    if (n.role == role_kind::decode)
      expect_zero(n.sched, {"decode_running_requests", "decode_kv_receiving_requests", "decode_kv_page_waiting_requests"});
    expect_zero(n.worker, {"worker_transfers_live", "worker_kv_sends_inflight", "worker_kv_receives_inflight"});
    // Work stops at the bound; control messages (events, aborts, frees) may pass it: at most one
    // event per token plus a few per request and per recompute.
    int64_t slack = 0;
    for (const auto& a : arrivals) slack += a.max_tokens + 8;
    for (auto* a : n.gated()) w.check_gate(*a->gate, slack, "node " + n.name + ": ", true);
  }
  for (const auto& s : w.fabric->in_flight()) w.violate("KV transfer left in flight: " + s);
  for (const auto& s : w.fabric->violations()) w.violate(s);

  // --- shutdown
  res.faults = w.faults + int32_t(w.fabric->faults());
  res.kv_transfers = w.fabric->transfers_done();
  for (size_t i = 0; i < w.nodes.size(); ++i) w.kill_node(int32_t(i), "shuts down", false);
  w.drain();
  w.sys->await_actors_before_shutdown(false);
  res.requests = n_req;
  res.restarts = w.restarts;
  res.violations = w.violations;
  res.trace.assign(w.trace.begin(), w.trace.end());
  w.sys.reset();
  return res;
}

}  // namespace tandem::sim
