// The router and the edges of a node's life (issue 25): a draining target gets no new
// request and is told how many the router still holds there; a decode target that came back
// is paired only with prefill targets that reach it again; a handoff refused because its
// decode node is unreachable counts against that node and the stream continues on another.
// Scripted targets on the test scheduler's clock (tests/actors/router_rig.h).
#include <doctest/doctest.h>

#include <map>

#include "actors/common/protocol.h"
#include "actors/runtime/node_drain.h"
#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// A router over prefill targets n0/prefill, n1/prefill and decode targets n2/decode, n3/decode.
struct rig : router_rig {
  std::map<std::string, uint64_t> seq;

  explicit rig(bool migration) {
    for (const char* n : {"n0/prefill", "n1/prefill"}) add_target(n, "prefill", n);
    for (const char* n : {"n2/decode", "n3/decode"}) add_target(n, "decode", n);
    router_options ro;
    ro.lim = small_limits();
    ro.lim.router_migration = migration;
    ro.lim.router_heartbeat_ms = 20;  // the drain queries come every heartbeat (advance_ms moves it)
    ro.model = model_facts{-1, 4096, 64};
    ro.policy.kind = route_policy_kind::round_robin;
    launch(ro);
  }
  /// A credit of `target` (role from its name), draining or not, listing `unreachable`.
  void credit(const std::string& target, bool draining, std::vector<std::string> unreachable = {}) {
    send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
      c.setTarget(target);
      c.setRole(target.substr(target.find('/') + 1) == "decode" ? schema::StageRole::DECODE
                                                                  : schema::StageRole::PREFILL);
      c.setSeq(++seq[target]);
      c.setFreePages(-1);
      c.setDraining(draining);
      auto u = c.initUnreachable(static_cast<unsigned>(unreachable.size()));
      for (unsigned i = 0; i < unreachable.size(); ++i) u.set(i, unreachable[i]);
    }));
  }
};

}  // namespace

TEST_CASE("router drain: a draining decode target gets no new request and is told what the router still holds there") {
  rig r(false);
  r.submit("a");
  r.submit("b");
  CHECK(r.placed("a").second == "n2/decode");
  CHECK(r.placed("b").second == "n3/decode");
  r.credit("n3/decode", true);
  for (const char* id : {"c", "d", "e"}) r.submit(id);
  for (const char* id : {"c", "d", "e"}) CHECK(r.placed(id).second == "n2/decode");
  auto m = r.stats();
  CHECK(m.value("router_target_draining", "target=\"n3/decode\"") == 1);
  CHECK(m.value("router_target_draining", "target=\"n2/decode\"") == 0);
  CHECK(m.value("router_live_targets", "role=\"decode\"") == 1);
  // b is still there: the heartbeat's queries say 1 until it ends, then 0.
  auto& box = *r.decode[1];
  r.advance_ms(20);  // a heartbeat
  REQUIRE(box.wait([&] { return !box.holds.empty() && box.holds.back() == 1; }));
  r.send(make_event("b", {7}, finish_reason::length, nullptr, 4, 0, request_stage::decode, 0));
  REQUIRE(r.col.wait_finished(1));
  r.advance_ms(20);
  REQUIRE(box.wait([&] { return !box.holds.empty() && box.holds.back() == 0; }));
  // The other decode target, not draining, is not told anything about holds.
  {
    std::lock_guard lk(r.decode[0]->m);
    for (int32_t h : r.decode[0]->holds) CHECK(h == -1);
  }
  // Undrained (or restarted: its first credit says it is not draining): routed to again.
  r.credit("n3/decode", false);
  bool to_n3 = false;
  for (const char* id : {"f", "g", "h"}) {
    r.submit(id);
    to_n3 = to_n3 || r.placed(id).second == "n3/decode";
  }
  CHECK(to_n3);
}

TEST_CASE("router drain: every prefill target draining refuses new requests, naming the drain") {
  rig r(false);
  r.credit("n0/prefill", true);
  r.credit("n1/prefill", true);
  r.stats();  // the credits are in
  r.submit("x");
  REQUIRE(r.col.wait_finished(1));
  std::lock_guard lk(r.col.m);
  const auto& ev = r.col.events["x"].back();
  REQUIRE(ev.err);
  CHECK(std::string(ev.err->what()).find("n0/prefill is draining") != std::string::npos);
  CHECK(r.stats().value("router_live_targets", "role=\"prefill\"") == 0);
}

TEST_CASE("router: a decode target that came back is paired only with prefill targets that reach it again") {
  rig r(false);
  caf::anon_send(r.router.handle, node_down_atom::value, std::string("decode"), std::string("n3/decode"),
                 std::string("decode node n3 is down (test)"));
  r.advance_ms(10);
  r.credit("n3/decode", false);  // back: its node restarted
  r.stats();
  // Neither prefill target reported since: n3 is not routable yet.
  CHECK(r.stats().value("router_live_targets", "role=\"decode\"") == 1);
  for (const char* id : {"a", "b", "c", "d"}) r.submit(id);
  for (const char* id : {"a", "b", "c", "d"}) CHECK(r.placed(id).second == "n2/decode");
  // n0's node is still redialing n3; n1's reaches it.
  r.advance_ms(10);
  r.credit("n0/prefill", false, {"n3/decode"});
  r.credit("n1/prefill", false);
  CHECK(r.stats().value("router_live_targets", "role=\"decode\"") == 2);
  int n3_from_n1 = 0;
  for (const char* id : {"e", "f", "g", "h", "i", "j", "k", "l"}) {
    r.submit(id);
    auto [p, d] = r.placed(id);
    INFO(id << " -> n" << p << ", " << d);
    if (p == 0) CHECK(d == "n2/decode");
    if (p == 1 && d == "n3/decode") ++n3_from_n1;
  }
  CHECK(n3_from_n1 >= 1);
}

TEST_CASE("router: a handoff refused because its decode node is unreachable counts against that node, the stream continues") {
  rig r(true);
  r.submit("a");
  auto [p, d] = r.placed("a");
  REQUIRE(d == "n2/decode");
  // The first token from prefill, then the prefill node's proxy refuses the handoff to n2.
  r.send(make_event("a", {7}, finish_reason::none, nullptr, 4, 0, request_stage::prefill, 0));
  REQUIRE(r.col.wait_tokens("a", 1));
  tandem::error e(error_kind::disconnected, "decode node n2 the router chose is not reachable; retry the request");
  r.send(make_event("a", {}, finish_reason::error, &e, 4, 0, request_stage::decode, 1));
  auto [p2, d2] = r.placed("a#m1");
  CHECK(p2 >= 0);
  CHECK(d2 == "n3/decode");
  auto m = r.stats();
  CHECK(m.value("router_migrations_total") == 1);
  // Not the prefill target's fault: its breaker saw no failure (it may take the continuation).
  CHECK(m.value("router_breaker_state", "target=\"n" + std::to_string(p) + "/prefill\"") == 0);
  std::lock_guard lk(r.col.m);
  CHECK(r.col.finished == 0);
}

TEST_CASE("node drain phase: draining until every role holds nothing and the router confirmed it routes nothing here") {
  auto snap = [](const std::string& actor, std::vector<metric_sample> m) {
    stats_snapshot s;
    s.actor = actor;
    s.metrics = std::move(m);
    return s;
  };
  std::vector<stats_snapshot> idle_decode = {snap("decode", {{"decode_running_requests", "", 0, "gauge", ""},
                                                             {"drain_router_clear", "actor=\"decode\"", 1, "gauge", ""}})};
  CHECK(node_drain_phase(false, false, false, true, idle_decode) == drain_phase::serving);
  CHECK(node_drain_phase(true, false, false, true, idle_decode) == drain_phase::drained);
  CHECK(to_string(drain_phase::drained) == "drained");
  // Still decoding, or the router has not confirmed: draining.
  auto busy = idle_decode;
  busy[0].metrics[0].value = 2;
  CHECK(node_drain_phase(true, false, false, true, busy) == drain_phase::draining);
  auto unconfirmed = idle_decode;
  unconfirmed[0].metrics[1].value = 0;
  CHECK(node_drain_phase(true, false, false, true, unconfirmed) == drain_phase::draining);
  // A role the node runs without a snapshot: nobody knows it is empty.
  CHECK(node_drain_phase(true, false, true, true, idle_decode) == drain_phase::draining);
  // A prefill node whose worker still writes a KV send to a decode node (or did not answer).
  std::vector<stats_snapshot> sending = {snap("prefill", {{"prefill_queued_requests", "", 0, "gauge", ""},
                                                          {"drain_router_clear", "actor=\"prefill\"", 1, "gauge", ""}}),
                                         snap("worker", {{"worker_kv_sends_inflight", "", 1, "gauge", ""}})};
  CHECK(node_drain_phase(true, false, true, false, sending) == drain_phase::draining);
  sending[1].metrics[0].value = 0;
  CHECK(node_drain_phase(true, false, true, false, sending) == drain_phase::drained);
  sending.pop_back();
  CHECK(node_drain_phase(true, false, true, false, sending) == drain_phase::draining);
  // A router node: drained once its table is empty.
  std::vector<stats_snapshot> router = {snap("router", {{"requests_inflight", "", 3, "gauge", ""}})};
  CHECK(node_drain_phase(true, true, false, false, router) == drain_phase::draining);
  router[0].metrics[0].value = 0;
  CHECK(node_drain_phase(true, true, false, false, router) == drain_phase::drained);
  CHECK(drain_status(drain_phase::drained, "d1").rfind("drained: node d1", 0) == 0);
}
