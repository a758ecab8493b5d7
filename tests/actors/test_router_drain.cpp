// The router and the edges of a node's life (issue 25): a draining target gets no new
// request and is told how many the router still holds there; a decode target that came back
// is paired only with prefill targets that reach it again; a handoff refused because its
// decode node is unreachable counts against that node and the stream continues on another.
// Scripted targets on a manual clock.
#include <doctest/doctest.h>

#include <caf/all.hpp>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "actors/runtime/node_drain.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// A scripted target: the submissions (id -> decode target named) and the credit queries' holds.
struct target_box {
  std::mutex m;
  std::condition_variable cv;
  std::map<std::string, std::string> submits;
  std::vector<int32_t> holds;
  void push(const wire& w) {
    wire_reader rd(w);
    auto env = rd.root();
    std::lock_guard lk(m);
    if (env.isSubmit()) submits[env.getSubmit().getId().cStr()] = env.getSubmit().getDecodeTarget().cStr();
    if (env.isCreditQuery()) holds.push_back(env.getCreditQuery().getHolds());
    cv.notify_all();
  }
  bool wait(const std::function<bool()>& ok) {
    std::unique_lock lk(m);
    return cv.wait_for(lk, std::chrono::seconds(20), ok);
  }
};

caf::behavior scripted(caf::event_based_actor*, std::shared_ptr<mailbox_gate> gate, std::shared_ptr<target_box> box) {
  return {[gate, box](wire_atom, const wire& w) {
    gate->leave();
    box->push(w);
  }};
}

/// A router over prefill targets n0/prefill, n1/prefill and decode targets n2/decode, n3/decode.
struct rig {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::shared_ptr<manual_clock> clk = std::make_shared<manual_clock>();
  std::vector<std::shared_ptr<target_box>> prefill, decode;
  std::map<std::string, uint64_t> seq;
  bounded_actor router;
  collector col;

  explicit rig(bool migration) {
    cfg.add_message_type<wire>("tandem_wire");
    sys = std::make_unique<caf::actor_system>(cfg);
    auto make = [&](const std::string& name, std::vector<std::shared_ptr<target_box>>& boxes) {
      auto box = std::make_shared<target_box>();
      auto gate = std::make_shared<mailbox_gate>(name, 1024);
      boxes.push_back(box);
      return route_target{name, bounded_actor{sys->spawn(scripted, gate, box), gate}};
    };
    std::vector<route_target> p{make("n0/prefill", prefill), make("n1/prefill", prefill)};
    std::vector<route_target> d{make("n2/decode", decode), make("n3/decode", decode)};
    router_options ro;
    ro.lim = small_limits();
    ro.lim.router_migration = migration;
    ro.lim.router_heartbeat_ms = 20;  // real time: the drain queries come every heartbeat
    ro.model = model_facts{-1, 4096, 64};
    ro.policy.kind = route_policy_kind::round_robin;
    router = spawn_router(*sys, ro, std::move(p), std::move(d), clk, make_actor_logger("router", quiet_sink(), "off"));
  }
  ~rig() {
    caf::anon_send_exit(router.handle, caf::exit_reason::user_shutdown);
    sys->await_all_actors_done();
  }
  void submit(const std::string& id) {
    seq_request r;
    r.id = id;
    r.prompt = {1, 2, 3, 4};
    r.max_tokens = 8;
    router.gate->enter_control();
    caf::anon_send(router.handle, submit_atom::value,
                   make_wire([&](schema::Envelope::Builder env) { r.write(env.initSubmit()); }),
                   callback_box{col.cb()});
  }
  void send(const wire& w) {
    router.gate->enter_control();
    caf::anon_send(router.handle, wire_atom::value, w);
  }
  /// A credit of `target` (role from its name), draining or not, listing `unreachable`.
  void credit(const std::string& target, bool draining, std::vector<std::string> unreachable = {}) {
    send(make_wire([&](schema::Envelope::Builder env) {
      auto c = env.initCredit();
      c.setTarget(target);
      c.setRole(target.substr(target.find('/') + 1));
      c.setSeq(++seq[target]);
      c.setFreePages(-1);
      c.setDraining(draining);
      auto u = c.initUnreachable(static_cast<unsigned>(unreachable.size()));
      for (unsigned i = 0; i < unreachable.size(); ++i) u.set(i, unreachable[i]);
    }));
  }
  /// Where `id` went: (prefill index, the decode target it names); waits for the submission.
  std::pair<int, std::string> placed(const std::string& id) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      for (size_t i = 0; i < prefill.size(); ++i) {
        std::lock_guard lk(prefill[i]->m);
        auto it = prefill[i]->submits.find(id);
        if (it != prefill[i]->submits.end()) return {int(i), it->second};
      }
      std::this_thread::yield();
    }
    return {-1, ""};
  }
  stats_snapshot stats() {
    caf::scoped_actor self{*sys};
    stats_snapshot out;
    self->request(router.handle, std::chrono::seconds(10), stats_atom::value)
        .receive([&](const wire& w) { out = read_stats(w); }, [](caf::error&) {});
    return out;
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
  REQUIRE(box.wait([&] { return !box.holds.empty() && box.holds.back() == 1; }));
  r.send(make_event("b", {7}, finish_reason::length, nullptr, 4, 0, "decode", 0));
  REQUIRE(r.col.wait_finished(1));
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
  r.clk->advance_ms(10);
  r.credit("n3/decode", false);  // back: its node restarted
  r.stats();
  // Neither prefill target reported since: n3 is not routable yet.
  CHECK(r.stats().value("router_live_targets", "role=\"decode\"") == 1);
  for (const char* id : {"a", "b", "c", "d"}) r.submit(id);
  for (const char* id : {"a", "b", "c", "d"}) CHECK(r.placed(id).second == "n2/decode");
  // n0's node is still redialing n3; n1's reaches it.
  r.clk->advance_ms(10);
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
  r.send(make_event("a", {7}, finish_reason::none, nullptr, 4, 0, "prefill", 0));
  REQUIRE(r.col.wait_tokens("a", 1));
  tandem::error e(error_kind::disconnected, "decode node n2 the router chose is not reachable; retry the request");
  r.send(make_event("a", {}, finish_reason::error, &e, 4, 0, "decode", 1));
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
  // A prefill node with a KV send it promised still in flight.
  std::vector<stats_snapshot> sending = {snap("prefill", {{"prefill_kv_sends_inflight", "", 1, "gauge", ""},
                                                          {"drain_router_clear", "actor=\"prefill\"", 1, "gauge", ""}})};
  CHECK(node_drain_phase(true, false, true, false, sending) == drain_phase::draining);
  sending[0].metrics[0].value = 0;
  CHECK(node_drain_phase(true, false, true, false, sending) == drain_phase::drained);
  // A router node: drained once its table is empty.
  std::vector<stats_snapshot> router = {snap("router", {{"requests_inflight", "", 3, "gauge", ""}})};
  CHECK(node_drain_phase(true, true, false, false, router) == drain_phase::draining);
  router[0].metrics[0].value = 0;
  CHECK(node_drain_phase(true, true, false, false, router) == drain_phase::drained);
  CHECK(drain_status(drain_phase::drained, "d1").rfind("drained: node d1", 0) == 0);
}
