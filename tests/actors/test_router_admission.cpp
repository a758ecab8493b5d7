// The router's credit-based admission, retries and circuit breaker, against scripted targets:
// the test plays the prefill and decode schedulers (sends their credits and events by hand),
// on the test scheduler and its clock (tests/actors/router_rig.h), so every decision is
// deterministic.
#include <doctest/doctest.h>

#include <deque>
#include <limits>
#include <map>
#include <random>

#include "actors/common/protocol.h"
#include "actors/prefill_scheduler/drain_meter.h"
#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// A router over `n_prefill` prefill targets n0/prefill, n1/prefill, ... and no decode target.
struct rig : router_rig {
  std::vector<std::shared_ptr<target_box>>& boxes = prefill;  ///< the name the cases use
  std::map<std::string, int32_t> sent_tokens;
  limits lim;

  rig(limits lim_, int n_prefill, route_policy_kind kind = route_policy_kind::round_robin) : lim(lim_) {
    for (int i = 0; i < n_prefill; ++i) add_target("n" + std::to_string(i) + "/prefill", "prefill", "prefill");
    router_options ro;
    ro.lim = lim;
    ro.model = model_facts{-1, 4096, 64};
    ro.policy.kind = kind;
    launch(ro);
    stats();  // the router has started (and read the clock) before a test moves it
  }

  /// Runs the actors until the targets together got `n` submissions.
  bool wait_total(size_t n) {
    return run_until(
        [&] {
          size_t t = 0;
          for (auto& b : prefill) {
            std::lock_guard lk(b->m);
            t += b->submits.size();
          }
          return t >= n;
        },
        std::to_string(n) + " submissions in all");
  }
  void submit(const std::string& id, int32_t n_tokens) {
    seq_request r;
    r.id = id;
    for (int i = 0; i < n_tokens; ++i) r.prompt.push_back(1 + i % 60);
    r.max_tokens = 4;
    router_rig::submit(r);
  }
  void credit(int target, uint64_t seq, uint64_t received, int32_t queued, int64_t tokens, double rate,
              int64_t active = 0) {
    send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
      c.setTarget("n" + std::to_string(target) + "/prefill");
      c.setRole(schema::StageRole::PREFILL);
      c.setSeq(seq);
      c.setReceived(received);
      c.setQueuedRequests(queued);
      c.setQueuedTokens(tokens);
      c.setActiveTokens(active);
      c.setTokensPerS(rate);
    }));
  }
  void fail(const std::string& id, error_kind k) {
    tandem::error e(k, "scripted refusal");
    send(make_event(id, {}, finish_reason::error, &e, 0, 0, request_stage::prefill, 0));
  }
  /// The next token of `id` (its completion index counts up from 0, as a stage numbers them).
  void token(const std::string& id, int32_t t, bool last) {
    send(make_event(id, {t}, last ? finish_reason::length : finish_reason::none, nullptr, 0, 0, request_stage::decode,
                    sent_tokens[id]++));
  }
};

}  // namespace

TEST_CASE("router admission: refuses from credits before sending, with Retry-After from the drain time") {
  limits l = small_limits();
  l.max_queued_requests = 100;
  l.max_queued_tokens = 1000;
  l.max_queue_wait_ms = 500;
  rig r(l, 1);
  // The target reports 300 tokens waiting at 1000 tokens/s: 300 ms of queue.
  r.credit(0, 1, 0, 3, 300, 1000);
  r.submit("a", 100);  // 400 ms: admitted
  REQUIRE(r.boxes[0]->wait_submits(1));
  r.submit("b", 150);  // 300 + 100 (in transit) + 150 = 550 ms > 500: refused, never sent
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("b");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::overloaded);
  CHECK(ev.reject_reason == "queue_wait");
  CHECK(ev.retry_after_ms == 50);  // drains below the bound in 550 - 500 ms
  CHECK(std::string(ev.err->what()).find("max_queue_wait_ms") != std::string::npos);
  // The queued-token bound: 400 known + 700 > 1000.
  r.submit("c", 700);
  REQUIRE(r.col.wait_finished(2));
  CHECK(r.col.last("c").reject_reason == "queue_tokens");
  CHECK(r.col.last("c").retry_after_ms == 100);  // (400 + 700 - 1000) tokens at 1000/s
  // The credit that counts "a" as received (and drained): room again.
  r.credit(0, 2, 1, 0, 0, 1000);
  r.submit("d", 150);
  REQUIRE(r.boxes[0]->wait_submits(2));
  std::lock_guard lk(r.boxes[0]->m);
  CHECK(r.boxes[0]->submit_ids() == std::vector<std::string>{"a", "d"});
}

TEST_CASE("router admission: the queue-wait bound is retuned while the router runs, and exported") {
  limits l = small_limits();
  l.max_queued_requests = 100;
  l.max_queued_tokens = 100000;
  l.max_queue_wait_ms = 0;  // off at start
  rig r(l, 1);
  CHECK(r.stats().value("queue_wait_bound_ms") == 0);
  r.credit(0, 1, 0, 3, 300, 1000);  // 300 ms of queue
  r.submit("a", 400);               // ~700 ms: admitted, no wait bound
  REQUIRE(r.boxes[0]->wait_submits(1));
  auto before = r.ask<int32_t>(r.router.handle, queue_wait_atom::value, int32_t(500));
  CHECK(before == 0);
  CHECK(r.stats().value("queue_wait_bound_ms") == 500);
  r.submit("b", 100);  // 300 + 400 (in transit) + 100 = 800 ms > 500: refused now
  REQUIRE(r.col.wait_finished(1));
  CHECK(r.col.last("b").reject_reason == "queue_wait");
  CHECK(r.col.last("b").retry_after_ms == 300);
  before = r.ask<int32_t>(r.router.handle, queue_wait_atom::value, int32_t(0));
  CHECK(before == 500);
  r.submit("c", 100);  // off again: admitted
  REQUIRE(r.boxes[0]->wait_submits(2));
}

TEST_CASE("router admission: an empty queue always admits, the request-count bound counts in-transit work") {
  limits l = small_limits();
  l.max_queued_requests = 2;
  l.max_queue_wait_ms = 10;
  rig r(l, 1);
  r.credit(0, 1, 0, 0, 0, 100);  // slow target: any prompt waits > 10 ms
  r.submit("big", 400);          // ... but nothing is ahead of it
  REQUIRE(r.boxes[0]->wait_submits(1));
  r.credit(0, 2, 1, 0, 0, 1e9);  // "big" taken and done; fast now
  r.submit("x1", 4);
  r.submit("x2", 4);
  r.submit("x3", 4);  // x1, x2 in transit = 2 queued: refused
  REQUIRE(r.col.wait_finished(1));
  CHECK(r.col.last("x3").reject_reason == "queue_requests");
  CHECK(r.stats().value("rejections_total", "actor=\"router\",reason=\"queue_requests\"") == 1);
}

TEST_CASE("router retries: overloaded before the first token goes to a fresh target after backoff") {
  limits l = small_limits();
  l.router_max_retries = 2;
  l.router_retry_base_ms = 1;
  l.router_retry_max_ms = 2;
  rig r(l, 2);
  r.submit("q", 8);
  // Round robin: target 0 first. It refuses; the retry goes to target 1.
  REQUIRE(r.boxes[0]->wait_submits(1));
  r.fail("q", error_kind::overloaded);
  r.run();
  CHECK(r.boxes[1]->submits.empty());  // not before the backoff
  r.advance_ms(l.router_retry_max_ms);
  REQUIRE(r.boxes[1]->wait_submits(1));
  r.token("q", 5, true);
  REQUIRE(r.col.wait_finished(1));
  CHECK_FALSE(r.col.last("q").err);
  CHECK(r.col.tokens("q") == std::vector<int32_t>{5});
  CHECK(r.stats().value("router_retries_total") == 1);
  // A request refused more often than router_max_retries ends with the last refusal.
  r.submit("z", 8);
  for (size_t n = 3; n <= 5; ++n) {
    REQUIRE(r.wait_total(n));
    r.fail("z", error_kind::overloaded);
    r.advance_ms(l.router_retry_max_ms);  // the backoff
  }
  REQUIRE(r.col.wait_finished(2));
  REQUIRE(r.col.last("z").err);
  CHECK(r.col.last("z").err->kind() == error_kind::overloaded);
  CHECK(r.stats().value("router_retries_total") == 3);
  CHECK(r.col.duplicate_finishes == 0);
  // `failed` is not retried.
  r.submit("f", 8);
  REQUIRE(r.wait_total(6));
  r.fail("f", error_kind::failed);
  REQUIRE(r.col.wait_finished(3));
  CHECK(r.col.last("f").err->kind() == error_kind::failed);
}

TEST_CASE("router: a target late with its credits (busy, not lost) refuses with overloaded (503), not disconnected") {
  limits l = small_limits();
  l.router_max_retries = 0;
  rig r(l, 1);
  r.credit(0, 1, 0, 0, 0, 1000);
  r.submit("fresh", 8);
  REQUIRE(r.boxes[0]->wait_submits(1));
  // No credit for more than 3 heartbeats, nothing in flight there (so it is not lost).
  r.token("fresh", 1, true);
  REQUIRE(r.col.wait_finished(1));
  r.advance_ms(3 * int64_t(l.router_heartbeat_ms) + 1);
  r.submit("late", 8);
  REQUIRE(r.col.wait_finished(2));
  auto ev = r.col.last("late");
  REQUIRE(ev.err);
  CHECK(ev.reject_reason == "no_target");
  CHECK(ev.err->kind() == error_kind::overloaded);
  CHECK(std::string(ev.err->what()).find("limits.router_heartbeat_ms") != std::string::npos);
  CHECK(ev.retry_after_ms == l.breaker_cooldown_ms);
  // A fresh credit makes it a target again.
  r.credit(0, 2, 1, 0, 0, 1000);
  r.submit("again", 8);
  REQUIRE(r.boxes[0]->wait_submits(2));
}

TEST_CASE("router circuit breaker: consecutive disconnects open it, the cooldown half-opens it") {
  limits l = small_limits();
  l.router_max_retries = 0;
  l.breaker_failures = 2;
  l.breaker_cooldown_ms = 1000;
  rig r(l, 1);
  for (int i = 0; i < 2; ++i) {
    std::string id = "d" + std::to_string(i);
    r.submit(id, 8);
    REQUIRE(r.boxes[0]->wait_submits(size_t(i + 1)));
    r.fail(id, error_kind::disconnected);
    REQUIRE(r.col.wait_finished(i + 1));
  }
  CHECK(r.stats().value("router_breaker_state", "target=\"n0/prefill\"") == 1);
  r.submit("blocked", 8);
  REQUIRE(r.col.wait_finished(3));
  CHECK(r.col.last("blocked").reject_reason == "no_target");
  CHECK(r.col.last("blocked").err->kind() == error_kind::disconnected);
  r.advance_ms(1000);
  r.credit(0, 1, 2, 0, 0, 0);  // still fresh after the clock moved
  r.submit("probe", 8);
  REQUIRE(r.boxes[0]->wait_submits(3));
  r.submit("second", 8);  // half-open: only the probe goes through
  REQUIRE(r.col.wait_finished(4));
  CHECK(r.col.last("second").reject_reason == "no_target");
  r.token("probe", 1, true);
  REQUIRE(r.col.wait_finished(5));
  CHECK(r.stats().value("router_breaker_state", "target=\"n0/prefill\"") == 0);
  r.submit("after", 8);
  REQUIRE(r.boxes[0]->wait_submits(4));
}

TEST_CASE("router health: a target silent for three heartbeats is skipped") {
  limits l = small_limits();
  l.router_heartbeat_ms = 100;
  rig r(l, 2, route_policy_kind::power_of_two);
  r.advance_ms(250);
  r.credit(1, 1, 0, 0, 0, 0);  // only target 1 speaks
  r.advance_ms(100);      // target 0: 350 ms since wiring > 300
  for (int i = 0; i < 10; ++i) r.submit("h" + std::to_string(i), 4);
  REQUIRE(r.boxes[1]->wait_submits(10));
  std::lock_guard lk(r.boxes[0]->m);
  CHECK(r.boxes[0]->submits.empty());
}

namespace {

/// A prefill target simulated on the rig's clock, run the way the prefill scheduler runs: a
/// FIFO queue, batches of up to `max_seqs` prompts / `chunk` tokens, and a forward step that
/// costs `fixed_ms` plus `ms_per_token` per token (a lone prompt drains slower than a full
/// batch). It feeds a drain_meter exactly as the scheduler does (state after every change,
/// tokens when a batch comes back) and reports the credits the scheduler would send.
struct sim_target {
  int32_t max_seqs = 8, chunk = 256;
  double fixed_ms = 20, ms_per_token = 0.3125;
  drain_meter meter;
  std::deque<std::pair<int64_t, int32_t>> waiting;  ///< (arrival ms, tokens)
  std::vector<std::pair<int64_t, int32_t>> batch;
  int64_t batch_end = -1;
  uint64_t received = 0;
  std::vector<int64_t> ttft_ms;  ///< per admitted request: arrival to end of its batch

  drain_meter::state state() const {
    if (!waiting.empty()) return drain_meter::state::queued;
    return batch_end >= 0 ? drain_meter::state::busy : drain_meter::state::idle;
  }
  void start(int64_t t) {
    int32_t tokens = 0;
    while (!waiting.empty() && int32_t(batch.size()) < max_seqs && tokens + waiting.front().second <= chunk) {
      tokens += waiting.front().second;
      batch.push_back(waiting.front());
      waiting.pop_front();
    }
    if (batch.empty()) return;
    batch_end = t + int64_t(fixed_ms + ms_per_token * tokens + 0.5);
    meter.observe(t, state(), 0);
  }
  /// Runs the target up to time `t`.
  void advance(int64_t t) {
    while (batch_end >= 0 && batch_end <= t) {
      const int64_t end = batch_end;
      int64_t tokens = 0;
      for (auto& [arrived, n] : batch) {
        tokens += n;
        ttft_ms.push_back(end - arrived);
      }
      batch.clear();
      batch_end = -1;
      meter.observe(end, state(), tokens);
      start(end);
    }
  }
  void admit(int64_t t, int32_t n) {
    received += 1;
    waiting.emplace_back(t, n);
    if (batch_end < 0) start(t);
    meter.observe(t, state(), 0);
  }
  int32_t queued_requests() const { return int32_t(waiting.size()); }
  int64_t queued_tokens() const {
    int64_t s = 0;
    for (auto& w : waiting) s += w.second;
    return s;
  }
  int64_t active_tokens() const {
    int64_t s = 0;
    for (auto& b : batch) s += b.second;
    return s;
  }
};

struct arrival_run {
  int admitted = 0, refused = 0;
  int64_t max_ttft_ms = 0;
  int would_refuse_at_busy_rate = 0;  ///< refusals had the router used the all-busy-time rate
};

/// Poisson arrivals of `n` prompts of `tokens` at `rate_per_ms` against `sim` behind the router
/// of `r` (credits before each arrival, as the scheduler sends one per change).
arrival_run run_arrivals(rig& r, sim_target& sim, uint64_t& seq, int n, int32_t tokens, double rate_per_ms,
                         uint32_t seed, int64_t bound_ms) {
  std::mt19937 rng(seed);
  std::exponential_distribution<double> gap(rate_per_ms);
  arrival_run out;
  int64_t t = r.clk->now_ms();
  double due = double(t);
  static int next_id = 0;
  for (int i = 0; i < n; ++i) {
    due += gap(rng);
    const int64_t at = int64_t(due);
    sim.advance(at);
    r.advance_ms(at - t);
    t = at;
    r.credit(0, ++seq, sim.received, sim.queued_requests(), sim.queued_tokens(), sim.meter.tokens_per_s(),
             sim.active_tokens());
    const int64_t backlog = sim.queued_tokens() + sim.active_tokens();
    const double busy = sim.meter.busy_tokens_per_s();
    if (busy > 0 && !fits_next_batch(r.lim, sim.queued_requests(), backlog, tokens) &&
        estimate_queue_wait_ms(backlog + tokens, busy) > bound_ms)
      out.would_refuse_at_busy_rate += 1;
    const double before = r.stats().value("rejections_total", "actor=\"router\",reason=\"queue_wait\"");
    r.submit("s" + std::to_string(next_id++), tokens);
    if (r.stats().value("rejections_total", "actor=\"router\",reason=\"queue_wait\"") > before) {
      out.refused += 1;
    } else {
      out.admitted += 1;
      sim.admit(at, tokens);
    }
  }
  // Drain: every admitted request's batch ends.
  sim.advance(std::numeric_limits<int64_t>::max() / 2);
  for (auto v : sim.ttft_ms) out.max_ttft_ms = std::max(out.max_ttft_ms, v);
  sim.ttft_ms.clear();
  return out;
}

}  // namespace

TEST_CASE("router admission: arrivals at 0.8x capacity are not refused, a 3x burst is held to the wait bound") {
  // Capacity of the simulated target: full batches of 8 x 32 tokens in 20 + 80 ms = 80 req/s;
  // a lone prompt takes 30 ms (33 req/s if every batch were lone).
  limits l = small_limits();
  l.prefill_chunk_tokens = 256;
  l.max_prefill_batch_seqs = 8;
  l.max_queued_requests = 1000;
  l.max_queued_tokens = 1 << 20;
  l.max_queue_wait_ms = 300;  // ~24 requests ahead at the saturated rate
  rig r(l, 1);
  sim_target sim;
  uint64_t seq = 0;
  const double capacity_per_ms = 8.0 / 100.0;
  // Warm: the meter reports nothing until it saw a queue; the bounds on requests and tokens hold.
  auto warm = run_arrivals(r, sim, seq, 100, 32, 0.8 * capacity_per_ms, 7, l.max_queue_wait_ms);
  CHECK(warm.refused == 0);
  REQUIRE(sim.meter.tokens_per_s() > 0);
  // The saturated drain rate is 2560 tokens/s; the meter must be near it, not at a lone prompt's 1067.
  CHECK(sim.meter.tokens_per_s() > 1800);
  auto normal = run_arrivals(r, sim, seq, 400, 32, 0.8 * capacity_per_ms, 11, l.max_queue_wait_ms);
  INFO("0.8x: admitted " << normal.admitted << ", refused " << normal.refused << ", max ttft " << normal.max_ttft_ms
                         << " ms, would refuse at the busy rate " << normal.would_refuse_at_busy_rate
                         << ", meter " << sim.meter.tokens_per_s() << " tokens/s");
  CHECK(normal.refused == 0);
  auto burst = run_arrivals(r, sim, seq, 400, 32, 3.0 * capacity_per_ms, 13, l.max_queue_wait_ms);
  INFO("3x: admitted " << burst.admitted << ", refused " << burst.refused << ", max ttft " << burst.max_ttft_ms);
  CHECK(burst.refused > 100);
  // Admitted requests wait at most the bound plus their own batch (and the estimate's slack).
  CHECK(burst.max_ttft_ms <= int64_t(1.5 * l.max_queue_wait_ms));
  CHECK(r.col.duplicate_finishes == 0);
}

TEST_CASE("router: log-probabilities stay paired with their tokens through reordering and duplicates") {
  rig r(small_limits(), 1);
  r.submit("lp", 8);
  REQUIRE(r.boxes[0]->wait_submits(1));
  auto lp = [](std::vector<int32_t> ts) {
    std::vector<token_logprobs> v;
    for (int32_t t : ts) v.push_back({t, -float(t), {{t, -float(t)}}});
    return v;
  };
  r.send(make_event("lp", {10}, finish_reason::none, nullptr, 0, 0, request_stage::prefill, 0, lp({10})));
  r.send(make_event("lp", {12}, finish_reason::none, nullptr, 0, 0, request_stage::decode, 2, lp({12})));  // early: held back
  r.send(make_event("lp", {10, 11}, finish_reason::none, nullptr, 0, 0, request_stage::decode, 0, lp({10, 11})));  // 10 again
  r.send(make_event("lp", {13}, finish_reason::length, nullptr, 0, 0, request_stage::decode, 3, lp({13})));
  REQUIRE(r.col.wait_finished(1));
  CHECK(r.col.tokens("lp") == std::vector<int32_t>{10, 11, 12, 13});
  std::lock_guard lk(r.col.m);
  for (const auto& ev : r.col.events["lp"]) {
    REQUIRE(ev.logprobs.size() == ev.tokens.size());
    for (size_t i = 0; i < ev.tokens.size(); ++i) {
      CHECK(ev.logprobs[i].token == ev.tokens[i]);
      CHECK(ev.logprobs[i].logprob == -float(ev.tokens[i]));
    }
  }
}
