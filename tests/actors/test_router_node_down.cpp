// The router over several prefill and decode targets when one node goes away (node_down_atom
// with its target, as the proxy of that node sends it): only that target is skipped from then
// on, and only the requests it held end, with `disconnected`. Scripted targets on a manual
// clock, so every decision is deterministic.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>

#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// A router over prefill targets n0/prefill, n1/prefill and decode targets n2/decode, n3/decode.
struct rig : router_rig {
  std::map<std::string, int32_t> sent_tokens;

  rig() {
    for (const char* n : {"n0/prefill", "n1/prefill"}) add_target(n, "prefill", n);
    for (const char* n : {"n2/decode", "n3/decode"}) add_target(n, "decode", n);
    router_options ro;
    ro.lim = small_limits();
    ro.lim.router_migration = false;  // these cases check that requests end (migration: test_router_migration)
    ro.model = model_facts{-1, 4096, 64};
    ro.policy.kind = route_policy_kind::round_robin;
    launch(ro);
    stats();
  }
  /// A token of `id` from the stage in `state` ("decode": it is decoding now).
  void token(const std::string& id, bool last, request_stage state = request_stage::decode) {
    send(make_event(id, {7}, last ? finish_reason::length : finish_reason::none, nullptr, 0, 0, state,
                    sent_tokens[id]++));
  }
  void node_down(const std::string& role, const std::string& target) {
    caf::anon_send(router.handle, node_down_atom::value, role, target, role + " node of " + target + " is down (test)");
  }
};

}  // namespace

TEST_CASE("router node_down: only the dead decode target is skipped and only its requests end disconnected") {
  rig r;
  // Round robin over both roles: a -> (n0, n2), b -> (n1, n3), c -> (n0, n2), d -> (n1, n3).
  for (const char* id : {"a", "b", "c", "d"}) r.submit(id);
  CHECK(r.placed("a") == std::pair<int, std::string>{0, "n2/decode"});
  CHECK(r.placed("b") == std::pair<int, std::string>{1, "n3/decode"});
  CHECK(r.placed("c") == std::pair<int, std::string>{0, "n2/decode"});
  CHECK(r.placed("d") == std::pair<int, std::string>{1, "n3/decode"});
  // a and b decode; c and d still at prefill (their first token is on its way).
  r.token("a", false);
  r.token("b", false);
  REQUIRE(r.col.wait_tokens("b", 1));
  REQUIRE(r.col.wait_tokens("a", 1));
  r.node_down("decode", "n3/decode");
  // b (decoding there) and d (at prefill, bound for it) end; d's prefill is told to drop it.
  REQUIRE(r.col.wait_finished(2));
  for (const char* id : {"b", "d"}) {
    auto ev = r.col.last(id);
    INFO(id);
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::disconnected);
    CHECK(std::string(ev.err->what()).find("n3/decode is down") != std::string::npos);
  }
  CHECK(r.prefill[1]->wait([&] {
    return std::find(r.prefill[1]->aborts.begin(), r.prefill[1]->aborts.end(), "d") != r.prefill[1]->aborts.end();
  }));
  // a and c go on.
  r.token("a", true);
  r.token("c", true);
  REQUIRE(r.col.wait_finished(4));
  CHECK_FALSE(r.col.last("a").err);
  CHECK_FALSE(r.col.last("c").err);
  CHECK(r.col.duplicate_finishes == 0);
  // New requests: both prefill targets, only the live decode target.
  for (const char* id : {"e", "f", "g", "h"}) r.submit(id);
  std::set<int> prefills;
  for (const char* id : {"e", "f", "g", "h"}) {
    auto [p, d] = r.placed(id);
    prefills.insert(p);
    CHECK(d == "n2/decode");
  }
  CHECK(prefills == std::set<int>{0, 1});
  auto st = r.stats();
  CHECK(st.value("router_target_healthy", "target=\"n3/decode\"") == 0);
  CHECK(st.value("router_target_healthy", "target=\"n2/decode\"") == 1);
  CHECK(st.value("router_target_healthy", "target=\"n1/prefill\"") == 1);
  // The last decode target goes too: its requests end, new ones are refused naming the cause.
  r.node_down("decode", "n2/decode");
  REQUIRE(r.col.wait_finished(8));
  r.submit("i");
  REQUIRE(r.col.wait_finished(9));
  auto ev = r.col.last("i");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  CHECK(std::string(ev.err->what()).find("no decode node is reachable") != std::string::npos);
  CHECK(r.col.duplicate_finishes == 0);
}

TEST_CASE("router node_down: a dead prefill target ends what it queued and is routed around") {
  rig r;
  for (const char* id : {"a", "b"}) r.submit(id);
  CHECK(r.placed("a").first == 0);
  CHECK(r.placed("b").first == 1);
  r.node_down("prefill", "n1/prefill");
  REQUIRE(r.col.wait_finished(1));
  REQUIRE(r.col.last("b").err);
  CHECK(r.col.last("b").err->kind() == error_kind::disconnected);
  // A target the router does not know changes nothing.
  r.node_down("prefill", "n9/prefill");
  for (const char* id : {"c", "d", "e"}) r.submit(id);
  for (const char* id : {"c", "d", "e"}) CHECK(r.placed(id).first == 0);
  r.token("a", true);
  REQUIRE(r.col.wait_finished(2));
  CHECK_FALSE(r.col.last("a").err);
  CHECK(r.stats().value("router_target_healthy", "target=\"n1/prefill\"") == 0);
}
