// End-to-end through the actors (router -> prefill -> handoff -> decode) with a fake model, on
// the test scheduler (tests/actors/cluster_rig.h): a forward gate holds the worker's jobs, time
// moves only by advance_ms. One case stays threaded on purpose: many submitters on their own
// threads at once (submit's thread safety) on a cluster of real CAF threads.
#include <doctest/doctest.h>

#include <set>

#include "kernels/base/clock.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;

namespace {

actor_cluster_options opts(limits l, std::shared_ptr<const cluster_clock> clk = nullptr) {
  actor_cluster_options o;
  o.lim = l;
  o.sink = quiet_sink();
  o.clock = std::move(clk);
  o.eos_id = -1;
  return o;
}

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 5 + salt * 11 + 1) % 64);
  return p;
}


template <class Cluster>
std::vector<std::vector<int32_t>> run_all(Cluster& c, const std::vector<completion_request>& reqs) {
  collector col;
  for (auto r : reqs) c.submit(r, col.cb());
  REQUIRE(col.wait_finished(static_cast<int>(reqs.size())));
  CHECK(col.duplicate_finishes == 0);
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : reqs) {
    auto last = col.last(r.request_id);
    CHECK(last.finished);
    if (last.err) FAIL_CHECK(last.err->what());
    CHECK(last.reason == finish_reason::length);
    out.push_back(col.tokens(r.request_id));
  }
  return out;
}

}  // namespace

TEST_CASE("cluster(fake): greedy output matches the model and is batching invariant") {
  auto l = small_limits();
  l.prefix_cache = false;
  std::vector<completion_request> reqs;
  for (int i = 0; i < 8; ++i)
    reqs.push_back(make_req("r" + std::to_string(i), prompt_of(3 + i * 5, i), 10 + i));
  std::vector<std::vector<int32_t>> alone;
  {
    cluster_rig c(std::make_shared<fake_model>(), opts(l));
    for (const auto& r : reqs) alone.push_back(run_all(c, {r})[0]);
    CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
  }
  for (size_t i = 0; i < reqs.size(); ++i)
    CHECK(alone[i] == expected_greedy(reqs[i].prompt, reqs[i].max_tokens));
  cluster_rig c(std::make_shared<fake_model>(), opts(l));
  auto together = run_all(c, reqs);
  CHECK(together == alone);
  auto st = c.stats();
  CHECK(st.requests_total == 8);
  int64_t want = 0;
  for (auto& r : reqs) want += r.max_tokens;
  CHECK(st.tokens_generated == want);
  CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
  auto text = c.metrics_text();
  for (const char* name :
       {"tandem_requests_total 8", "tandem_ttft_ms_bucket", "tandem_tpot_ms_count", "tandem_e2e_ms_sum",
        "tandem_mailbox_depth{actor=\"decode\"}", "tandem_kv_pages_free",
        "tandem_mailbox_rejected_total{actor=\"router\"} 0", "tandem_decode_steps_total"})
    CHECK_MESSAGE(text.find(name) != std::string::npos, name);
}

TEST_CASE("cluster(fake): seeded sampling is the same alone and batched") {
  auto l = small_limits();
  std::vector<completion_request> reqs;
  for (int i = 0; i < 6; ++i)
    reqs.push_back(make_req("s" + std::to_string(i), prompt_of(9, i), 12, 1.5f, 100 + i));
  std::vector<std::vector<int32_t>> alone;
  {
    cluster_rig c(std::make_shared<fake_model>(), opts(l));
    for (const auto& r : reqs) alone.push_back(run_all(c, {r})[0]);
  }
  cluster_rig c(std::make_shared<fake_model>(), opts(l));
  CHECK(run_all(c, reqs) == alone);
}

TEST_CASE("cluster(fake): prefix cache on and off give the same output, hits are counted") {
  std::vector<int32_t> shared = prompt_of(21, 3);
  std::vector<completion_request> reqs;
  for (int i = 0; i < 4; ++i) {
    auto p = shared;
    p.push_back(i + 1);
    reqs.push_back(make_req("p" + std::to_string(i), p, 8));
  }
  auto run = [&](bool cache, stats_snapshot* prefill_stats, int64_t* hit_tokens) {
    auto l = small_limits();
    l.prefix_cache = cache;
    cluster_rig c(std::make_shared<fake_model>(), opts(l));
    std::vector<std::vector<int32_t>> out;
    std::vector<int32_t> cached;
    for (const auto& r : reqs) {  // one after another, so later ones find the first one's pages
      collector col;
      c.submit(r, col.cb());
      REQUIRE(col.wait_finished(1));
      out.push_back(col.tokens(r.request_id));
      cached.push_back(col.last(r.request_id).cached_tokens);
    }
    double hits = 0, tokens = 0;
    for (auto& s : c.snapshots()) {
      hits += s.value("prefix_cache_hits_total");
      tokens += s.value("prefix_cache_hit_tokens_total");
      if (s.actor == "prefill" && prefill_stats) *prefill_stats = s;
    }
    *hit_tokens = int64_t(tokens);
    if (cache) {
      CHECK(hits == 3);
      CHECK(cached == std::vector<int32_t>{0, 20, 20, 20});  // 21 shared tokens -> 5 whole pages of 4
    } else {
      CHECK(hits == 0);
      CHECK(cached == std::vector<int32_t>{0, 0, 0, 0});
    }
    return out;
  };
  stats_snapshot on_stats, off_stats;
  int64_t on_hits = 0, off_hits = 0;
  auto on = run(true, &on_stats, &on_hits);
  auto off = run(false, &off_stats, &off_hits);
  CHECK(on == off);
  CHECK(on_hits == 60);
  // The cache saved prefill work.
  CHECK(on_stats.value("prefill_tokens_total") == off_stats.value("prefill_tokens_total") - 60);
}

TEST_CASE("cluster(fake): admission bounds reject explicitly and lose no request") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  auto l = small_limits();
  l.max_queued_requests = 2;
  l.max_prefill_batch_seqs = 1;
  cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
  collector col;
  c.submit(make_req("a0", prompt_of(5, 0), 4), col.cb());
  REQUIRE(gate->wait_paused());
  for (int i = 1; i < 6; ++i) c.submit(make_req("a" + std::to_string(i), prompt_of(5, i), 4), col.cb());
  REQUIRE(col.wait_finished(3));  // a3..a5 cannot queue
  for (int i = 3; i < 6; ++i) {
    auto ev = col.last("a" + std::to_string(i));
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::overloaded);
    CHECK(std::string(ev.err->what()).find("max_queued_requests") != std::string::npos);
  }
  gate->release();
  REQUIRE(col.wait_finished(6));
  for (int i = 0; i < 3; ++i) CHECK(col.tokens("a" + std::to_string(i)).size() == 4);
  CHECK(col.duplicate_finishes == 0);
  // Prefix cache on: every page is free or held by the cache alone.
  CHECK(wait_stats(c, [&](const stats_info&) {
    double free = 0, cached = 0;
    for (auto& s : c.snapshots()) free += s.value("kv_pages_free"), cached += s.value("kv_pages_evictable");
    return free + cached == c.n_pages();
  }));
  // The router refuses from the prefill scheduler's credits before sending; the scheduler's
  // own bound is the backstop for what was in transit when its credit was sent.
  double refused = 0;
  for (auto& x : c.snapshots()) {
    refused += x.value("rejections_total", "actor=\"router\",reason=\"queue_requests\"");
    refused += x.value("rejections_total", "actor=\"prefill\",reason=\"queue_requests\"");
  }
  CHECK(refused == 3);
  auto ev = col.last("a5");
  CHECK(ev.reject_reason == "queue_requests");
}

TEST_CASE("cluster(fake): prefill on the decode worker pauses while decode is backed up, loses nothing") {
  // 24 four-token prompts at once, 20 tokens each, a decode batch of 2: prefill (4 prompts a
  // step) outruns decode. Sharing the worker, prefill holds its steps while 2 sequences wait
  // for a batch slot (counting its handoffs on their way, which decode's credits count as
  // taken), so the backlog stays below that plus one step's handoffs; never pausing, it holds
  // nearly every request.
  std::vector<completion_request> reqs;
  for (int i = 0; i < 24; ++i) reqs.push_back(make_req("p" + std::to_string(i), prompt_of(4, i), 20));
  auto l = small_limits();
  l.prefix_cache = false;
  l.device_pages = 512;
  l.max_running_seqs = 2;
  l.max_prefill_batch_seqs = 4;
  l.max_decode_waiting_seqs = -1;  // the router's refusal would hide the backlog
  for (int32_t pause_at : {0, -1}) {
    CAPTURE(pause_at);
    l.prefill_pause_decode_waiting_seqs = pause_at;
    cluster_rig c(std::make_shared<fake_model>(), opts(l));
    auto out = run_all(c, reqs);
    for (size_t i = 0; i < reqs.size(); ++i) CHECK(out[i] == expected_greedy(reqs[i].prompt, reqs[i].max_tokens));
    CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
    double high = 0, pauses = 0;
    for (auto& x : c.snapshots()) {
      high += x.value("decode_waiting_requests_high_water");
      pauses += x.value("prefill_decode_pauses_total");
    }
    if (pause_at == 0) {
      CHECK(pauses > 0);
      CHECK(high <= 2 - 1 + 4);  // below the pause point, plus one step's handoffs
    } else {
      CHECK(pauses == 0);
      CHECK(high > 2 - 1 + 4);
    }
  }
}

TEST_CASE("cluster(fake): the queue-wait bound is set live through the cluster, a bad one is refused") {
  auto l = small_limits();
  l.max_queue_wait_ms = 300;
  cluster_rig c(std::make_shared<fake_model>(), opts(l));
  CHECK(c.set_max_queue_wait_ms(50) == 300);
  CHECK(c.metrics_text().find("tandem_queue_wait_bound_ms 50") != std::string::npos);
  CHECK_THROWS_WITH_AS(c.set_max_queue_wait_ms(-1), doctest::Contains("must be >= 0"), tandem::error);
  CHECK(c.set_max_queue_wait_ms(0) == 50);  // off
  auto out = run_all(c, {make_req("q0", prompt_of(6, 1), 5)});
  CHECK(out[0] == expected_greedy(prompt_of(6, 1), 5));
}

TEST_CASE("cluster(fake): queued-token bound rejects explicitly") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  auto l = small_limits();
  l.max_queued_tokens = 30;
  l.max_prefill_batch_seqs = 1;
  cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
  collector col;
  c.submit(make_req("t0", prompt_of(20, 0), 2), col.cb());
  REQUIRE(gate->wait_paused());
  c.submit(make_req("t1", prompt_of(20, 1), 2), col.cb());  // waits (20 <= 30)
  c.submit(make_req("t2", prompt_of(20, 2), 2), col.cb());  // 40 > 30: refused
  REQUIRE(col.wait_finished(1));
  auto ev = col.last("t2");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::overloaded);
  CHECK(std::string(ev.err->what()).find("max_queued_tokens") != std::string::npos);
  gate->release();
  REQUIRE(col.wait_finished(3));
  CHECK(col.tokens("t1").size() == 2);
}

TEST_CASE("cluster(fake): invalid requests fail with a message, router in-flight bound") {
  auto l = small_limits();
  l.max_inflight_requests = 1;
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
  collector col;
  c.submit(make_req("ok", prompt_of(5, 0), 3), col.cb());
  REQUIRE(gate->wait_paused());
  c.submit(make_req("busy", prompt_of(5, 1), 3), col.cb());
  c.submit(make_req("empty", {}, 3), col.cb());
  c.submit(make_req("vocab", {1, 999}, 3), col.cb());
  c.submit(make_req("long", std::vector<int32_t>(600, 1), 3), col.cb());
  auto bad_temp = make_req("temp", {1}, 3, -1.0f);
  c.submit(bad_temp, col.cb());
  REQUIRE(col.wait_finished(5));
  CHECK(col.last("busy").err->kind() == error_kind::overloaded);
  CHECK(std::string(col.last("busy").err->what()).find("max_inflight_requests") != std::string::npos);
  for (const char* id : {"empty", "vocab", "long", "temp"}) {
    auto ev = col.last(id);
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::failed);
  }
  CHECK(std::string(col.last("vocab").err->what()).find("999") != std::string::npos);
  gate->release();
  REQUIRE(col.wait_finished(6));
}

TEST_CASE("cluster(fake): abort while queued, mid-prefill and mid-decode frees every page") {
  auto l = small_limits();
  l.prefix_cache = false;
  l.max_prefill_batch_seqs = 1;
  SUBCASE("queued") {
    auto gate = std::make_shared<forward_gate>();
    gate->pause_at = 0;
    cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
    collector col;
    c.submit(make_req("q0", prompt_of(6, 0), 5), col.cb());
    REQUIRE(gate->wait_paused());
    c.submit(make_req("q1", prompt_of(6, 1), 5), col.cb());
    c.abort("q1");
    REQUIRE(col.wait_finished(1));
    CHECK(col.last("q1").reason == finish_reason::abort);
    CHECK(col.tokens("q1").empty());
    gate->release();
    REQUIRE(col.wait_finished(2));
    CHECK(col.tokens("q0").size() == 5);
    CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
  }
  SUBCASE("mid-prefill") {
    auto gate = std::make_shared<forward_gate>();
    gate->pause_at = 1;  // second chunk of a 40-token prompt (chunks of 16)
    cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
    collector col;
    c.submit(make_req("m0", prompt_of(40, 0), 5), col.cb());
    REQUIRE(gate->wait_paused());
    c.abort("m0");
    REQUIRE(col.wait_finished(1));
    CHECK(col.last("m0").reason == finish_reason::abort);
    gate->release();
    CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
  }
  SUBCASE("mid-decode") {
    auto gate = std::make_shared<forward_gate>();
    gate->pause_at = 4;  // prefill is call 0, decode steps follow
    cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
    collector col;
    c.submit(make_req("d0", prompt_of(6, 0), 50), col.cb());
    REQUIRE(gate->wait_paused());
    c.abort("d0");
    REQUIRE(col.wait_finished(1));
    CHECK(col.last("d0").reason == finish_reason::abort);
    CHECK(col.tokens("d0").size() == 4);
    gate->release();
    CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
    // The cluster keeps serving.
    c.submit(make_req("d1", prompt_of(6, 0), 3), col.cb());
    REQUIRE(col.wait_finished(2));
    CHECK(col.tokens("d1") == expected_greedy(prompt_of(6, 0), 3));
  }
}

TEST_CASE("cluster(fake): deadline expiry in prefill and in the queue (injected clock)") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  auto l = small_limits();
  l.prefix_cache = false;
  l.request_timeout_ms = 1000;
  l.max_prefill_batch_seqs = 1;
  cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
  collector col;
  c.submit(make_req("x0", prompt_of(6, 0), 5), col.cb());
  REQUIRE(gate->wait_paused());
  c.submit(make_req("x1", prompt_of(6, 1), 5), col.cb());
  // Make sure both were accepted before time moves.
  REQUIRE(wait_stats(c, [](const stats_info& s) { return s.requests_total == 2; }));
  c.advance_ms(1500);
  REQUIRE(col.wait_finished(2));
  for (const char* id : {"x0", "x1"}) {
    auto ev = col.last(id);
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::overloaded);
    CHECK(std::string(ev.err->what()).find("request_timeout_ms") != std::string::npos);
  }
  // Running past the deadline (x0, in prefill) and never starting (x1, queued) differ: the
  // second is a queue timeout (504 at the front end).
  CHECK(std::string(col.last("x0").err->what()).find("request deadline exceeded after 1500 ms in state prefill") !=
        std::string::npos);
  CHECK(col.last("x0").reject_reason == "deadline");
  CHECK(std::string(col.last("x1").err->what()).find("waited 1500 ms in the prefill queue") != std::string::npos);
  CHECK(col.last("x1").reject_reason == "queue_timeout");
  gate->release();
  CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == c.n_pages(); }));
  CHECK(c.metrics_text().find("reason=\"deadline\"} 1") != std::string::npos);
  CHECK(c.metrics_text().find("reason=\"queue_timeout\"} 1") != std::string::npos);
}

TEST_CASE("cluster(fake): page exhaustion preempts the youngest and keeps outputs, lone overflow fails") {
  auto l = small_limits();
  l.device_pages = 8;  // 32 tokens of KV
  l.prefix_cache = false;
  std::vector<completion_request> reqs;
  for (int i = 0; i < 3; ++i) reqs.push_back(make_req("e" + std::to_string(i), prompt_of(6, i), 12));
  // The first forward waits until all three are accepted, so they run together however slow
  // the machine is (an ASan build on a busy CI runner once finished e0 before e2 came in).
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
  c.timers_within_ms = 1000;  // a preempted sequence is taken again on the decode scheduler's retry tick
  collector first;
  for (const auto& r : reqs) c.submit(r, first.cb());
  REQUIRE(gate->wait_paused());
  REQUIRE(wait_stats(c, [](const stats_info& s) { return s.requests_total == 3; }));
  gate->release();
  REQUIRE(first.wait_finished(3));  // each needs 5 pages at the end; together 15 > 8
  CHECK(first.duplicate_finishes == 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    auto last = first.last(reqs[i].request_id);
    if (last.err) FAIL_CHECK(last.err->what());
    CHECK(first.tokens(reqs[i].request_id) == expected_greedy(reqs[i].prompt, 12));
  }
  double preemptions = 0;
  for (auto& s : c.snapshots()) preemptions += s.value("decode_preemptions_total");
  CHECK(preemptions >= 1);
  CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == 8; }));

  collector col;
  c.submit(make_req("big", prompt_of(6, 0), 40), col.cb());   // 46 tokens > 32: runs out in decode
  c.submit(make_req("huge", prompt_of(40, 0), 2), col.cb());  // the prompt alone needs 10 pages
  REQUIRE(col.wait_finished(2));
  auto big = col.last("big");
  REQUIRE(big.err);
  CHECK(big.err->kind() == error_kind::overloaded);
  CHECK(col.tokens("big").size() >= 20);
  auto huge = col.last("huge");
  REQUIRE(huge.err);
  CHECK(huge.err->kind() == error_kind::overloaded);
  CHECK(wait_stats(c, [&](const stats_info& s) { return s.kv_pages_free == 8; }));
}

TEST_CASE("cluster(fake): shutdown ends running requests with disconnected and does not hang") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 2;
  collector col;
  col.on_event = [&](const token_event& ev) {
    if (ev.finished) gate->release();  // let the blocked forward return so the worker can exit
  };
  {
    auto l = small_limits();
    cluster_rig c(std::make_shared<fake_model>(gate), opts(l));
    c.submit(make_req("z0", prompt_of(6, 0), 100), col.cb());
    REQUIRE(gate->wait_paused());
  }
  REQUIRE(col.wait_finished(1));
  auto ev = col.last("z0");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  CHECK(col.duplicate_finishes == 0);
}

TEST_CASE("cluster(fake): many concurrent submitters, every request ends exactly once") {
  auto l = small_limits();
  l.router_mailbox = 8;
  l.max_queued_requests = 16;
  l.device_pages = 32;
  actor_cluster c(std::make_shared<fake_model>(), opts(l));
  collector col;
  const int n = 120;
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t)
    ts.emplace_back([&, t] {
      for (int i = 0; i < n / 3; ++i)
        c.submit(
            make_req("c" + std::to_string(t) + "_" + std::to_string(i), prompt_of(4 + i % 9, i), 3 + i % 5),
            col.cb());
    });
  for (auto& t : ts) t.join();
  REQUIRE(col.wait_finished(n));
  CHECK(col.duplicate_finishes == 0);
  int ok = 0, overloaded = 0;
  for (auto& [id, evs] : col.events) {
    auto& last = evs.back();
    if (!last.err) {
      ++ok;
    } else {
      CHECK(last.err->kind() == error_kind::overloaded);
      ++overloaded;
    }
  }
  CHECK(ok + overloaded == n);
  CHECK(ok > 0);
  CHECK(wait_stats(c, [&](const stats_info&) {
    double free = 0, cached = 0;
    for (auto& s : c.snapshots()) free += s.value("kv_pages_free"), cached += s.value("kv_pages_evictable");
    return free + cached == c.n_pages();
  }));
}
