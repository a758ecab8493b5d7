// Stream migration through the real schedulers: two nodes (prefill, decode, worker and cache
// tier each, fake_model), the router over both. Node 0's worker is held mid-decode and the
// node is declared down; its stream continues on node 1, whose prefill computes prompt ++ the
// tokens streamed and whose decode carries on: the client's stream is the fault-free run's,
// greedy and seeded-sampled alike. On the test scheduler (tests/actors/test_system.h): node 0
// is "held" by not running its worker's jobs once it did three forward passes.
#include <doctest/doctest.h>

#include <caf/all.hpp>
#include <map>

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

struct node_set {
  bounded_actor worker, cache, prefill, decode;
};

node_set spawn_node(caf::actor_system& sys, std::shared_ptr<llama_model> model, const limits& lim,
                    const std::string& node, std::shared_ptr<const cluster_clock> clk) {
  auto lg = [&](const char* n) { return make_actor_logger(n, quiet_sink(), "off"); };
  node_set s;
  worker_options wo;
  wo.n_pages = lim.device_pages;
  wo.pools = model->pools_layout(lim.page_size);
  wo.mailbox_bound = lim.worker_mailbox;
  wo.pool_id = node + "/worker0";
  wo.detached = false;  // on the test scheduler's one thread
  s.worker = spawn_worker(sys, model, wo, lg("worker"));
  cache_tier_options co;
  co.n_pages = lim.device_pages;
  co.prefix_cache = lim.prefix_cache;
  co.mailbox_bound = lim.cache_tier_mailbox;
  co.layout = model->layout(lim.page_size);
  s.cache = spawn_cache_tier(sys, co, s.worker, lg("cache_tier"));
  scheduler_options so;
  so.lim = lim;
  so.model = model_facts{-1, 512, 64};
  so.layout = co.layout;
  so.pool_id = wo.pool_id;
  so.node = node;
  s.prefill = spawn_prefill_scheduler(sys, so, clk, lg("prefill"));
  s.decode = spawn_decode_scheduler(sys, so, clk, lg("decode"));
  return s;
}

/// Runs s0 (on node 0) and s1 (on node 1); with `fault`, node 0 is held after two decode steps of
/// s0 and declared down. Returns the clients' token streams.
std::map<std::string, std::vector<int32_t>> run(bool fault, float temperature) {
  limits lim = small_limits();
  lim.prefix_cache = false;
  test_system ts;
  ts.start();
  auto clk = ts.clk;
  auto calls0 = std::make_shared<forward_gate>();  // counts node 0's forward passes (never pauses)
  std::vector<node_set> nodes = {spawn_node(*ts.sys, std::make_shared<fake_model>(calls0), lim, "n0", clk),
                                 spawn_node(*ts.sys, std::make_shared<fake_model>(), lim, "n1", clk)};
  // Node 0's worker is held (its jobs wait, as a worker stuck in a forward pass) after the
  // prefill of s0 and two decode steps.
  auto* worker0 = caf::actor_cast<caf::abstract_actor*>(nodes[0].worker.handle);
  bool release = false;
  ts.runnable = [&](caf::resumable* job) {
    return release || !fault || calls0->calls < 3 || dynamic_cast<caf::abstract_actor*>(job) != worker0;
  };
  router_options ro;
  ro.lim = lim;
  ro.model = model_facts{-1, 512, 64};
  ro.policy.kind = route_policy_kind::round_robin;  // s0 -> n0/prefill + n0/decode, s1 -> n1's
  auto router = spawn_router(*ts.sys, ro, {{"n0/prefill", nodes[0].prefill}, {"n1/prefill", nodes[1].prefill}},
                             {{"n0/decode", nodes[0].decode}, {"n1/decode", nodes[1].decode}}, clk,
                             make_actor_logger("router", quiet_sink(), "off"));
  for (auto& n : nodes) {
    peer_set p{router, n.prefill, n.decode, n.worker, n.cache};
    caf::anon_send(n.prefill.handle, peers_atom::value, p);
    caf::anon_send(n.decode.handle, peers_atom::value, p);
  }
  collector col;
  col.pump = [&](const std::function<bool()>& ok, const std::string& what) { return ts.run_until(ok, what); };
  auto submit = [&](const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens) {
    seq_request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.sampling.temperature = temperature;
    r.sampling.seed = 42;
    router.gate->enter_control();
    caf::anon_send(router.handle, submit_atom::value,
                   make_role_wire<router_role, msg::submit>([&](schema::SubmitRequest::Builder b) { r.write(b); }), callback_box{col.cb()});
  };
  const std::vector<int32_t> p0 = {3, 9, 4, 1, 7}, p1 = {2, 8, 8};
  submit("s0", p0, 12);
  if (fault) REQUIRE(ts.run_until([&] { return calls0->calls >= 3; }, "node 0's third forward pass"));
  REQUIRE(col.wait_tokens("s0", 3));  // the first token (prefill) and two decode steps
  submit("s1", p1, 12);
  if (fault)
    caf::anon_send(router.handle, node_down_atom::value, std::string("n0"), std::string("node n0 is down (test)"));
  REQUIRE(col.wait_finished(2));
  if (fault) CHECK(calls0->calls == 3);  // node 0 was held throughout
  release = true;  // node 0's late events carry the old attempt's id: dropped
  ts.run();
  for (const char* id : {"s0", "s1"}) {
    CAPTURE(id);
    CHECK_FALSE(col.last(id).err);
    CHECK(col.last(id).completion_tokens == 12);
  }
  CHECK(col.last("s0").prompt_tokens == 5);
  CHECK(col.duplicate_finishes == 0);
  CHECK(ts.stats_of(router.handle).value("router_migrations_total") == (fault ? 1 : 0));  // the fault run moved s0
  std::vector<caf::actor> all = {router.handle};
  for (auto& n : nodes)
    for (auto* a : {&n.prefill, &n.decode, &n.cache, &n.worker}) all.push_back(a->handle);
  ts.shutdown(all);
  return {{"s0", col.tokens("s0")}, {"s1", col.tokens("s1")}};
}

}  // namespace


TEST_CASE("router migration through the schedulers: a node held mid-decode and declared down, its stream finishes on the other node as in the fault-free run") {
  // Greedy: the uninterrupted output. Seeded sampling (each token's seed comes from the request
  // seed and its completion index): the same draws after the move, so the same stream.
  for (float temperature : {0.0f, 1.0f}) {
    CAPTURE(temperature);
    const auto clean = run(false, temperature);
    const auto moved = run(true, temperature);
    REQUIRE(clean.at("s0").size() == 12);
    CHECK(moved.at("s0") == clean.at("s0"));
    CHECK(moved.at("s1") == clean.at("s1"));
    if (temperature == 0.0f) {
      CHECK(clean.at("s0") == expected_greedy({3, 9, 4, 1, 7}, 12));
      CHECK(clean.at("s1") == expected_greedy({2, 8, 8}, 12));
    }
  }
}
