// Conditional disaggregation acted on: the router sends a short prompt to its decode target,
// which prefills it as chunks of its own decode steps (beside the sequences it is decoding)
// and then decodes it. Prefill and decode run as two nodes' schedulers ("p0", "d0") over one
// worker with the fake model, so the outputs can be compared with the disaggregated path and
// with the model's own rule. On the test scheduler (tests/actors/test_system.h).
#include <doctest/doctest.h>

#include <caf/all.hpp>

#include "actors/common/protocol.h"
#include "actors/cache_tier/cache_tier.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/worker/worker.h"
#include "tests/actors/support.h"
#include "tests/actors/test_system.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct two_nodes : test_system {
  bounded_actor worker, cache, prefill, decode, router;
  collector col;

  two_nodes(limits lim, local_prefill_rule rule) {
    start();
    col.pump = [this](const std::function<bool()>& ok, const std::string& what) { return run_until(ok, what); };
    auto model = std::make_shared<fake_model>();
    const kv_layout layout = model->layout(lim.page_size);
    const model_facts facts{-1, 512, 64};
    worker_options wo;
    wo.n_pages = lim.device_pages;
    wo.pools = model->pools_layout(lim.page_size);
    wo.detached = false;  // on the test scheduler's one thread
    worker = spawn_worker(*sys, model, wo, make_actor_logger("worker", quiet_sink(), "off"));
    cache_tier_options co;
    co.n_pages = lim.device_pages;
    co.prefix_cache = lim.prefix_cache;
    co.layout = layout;
    cache = spawn_cache_tier(*sys, co, worker, make_actor_logger("cache_tier", quiet_sink(), "off"));
    scheduler_options so;
    so.lim = lim;
    so.model = facts;
    so.layout = layout;
    so.pool_id = wo.pool_id;
    so.node = "p0";
    prefill = spawn_prefill_scheduler(*sys, so, clk, make_actor_logger("prefill", quiet_sink(), "off"));
    so.node = "d0";
    decode = spawn_decode_scheduler(*sys, so, clk, make_actor_logger("decode", quiet_sink(), "off"));
    router_options ro;
    ro.lim = lim;
    ro.model = facts;
    ro.local_prefill = rule;
    router = spawn_router(*sys, ro, {route_target{"p0/prefill", prefill}}, {route_target{"d0/decode", decode}}, clk,
                          make_actor_logger("router", quiet_sink(), "off"));
    peer_set peers{router, prefill, decode, worker, cache};
    caf::anon_send(prefill.handle, peers_atom::value, peers);
    caf::anon_send(decode.handle, peers_atom::value, peers);
    // The decode scheduler's first credit (its batch size) reached the router's mailbox before
    // it answers a stats query; the router's stats answer then comes after that credit.
    REQUIRE(stats(decode).value("decode_credits_sent_total") >= 1);
    stats(router);
  }
  ~two_nodes() { shutdown({router.handle, prefill.handle, decode.handle, cache.handle, worker.handle}); }
  void submit(const std::string& id, const std::vector<int32_t>& prompt, int32_t max_tokens) {
    seq_request r;
    r.id = id;
    r.prompt = prompt;
    r.max_tokens = max_tokens;
    r.sampling.temperature = 0.0f;  // greedy: both paths must give the model's own answer
    router.gate->enter_control();
    caf::anon_send(router.handle, submit_atom::value,
                   make_role_wire<router_role, msg::submit>([&](schema::SubmitRequest::Builder b) { r.write(b); }), callback_box{col.cb()});
  }
  stats_snapshot stats(const bounded_actor& a) { return stats_of(a.handle); }
};

std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back((i * 7 + salt * 13 + 3) % 64);
  return p;
}

limits local_limits() {
  limits l = small_limits();  // page_size 4, 64 pages, prefill chunks of 16 tokens
  l.device_pages = 256;
  l.max_running_seqs = 8;
  l.prefix_cache = false;  // every page is free again at the end
  return l;
}

/// Runs `n` requests (prompts of 10..45 tokens: 1 to 3 chunks) at once; their outputs.
std::vector<std::vector<int32_t>> run(two_nodes& c, int n, int32_t max_tokens) {
  for (int i = 0; i < n; ++i) c.submit("r" + std::to_string(i), prompt_of(10 + 5 * i, i), max_tokens);
  REQUIRE(c.col.wait_finished(n));
  CHECK(c.col.duplicate_finishes == 0);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    const std::string id = "r" + std::to_string(i);
    auto last = c.col.last(id);
    if (last.err) FAIL_CHECK(id << ": " << last.err->what());
    CHECK(last.reason == finish_reason::length);
    out.push_back(c.col.tokens(id));
  }
  return out;
}

}  // namespace

TEST_CASE("local prefill: the decode node prefills short prompts in its batch, outputs equal the disaggregated path") {
  const int n = 8;
  const int32_t max_tokens = 6;
  std::vector<std::vector<int32_t>> expected;
  for (int i = 0; i < n; ++i) expected.push_back(expected_greedy(prompt_of(10 + 5 * i, i), max_tokens));

  local_prefill_rule off;
  off.max_uncached_tokens = 0;
  std::vector<std::vector<int32_t>> disaggregated;
  {
    two_nodes c(local_limits(), off);
    disaggregated = run(c, n, max_tokens);
    CHECK(c.stats(c.router).value("router_local_prefill_total") == 0);
    CHECK(c.stats(c.decode).value("decode_local_prefills_total") == 0);
  }
  CHECK(disaggregated == expected);

  local_prefill_rule always;  // every prompt of up to 64 uncached tokens, whatever the queues
  always.max_uncached_tokens = 64;
  always.min_queue_wait_ms = -1;
  always.min_free_batch_slots = 1;
  two_nodes c(local_limits(), always);
  auto local = run(c, n, max_tokens);
  CHECK(local == expected);
  CHECK(local == disaggregated);
  auto rs = c.stats(c.router);
  auto ds = c.stats(c.decode);
  auto ps = c.stats(c.prefill);
  // Some arrive while the batch is full (the router's view counts its own sends): those go
  // through prefill, the others are prefilled on decode, each exactly once.
  CHECK(rs.value("router_local_prefill_total") >= 1);
  CHECK(ds.value("decode_local_prefills_total") == rs.value("router_local_prefill_total"));
  CHECK(ds.value("decode_local_prefill_tokens_total") > 0);
  CHECK(ps.value("prefill_admitted_total") + rs.value("router_local_prefill_total") == n);
  // Every page came back (the decode node's local prefills freed theirs). The decode
  // scheduler sent its frees before it answers this query, so the cache tier has them first.
  c.stats(c.decode);
  auto cs = c.stats(c.cache);
  CHECK(cs.value("kv_pages_free") == 256);
  CHECK(cs.value("kv_bad_frees_total") == 0);
}

TEST_CASE("local prefill: a prompt with more uncached tokens than the rule allows goes to prefill") {
  local_prefill_rule rule;
  rule.max_uncached_tokens = 12;
  rule.min_queue_wait_ms = -1;
  two_nodes c(local_limits(), rule);
  c.submit("short", prompt_of(12, 1), 3);
  c.submit("long", prompt_of(30, 2), 3);
  REQUIRE(c.col.wait_finished(2));
  CHECK(c.col.tokens("short") == expected_greedy(prompt_of(12, 1), 3));
  CHECK(c.col.tokens("long") == expected_greedy(prompt_of(30, 2), 3));
  CHECK(c.stats(c.router).value("router_local_prefill_total") == 1);
  CHECK(c.stats(c.prefill).value("prefill_admitted_total") == 1);
}
