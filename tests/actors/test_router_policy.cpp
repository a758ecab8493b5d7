// Router policies (actors/router/router_policy.h): pure logic, seeded RNG, manual time.
#include <doctest/doctest.h>

#include <map>
#include <numeric>

#include "actors/router/router_policy.h"

using namespace tandem;

namespace {

std::vector<int32_t> prompt_of(int32_t base, int32_t n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), base);
  return p;
}

std::vector<target_load> loads_of(std::vector<int64_t> queued) {
  std::vector<target_load> v;
  for (auto q : queued) {
    target_load l;
    l.queued_tokens = q;
    v.push_back(l);
  }
  return v;
}

route_policy make(route_policy_kind k, uint64_t seed = 42) {
  route_policy_options o;
  o.kind = k;
  return route_policy(o, seed);
}

}  // namespace

TEST_CASE("router_policy: names parse and print") {
  for (auto k : {route_policy_kind::round_robin, route_policy_kind::power_of_two, route_policy_kind::cache_aware})
    CHECK(parse_route_policy(to_string(k)) == k);
  CHECK_FALSE(parse_route_policy("random").has_value());
}

TEST_CASE("router_policy: round_robin cycles over eligible targets only") {
  auto p = make(route_policy_kind::round_robin);
  auto loads = loads_of({0, 0, 0, 0});
  std::vector<bool> ok = {true, false, true, true};
  std::map<int, int> n;
  for (int i = 0; i < 300; ++i) n[p.choose_prefill(prompt_of(0, 8), loads, ok)] += 1;
  CHECK(n.count(1) == 0);
  CHECK(n[0] == 100);
  CHECK(n[2] == 100);
  CHECK(n[3] == 100);
  CHECK(p.choose_prefill(prompt_of(0, 8), loads, {false, false, false, false}) == -1);
}

TEST_CASE("router_policy: power_of_two never picks the more loaded of its two choices and spreads load") {
  auto p = make(route_policy_kind::power_of_two, 7);
  // Simulated cluster: each choice adds the prompt's tokens to the chosen target; targets
  // drain equally. The max/min spread must stay small (two choices ~ log log n imbalance).
  std::vector<target_load> loads = loads_of({0, 0, 0, 0, 0, 0, 0, 0});
  std::vector<bool> ok(8, true);
  std::map<int, int> picks;
  for (int i = 0; i < 4000; ++i) {
    int t = p.choose_prefill(prompt_of(0, 16), loads, ok);
    REQUIRE(t >= 0);
    picks[t] += 1;
    loads[size_t(t)].queued_tokens += 100;
    for (auto& l : loads) l.queued_tokens = std::max<int64_t>(0, l.queued_tokens - 12);
  }
  int64_t hi = 0, lo = INT64_MAX;
  for (auto& l : loads) hi = std::max(hi, l.queued_tokens), lo = std::min(lo, l.queued_tokens);
  CHECK(hi - lo <= 300);
  for (int t = 0; t < 8; ++t) CHECK(picks[t] > 4000 / 8 / 2);
  // The heavily loaded target is only ever chosen when both samples hit it: never with 2+ targets.
  auto skew = loads_of({1000000, 0, 0, 0});
  for (int i = 0; i < 200; ++i) CHECK(p.choose_prefill(prompt_of(0, 4), skew, {true, true, true, true}) != 0);
}

TEST_CASE("router_policy: power_of_two is deterministic for a seed") {
  auto a = make(route_policy_kind::power_of_two, 99), b = make(route_policy_kind::power_of_two, 99);
  auto loads = loads_of({5, 3, 9, 1, 4});
  std::vector<bool> ok(5, true);
  for (int i = 0; i < 100; ++i) CHECK(a.choose_prefill({}, loads, ok) == b.choose_prefill({}, loads, ok));
}

TEST_CASE("prefix_index: match, per-target bits, LRU bound") {
  prefix_index idx(4, 8);
  auto p = prompt_of(100, 16);  // 4 blocks
  idx.insert(p, 2);
  CHECK(idx.match(p, 2) == 16);
  CHECK(idx.match(p, 1) == 0);
  auto q = p;
  q[9] = 7;  // diverges in block 2
  CHECK(idx.match(q, 2) == 8);
  CHECK(idx.match(prompt_of(100, 6), 2) == 4);  // partial block does not count
  auto all = idx.match_all(p, 3);
  CHECK(all == std::vector<int32_t>{0, 0, 16});
  // Bound: 8 nodes; inserting 3 more distinct 4-block prompts evicts the least recently used.
  for (int i = 0; i < 3; ++i) idx.insert(prompt_of(1000 * (i + 1), 16), 0);
  CHECK(idx.size() <= 8);
  CHECK(idx.evictions() > 0);
  CHECK(idx.match(p, 2) < 16);  // the oldest prefix went first
  CHECK(idx.match(prompt_of(3000, 16), 0) == 16);  // the newest stays
  idx.forget(0);
  CHECK(idx.match(prompt_of(3000, 16), 0) == 0);
}

TEST_CASE("router_policy: cache_aware follows the cached prefix while balanced") {
  auto p = make(route_policy_kind::cache_aware);
  auto loads = loads_of({0, 0, 0, 0});
  std::vector<bool> ok(4, true);
  auto sys = prompt_of(500, 64);
  // First request: nothing cached, least loaded (target 0 on ties).
  int first = p.choose_prefill(sys, loads, ok);
  p.on_routed(sys, first);
  // Same-prefix requests follow it even when it is a bit more loaded.
  loads[size_t(first)].queued_tokens = 1000;
  for (int i = 0; i < 20; ++i) {
    auto q = sys;
    q.push_back(i);  // a different suffix
    int32_t cached = 0;
    int t = p.choose_prefill(q, loads, ok, &cached);
    CHECK(t == first);
    CHECK(cached == 64);
    p.on_routed(q, t);
  }
  // An unrelated prompt goes to the least loaded target.
  loads = loads_of({1000, 10, 0, 500});
  CHECK(p.choose_prefill(prompt_of(9000, 64), loads, ok) == 2);
}

TEST_CASE("router_policy: a hot prefix does not overload one worker (balance thresholds)") {
  route_policy_options o;
  o.kind = route_policy_kind::cache_aware;
  o.balance_abs_tokens = 512;
  o.balance_rel = 1.5;
  route_policy p(o, 1);
  std::vector<target_load> loads = loads_of({0, 0, 0, 0});
  std::vector<bool> ok(4, true);
  auto hot = prompt_of(7, 256);
  // Every request shares the hot prefix; each adds 256 tokens to its target, targets drain 64 each.
  std::map<int, int> picks;
  for (int i = 0; i < 2000; ++i) {
    auto q = hot;
    q.push_back(i % 50);
    int t = p.choose_prefill(q, loads, ok);
    REQUIRE(t >= 0);
    picks[t] += 1;
    p.on_routed(q, t);
    loads[size_t(t)].queued_tokens += 256;
    for (auto& l : loads) l.queued_tokens = std::max<int64_t>(0, l.queued_tokens - 64);
    int64_t hi = 0, lo = INT64_MAX;
    for (auto& l : loads) hi = std::max(hi, l.queued_tokens), lo = std::min(lo, l.queued_tokens);
    // The spread never grows beyond the absolute threshold plus one request.
    CHECK(hi - lo <= o.balance_abs_tokens + 256 + 64);
  }
  CHECK(p.balance_fallbacks() > 0);
  for (int t = 0; t < 4; ++t) CHECK(picks[t] > 2000 / 4 / 2);
}

TEST_CASE("router_policy: choose_decode prefers the emptiest batch") {
  auto p = make(route_policy_kind::power_of_two);
  std::vector<target_load> d(3);
  d[0].running_seqs = 5;
  d[1].running_seqs = 2;
  d[1].waiting_seqs = 2;
  d[2].running_seqs = 3;
  d[2].free_pages = 100;
  d[1].free_pages = 10;
  CHECK(p.choose_decode(d, {true, true, true}) == 2);  // 5, 4, 3 sequences
  d[2].running_seqs = 4;
  CHECK(p.choose_decode(d, {true, true, true}) == 2);  // tie at 4: more free pages
  CHECK(p.choose_decode(d, {true, true, false}) == 1);
  CHECK(p.choose_decode(d, {false, false, false}) == -1);
}

TEST_CASE("conditional disaggregation: short uncached prompts are prefilled locally only when queues are long") {
  local_prefill_rule r;
  r.max_uncached_tokens = 128;
  r.min_queue_wait_ms = 200;
  r.min_free_batch_slots = 1;
  target_load dec;
  dec.max_running_seqs = 8;
  dec.running_seqs = 4;
  CHECK(prefill_locally(r, 100, 0, 500, dec));
  CHECK_FALSE(prefill_locally(r, 100, 0, 50, dec));    // queue short: disaggregate
  CHECK_FALSE(prefill_locally(r, 100, 0, -1, dec));    // rate unknown: disaggregate
  CHECK_FALSE(prefill_locally(r, 400, 0, 500, dec));   // long prompt
  CHECK(prefill_locally(r, 400, 300, 500, dec));       // long but mostly cached
  dec.running_seqs = 8;
  CHECK_FALSE(prefill_locally(r, 100, 0, 500, dec));   // decode batch full
  r.max_uncached_tokens = 0;
  dec.running_seqs = 0;
  CHECK_FALSE(prefill_locally(r, 1, 0, 100000, dec));  // off
  CHECK(estimate_queue_wait_ms(1000, 0) == -1);
  CHECK(estimate_queue_wait_ms(1000, 2000) == 500);
  CHECK(estimate_queue_wait_ms(0, 2000) == 0);
}

TEST_CASE("backoff: exponential, capped, jittered within [d/2, d], deterministic per seed") {
  backoff_policy b;
  b.base_ms = 10;
  b.max_ms = 100;
  std::mt19937_64 r1(3), r2(3);
  for (int a = 1; a <= 8; ++a) {
    const int64_t cap = std::min<int64_t>(100, int64_t(10) << (a - 1));
    for (int k = 0; k < 20; ++k) {
      int64_t d = b.delay_ms(a, r1);
      CHECK(d >= cap / 2);
      CHECK(d <= cap);
      CHECK(d == b.delay_ms(a, r2));
    }
  }
}

TEST_CASE("circuit_breaker: closed -> open after N failures -> half-open after cooldown -> closed or open") {
  circuit_breaker cb(3, 1000);
  int64_t t = 0;
  CHECK(cb.current(t) == circuit_breaker::state::closed);
  cb.on_failure(t);
  cb.on_failure(t);
  cb.on_success();  // a success resets the count
  cb.on_failure(t);
  cb.on_failure(t);
  CHECK(cb.allow(t));
  cb.on_failure(t);
  CHECK(cb.current(t) == circuit_breaker::state::open);
  CHECK_FALSE(cb.allow(t + 999));
  CHECK(cb.opens() == 1);
  // Half-open: exactly one probe.
  CHECK(cb.current(t + 1000) == circuit_breaker::state::half_open);
  CHECK(cb.would_allow(t + 1000));
  CHECK(cb.allow(t + 1000));
  CHECK_FALSE(cb.allow(t + 1001));
  CHECK_FALSE(cb.would_allow(t + 1001));
  // The probe fails: open again, for another cooldown from now.
  cb.on_failure(t + 1100);
  CHECK(cb.current(t + 1100) == circuit_breaker::state::open);
  CHECK_FALSE(cb.allow(t + 2099));
  CHECK(cb.allow(t + 2100));
  cb.on_success();
  CHECK(cb.current(t + 2100) == circuit_breaker::state::closed);
  CHECK(cb.opens() == 2);
}

TEST_CASE("target_health: fresh credits keep a target healthy, silence makes it stale") {
  target_health h(3000);
  CHECK(h.healthy(2000, 0));      // never heard from: grace from wiring time
  CHECK_FALSE(h.healthy(3001, 0));
  h.on_credit(5000);
  CHECK(h.healthy(8000, 0));
  CHECK_FALSE(h.healthy(8001, 0));
  CHECK(h.age_ms(8001, 0) == 3001);
}
