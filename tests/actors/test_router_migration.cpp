// Stream migration in the router: a request that loses its decode target mid-stream continues
// on another from the tokens it streamed (migration on), or ends with an explicit error within
// 2 heartbeats even when the target dies silently (off). The test plays the prefill and decode
// stages by hand (scripted targets that record what they get and answer credit queries while
// "alive"), on the test scheduler and its clock (tests/actors/router_rig.h), so every decision
// is deterministic. The stages compute tokens with fake_model's rule from what they were given
// (prompt ++ generated), so a continuation built from wrong tokens produces a wrong stream.
#include <doctest/doctest.h>

#include <map>
#include <mutex>

#include "tests/actors/router_rig.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// One attempt of a request as the stages run it: the sequence so far and the next index.
struct attempt {
  seq_request q;
  std::vector<int32_t> seq;  ///< prompt ++ generated ++ what this attempt produced
  int32_t next = 0;          ///< completion index of the next token
};

struct rig : router_rig {
  std::vector<std::shared_ptr<target_box>>& prefills = prefill;  ///< the names the cases use
  std::vector<std::shared_ptr<target_box>>& decodes = decode;
  std::mutex tm;
  std::map<std::string, int64_t> finished_at_ms;  ///< manual-clock time of each final event

  rig(limits lim, int n_prefill, int n_decode) {
    for (int i = 0; i < n_prefill; ++i) add_target("p" + std::to_string(i) + "/prefill", "prefill", "prefill");
    for (int i = 0; i < n_decode; ++i) add_target("d" + std::to_string(i) + "/decode", "decode", "decode");
    router_options ro;
    ro.lim = lim;
    ro.model = model_facts{-1, 4096, 64};
    ro.tick_ms = 1;
    ro.policy.kind = route_policy_kind::round_robin;
    launch(ro, /*answering=*/true);
    col.on_event = [this](const token_event& ev) {
      if (!ev.finished) return;
      std::lock_guard lk(tm);
      finished_at_ms[ev.request_id] = clk->now_ms();
    };
    stats();  // the router has started (and read the clock) before a test moves it
  }
  ~rig() { stop(); }  // col.on_event writes finished_at_ms until the actors are gone

  void submit(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens) {
    router_rig::submit(id, std::move(prompt), max_tokens, /*ignore_eos=*/true);
  }
  /// The next token of `a` (fake_model's rule over everything before it); `state` as the stage
  /// that computed it reports it (the prefill's first token moves the request to "decode").
  void step(attempt& a) {
    int64_t sum = 0;
    for (auto t : a.seq) sum += t;
    const int32_t tok = static_cast<int32_t>((int64_t(a.seq.back()) + 1 + sum) % 64);
    a.seq.push_back(tok);
    const bool last = a.next + 1 >= a.q.max_tokens;
    send(make_event(a.q.id, {tok}, last ? finish_reason::length : finish_reason::none, nullptr,
                    static_cast<int32_t>(a.q.prompt.size()), 0, request_stage::decode, a.next));
    a.next += 1;
  }
  static attempt start(const seq_request& q) {
    attempt a;
    a.q = q;
    a.seq = q.all_tokens();
    a.next = static_cast<int32_t>(q.generated.size());
    return a;
  }
  /// As a node's proxy sends it (outside the mailbox gate).
  void node_down(const std::string& what, const std::string& why) {
    caf::anon_send(router.handle, node_down_atom::value, what, why);
  }
  void credit(const std::string& name, const std::string& role, uint64_t seq) {
    send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
      c.setTarget(name);
      c.setRole(role == "decode" ? schema::StageRole::DECODE : schema::StageRole::PREFILL);
      c.setSeq(seq);
      c.setFreePages(-1);
    }));
  }
  /// Moves the clock once the router has processed everything sent to it so far (credits
  /// answering its queries must carry the time they were sent at); its tick fires at the new time.
  void advance(int64_t ms) { advance_ms(ms); }
  int finished() {
    std::lock_guard lk(col.m);
    return col.finished;
  }
  int64_t finished_at(const std::string& id) {
    std::lock_guard lk(tm);
    auto it = finished_at_ms.find(id);
    return it == finished_at_ms.end() ? -1 : it->second;
  }
};

std::vector<int32_t> prompt_of(int i) { return {1 + i, 7, 3 + 2 * i, 11}; }

/// Submits `n` streams of `max_tokens`, plays each one's first token (prefill) and
/// `decoded` decode tokens. Returns the attempts by request id (decode targets alternate).
std::map<std::string, attempt> start_streams(rig& r, int n, int32_t max_tokens, int decoded) {
  for (int i = 0; i < n; ++i) r.submit("s" + std::to_string(i), prompt_of(i), max_tokens);
  REQUIRE(r.prefills[0]->wait_submits(size_t(n)));
  std::map<std::string, attempt> live;
  for (int i = 0; i < n; ++i) {
    auto q = r.prefills[0]->submit(size_t(i));
    live[q.id] = rig::start(q);
  }
  for (int k = 0; k <= decoded; ++k)
    for (auto& [id, a] : live) r.step(a);
  for (int i = 0; i < n; ++i) REQUIRE(r.col.wait_tokens("s" + std::to_string(i), size_t(decoded + 1)));
  return live;
}

/// Every stream got exactly the uninterrupted run's tokens, one final event, correct usage.
void check_complete(rig& r, int n, int32_t max_tokens) {
  for (int i = 0; i < n; ++i) {
    const std::string id = "s" + std::to_string(i);
    CAPTURE(id);
    CHECK(r.col.tokens(id) == expected_greedy(prompt_of(i), max_tokens));
    auto last = r.col.last(id);
    CHECK(last.finished);
    CHECK_FALSE(last.err);
    CHECK(last.reason == finish_reason::length);
    CHECK(last.prompt_tokens == int32_t(prompt_of(i).size()));
    CHECK(last.completion_tokens == max_tokens);
  }
  CHECK(r.col.duplicate_finishes == 0);
}

}  // namespace

TEST_CASE("router migration: a decode node down mid-stream, its streams continue on the other with no token lost or duplicated") {
  limits l = small_limits();
  rig r(l, 1, 2);
  const int n = 6;
  const int32_t max_tokens = 12;
  auto live = start_streams(r, n, max_tokens, 4);
  // Round robin over the decode targets: s0, s2, s4 on d0.
  std::vector<std::string> on_d0;
  for (auto& [id, a] : live)
    if (a.q.decode_target == "d0/decode") on_d0.push_back(id);
  REQUIRE(on_d0.size() == 3);
  // One more token of s0 is in flight from d0 when it dies: an event that overtakes the node-down
  // notice is delivered, and the continuation starts after it.
  r.step(live["s0"]);
  REQUIRE(r.col.wait_tokens("s0", 6));
  r.node_down("d0", "decode node d0 is down (killed)");
  REQUIRE(r.prefills[0]->wait_submits(size_t(n + 3)));
  for (size_t k = 0; k < 3; ++k) {
    auto c = r.prefills[0]->submit(size_t(n) + k);
    CAPTURE(c.id);
    const std::string base = c.id.substr(0, c.id.find('#'));
    CHECK(c.id == base + "#m1");
    CHECK(c.decode_target == "d1/decode");
    const int i = std::stoi(base.substr(1));
    CHECK(c.prompt == prompt_of(i));
    CHECK(c.max_tokens == max_tokens);
    const size_t emitted = base == "s0" ? 6 : 5;
    CHECK(c.generated == expected_greedy(prompt_of(i), int(emitted)));
    // A late event of the old attempt (the dead node's last words) must not reach the client.
    r.send(make_event(base, {63}, finish_reason::error, nullptr, 4, 0, request_stage::decode, int32_t(emitted)));
    live[base] = rig::start(c);
  }
  CHECK(r.stats().value("router_migrations_total") == 3);
  CHECK(r.stats().value("router_target_healthy", "target=\"d0/decode\"") == 0);
  // Everything to the end; the continuations' events arrive as the stages number them.
  for (int k = 0; k < max_tokens; ++k)
    for (auto& [id, a] : live)
      if (a.next < max_tokens) r.step(a);
  REQUIRE(r.col.wait_finished(n));
  check_complete(r, n, max_tokens);
  auto st = r.stats();
  CHECK(st.value("router_migration_failures_total", "reason=\"no_target\"") == 0);
  CHECK(st.value("router_target_lost_total", "target=\"d0/decode\"") == 1);
  CHECK(st.value("requests_inflight") == 0);
  // The old attempts were aborted at the prefill (which follows them into decode).
  std::lock_guard lk(r.prefills[0]->m);
  for (const auto& id : on_d0)
    CHECK(std::count(r.prefills[0]->aborts.begin(), r.prefills[0]->aborts.end(), id) == 1);
}

TEST_CASE("router migration: a silently dead decode target is lost after 1.5 heartbeats and its streams move") {
  limits l = small_limits();
  l.router_heartbeat_ms = 100000;  // the router's 1 ms tick checks liveness at each advance
  rig r(l, 1, 2);
  const int n = 4;
  const int32_t max_tokens = 9;
  auto live = start_streams(r, n, max_tokens, 3);
  r.decodes[0]->set_answer(false);  // d0 dies silently: no node-down, no more credits
  // Half a heartbeat: both decode targets are asked; d1 answers.
  r.advance(50000);
  REQUIRE(r.decodes[0]->wait_queries(1));
  REQUIRE(r.decodes[1]->wait_queries(1));
  r.advance(50000);
  REQUIRE(r.decodes[0]->wait_queries(2));
  CHECK(r.stats().value("router_migrations_total") == 0);  // 1 heartbeat of silence: not yet
  r.advance(50000);                                 // 1.5: lost
  REQUIRE(r.prefills[0]->wait_submits(size_t(n + 2)));
  CHECK(r.stats().value("router_target_lost_total", "target=\"d1/decode\"") == 0);
  for (size_t k = 0; k < 2; ++k) {
    auto c = r.prefills[0]->submit(size_t(n) + k);
    CHECK(c.decode_target == "d1/decode");
    live[c.id.substr(0, c.id.find('#'))] = rig::start(c);
  }
  for (int k = 0; k < max_tokens; ++k)
    for (auto& [id, a] : live)
      if (a.next < max_tokens) r.step(a);
  REQUIRE(r.col.wait_finished(n));
  check_complete(r, n, max_tokens);
  CHECK(r.stats().value("router_migrations_total") == 2);
}

TEST_CASE("router migration off: a silently dead decode target ends its streams with an explicit error within 2 heartbeats") {
  limits l = small_limits();
  l.router_migration = false;
  l.router_heartbeat_ms = 100000;
  rig r(l, 1, 2);
  auto live = start_streams(r, 4, 20, 2);
  const int64_t died = r.clk->now_ms();  // the last sign of life of d0 (its last token event)
  r.decodes[0]->set_answer(false);
  r.advance(50000);
  REQUIRE(r.decodes[0]->wait_queries(1));
  r.advance(50000);
  REQUIRE(r.decodes[0]->wait_queries(2));
  r.stats();  // every handler of the tick that sent the query has run
  CHECK(r.finished() == 0);
  r.advance(50000);
  REQUIRE(r.col.wait_finished(2));
  for (const char* id : {"s0", "s2"}) {
    CAPTURE(id);
    auto ev = r.col.last(id);
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::disconnected);
    const std::string msg = ev.err->what();
    CHECK(msg.find("d0/decode") != std::string::npos);
    CHECK(msg.find("stopped answering") != std::string::npos);
    CHECK(msg.find("migration") != std::string::npos);
    CHECK(msg.find("after 3 tokens") != std::string::npos);
    CHECK(ev.completion_tokens == 3);
    CHECK(r.col.tokens(id) == std::vector<int32_t>(expected_greedy(prompt_of(id[1] - '0'), 3)));
    const int64_t at = r.finished_at(id);
    CHECK(at - died <= 2 * l.router_heartbeat_ms);
    CHECK(at - died >= l.router_heartbeat_ms);
  }
  // The streams on the live target were not touched, and nothing was re-submitted.
  CHECK(r.finished() == 2);
  CHECK(r.prefills[0]->wait_submits(4));
  {
    std::lock_guard lk(r.prefills[0]->m);
    CHECK(r.prefills[0]->submits.size() == 4);
  }
  auto st = r.stats();
  CHECK(st.value("router_migrations_total") == 0);
  CHECK(st.value("rejections_total", "actor=\"router\",reason=\"target_lost\"") == 2);
  // d0 speaks again (its node came back): it is back for new requests.
  CHECK(r.stats().value("router_target_healthy", "target=\"d0/decode\"") == 0);
  r.credit("d0/decode", "decode", 100);
  CHECK(r.stats().value("router_target_healthy", "target=\"d0/decode\"") == 1);
}

TEST_CASE("router migration: a quiet target that answers its queries keeps its streams") {
  limits l = small_limits();
  l.router_heartbeat_ms = 100000;
  l.request_timeout_ms = 100000000;
  rig r(l, 1, 2);
  auto live = start_streams(r, 2, 6, 1);
  // Ten heartbeats without a token (a long step, a stall elsewhere): the queries are answered.
  for (int k = 1; k <= 20; ++k) {
    CAPTURE(k);
    r.advance(50000);
    REQUIRE(r.decodes[0]->wait_queries(k));
    REQUIRE(r.decodes[1]->wait_queries(k));
  }
  r.stats();
  CHECK(r.finished() == 0);
  CHECK(r.stats().value("router_target_lost_total", "target=\"d0/decode\"") == 0);
  for (int k = 0; k < 6; ++k)
    for (auto& [id, a] : live)
      if (a.next < 6) r.step(a);
  REQUIRE(r.col.wait_finished(2));
  check_complete(r, 2, 6);
  CHECK(r.stats().value("router_migrations_total") == 0);
}

TEST_CASE("router migration off: a decode node down ends its streams at once with an error naming the node") {
  limits l = small_limits();
  l.router_migration = false;
  rig r(l, 1, 2);
  auto live = start_streams(r, 2, 8, 2);
  r.node_down("d1/decode", "decode node d1 is unreachable (connection closed)");
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("s1");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  CHECK(std::string(ev.err->what()).find("decode node d1") != std::string::npos);
  CHECK(std::string(ev.err->what()).find("--router-migration on") != std::string::npos);
  // s0 (on d0) carries on.
  for (int k = 0; k < 8; ++k)
    if (live["s0"].next < 8) r.step(live["s0"]);
  REQUIRE(r.col.wait_finished(2));
  CHECK(r.col.tokens("s0") == expected_greedy(prompt_of(0), 8));
  CHECK_FALSE(r.col.last("s0").err);
}

TEST_CASE("router migration: the budget bounds the moves, and a stream with nowhere to go ends naming the cause") {
  limits l = small_limits();
  l.router_max_migrations = 1;
  rig r(l, 1, 3);
  auto live = start_streams(r, 1, 10, 2);  // s0 on d0
  REQUIRE(live["s0"].q.decode_target == "d0/decode");
  // A decode-side failure that is not the client's fault: the stream moves (the error's own
  // token is delivered first).
  tandem::error boom(error_kind::failed, "worker forward failed: injected");
  r.send(make_event("s0", {expected_greedy(prompt_of(0), 4)[3]}, finish_reason::error, &boom, 4, 0, request_stage::decode, 3));
  REQUIRE(r.prefills[0]->wait_submits(2));
  auto c = r.prefills[0]->submit(1);
  CHECK(c.id == "s0#m1");
  CHECK(c.generated.size() == 4);
  CHECK(c.decode_target != "d0/decode");
  live["s0"] = rig::start(c);
  r.step(live["s0"]);  // the continuation's first token (prefill)
  REQUIRE(r.col.wait_tokens("s0", 5));
  // Its new decode target goes down too: the budget (1 move) is spent.
  r.node_down(c.decode_target, "decode node is down");
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("s0");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  CHECK(std::string(ev.err->what()).find("router_max_migrations = 1") != std::string::npos);
  CHECK(ev.completion_tokens == 5);
  CHECK(r.col.tokens("s0") == expected_greedy(prompt_of(0), 5));
  CHECK(r.stats().value("router_migration_failures_total", "reason=\"budget\"") == 1);
}

TEST_CASE("router migration: a stream whose every decode target is lost ends naming the cause") {
  limits l = small_limits();
  rig r(l, 1, 2);
  auto live = start_streams(r, 1, 10, 1);
  r.node_down("d0", "decode node d0 is down");
  REQUIRE(r.prefills[0]->wait_submits(2));
  auto c = r.prefills[0]->submit(1);
  CHECK(c.decode_target == "d1/decode");
  auto a = rig::start(c);
  r.step(a);  // the continuation's first token: it is at d1 now
  REQUIRE(r.col.wait_tokens("s0", 3));
  r.node_down("d1", "decode node d1 is down");
  REQUIRE(r.col.wait_finished(1));
  CHECK(r.col.tokens("s0") == expected_greedy(prompt_of(0), 3));
  auto xe = r.col.last("s0");
  REQUIRE(xe.err);
  CHECK(xe.err->kind() == error_kind::disconnected);
  const std::string msg = xe.err->what();
  CHECK(msg.find("decode node d1 is down") != std::string::npos);
  CHECK(msg.find("d0/decode") != std::string::npos);  // the targets it lost
  CHECK(msg.find("no target to continue on") != std::string::npos);
  CHECK(r.stats().value("router_migration_failures_total", "reason=\"no_target\"") == 1);
}

TEST_CASE("router migration: the continuation keeps the request's deadline") {
  limits l = small_limits();
  l.request_timeout_ms = 5000;
  rig r(l, 1, 2);
  auto live = start_streams(r, 2, 10, 1);
  const auto orig = r.prefills[0]->submit(0);
  r.node_down("d0/decode", "decode node d0 is down");
  REQUIRE(r.prefills[0]->wait_submits(3));
  auto c = r.prefills[0]->submit(2);
  CHECK(c.id == "s0#m1");
  CHECK(c.deadline_ms == orig.deadline_ms);
  // Past the deadline the request ends (504-style deadline error), continuation or not.
  r.advance(5001);
  REQUIRE(r.col.wait_finished(2));
  auto ev = r.col.last("s0");
  REQUIRE(ev.err);
  CHECK(std::string(ev.err->what()).find("deadline") != std::string::npos);
  // A stage error after the deadline cannot move it again: it has ended.
  CHECK(r.stats().value("router_migrations_total") == 1);
  CHECK(r.col.duplicate_finishes == 0);
}

TEST_CASE("router migration: a client-side error mid-stream is not moved, an overloaded one ends the stream") {
  limits l = small_limits();
  rig r(l, 1, 2);
  auto live = start_streams(r, 1, 10, 2);
  tandem::error full(error_kind::overloaded, "KV cache exhausted; lower max_tokens");
  r.send(make_event("s0", {}, finish_reason::error, &full, 4, 0, request_stage::decode, 3));
  REQUIRE(r.col.wait_finished(1));
  REQUIRE(r.col.last("s0").err);
  CHECK(r.col.last("s0").err->kind() == error_kind::overloaded);
  CHECK(r.stats().value("router_migrations_total") == 0);
}

TEST_CASE("router migration: a per-target node_down also moves requests still at prefill that were routed to the dead decode node") {
  limits l = small_limits();
  rig r(l, 1, 2);
  r.submit("s0", prompt_of(0), 6);
  REQUIRE(r.prefills[0]->wait_submits(1));
  REQUIRE(r.prefills[0]->submit(0).decode_target == "d0/decode");
  // (role, target, why), as the per-node proxies send it; the request has not streamed yet.
  caf::anon_send(r.router.handle, node_down_atom::value, std::string("decode"), std::string("d0/decode"),
                 std::string("decode node d0 is down"));
  REQUIRE(r.prefills[0]->wait_submits(2));
  auto c = r.prefills[0]->submit(1);
  CHECK(c.id == "s0#m1");
  CHECK(c.generated.empty());
  CHECK(c.decode_target == "d1/decode");
  auto a = rig::start(c);
  for (int k = 0; k < 6; ++k) r.step(a);
  REQUIRE(r.col.wait_finished(1));
  CHECK(r.col.tokens("s0") == expected_greedy(prompt_of(0), 6));
  CHECK_FALSE(r.col.last("s0").err);
  {
    std::lock_guard lk(r.prefills[0]->m);
    CHECK(r.prefills[0]->aborts == std::vector<std::string>{"s0"});  // the prefill drops the old attempt
  }
  // With every decode node down, a new request is refused naming that.
  caf::anon_send(r.router.handle, node_down_atom::value, std::string("decode"), std::string("d1/decode"),
                 std::string("decode node d1 is down"));
  r.submit("late", prompt_of(1), 4);
  REQUIRE(r.col.wait_finished(2));
  REQUIRE(r.col.last("late").err);
  CHECK(r.col.last("late").err->kind() == error_kind::disconnected);
  CHECK(std::string(r.col.last("late").err->what()).find("no decode node is reachable") != std::string::npos);
}

TEST_CASE("router admission: a decode target with two batches of sequences waiting for a slot refuses (503 decode_queue), a continuation still goes there") {
  limits l = small_limits();
  rig r(l, 1, 1);
  r.decodes[0]->set_answer(false);  // only the credits below speak for d0
  auto decode_credit = [&](uint64_t seq, int32_t waiting) {
    r.send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
      c.setTarget("d0/decode");
      c.setRole(schema::StageRole::DECODE);
      c.setSeq(seq);
      c.setFreePages(100000);  // pages are not what is short
      c.setRunningSeqs(2);
      c.setWaitingSeqs(waiting);
      c.setMaxRunningSeqs(2);
    }));
  };
  decode_credit(1000, 4);  // 2 x max_running_seqs waiting: the default bound
  r.submit("late", prompt_of(0), 4);
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("late");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::overloaded);
  CHECK(ev.reject_reason == "decode_queue");
  CHECK(ev.retry_after_ms > 0);
  CHECK(std::string(ev.err->what()).find("max_decode_waiting_seqs") != std::string::npos);
  CHECK(r.stats().value("rejections_total", "actor=\"router\",reason=\"decode_queue\"") == 1);
  {
    std::lock_guard lk(r.prefills[0]->m);
    CHECK(r.prefills[0]->submits.empty());  // refused before anything was sent
  }
  decode_credit(1001, 3);  // one below the bound: admitted
  r.submit("ok", prompt_of(1), 4);
  REQUIRE(r.prefills[0]->wait_submits(1));
  CHECK(r.prefills[0]->submit(0).id == "ok");
  CHECK(r.prefills[0]->submit(0).decode_target == "d0/decode");
}

TEST_CASE("router admission: max_decode_waiting_seqs = -1 turns the decode queue bound off") {
  limits l = small_limits();
  l.max_decode_waiting_seqs = -1;
  rig r(l, 1, 1);
  r.decodes[0]->set_answer(false);
  r.send(make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
    c.setTarget("d0/decode");
    c.setRole(schema::StageRole::DECODE);
    c.setSeq(1000);
    c.setFreePages(100000);
    c.setRunningSeqs(2);
    c.setWaitingSeqs(50);
    c.setMaxRunningSeqs(2);
  }));
  r.submit("a", prompt_of(0), 4);
  REQUIRE(r.prefills[0]->wait_submits(1));
  CHECK(r.finished() == 0);
}

namespace {
/// What a decode target sends when it gives a sequence back for recompute (its KV transfer
/// failed, or its pages were preempted): the "preempted" event, then the requeue.
void send_back(rig& r, const attempt& a) {
  r.send(make_event(a.q.id, {}, finish_reason::none, nullptr, int32_t(a.q.prompt.size()), 0, request_stage::preempted, a.next));
  seq_request q = a.q;
  q.generated.assign(a.seq.begin() + static_cast<std::ptrdiff_t>(a.q.prompt.size()), a.seq.end());
  q.transfer_retries += 1;
  r.send(make_role_wire<router_role, msg::requeue>([&](schema::SubmitRequest::Builder b) { q.write(b); }));
}
}  // namespace

TEST_CASE("router requeue: a sequence sent back for recompute after its prefill node died ends at once with an error naming it") {
  // The race of a prefill node killed mid-transfer: the decode node learns it from the failed
  // transfer before its own link reports the node down, so it cannot pick a live prefill
  // itself. The router knows the target is lost and ends the request (migration off).
  limits l = small_limits();
  l.router_migration = false;
  rig r(l, 1, 1);
  auto live = start_streams(r, 2, 12, 2);
  r.node_down("p0", "prefill node p0 is down (killed)");
  CHECK(r.stats().value("requests_inflight") == 2);  // both at decode: not the prefill's to end
  send_back(r, live["s0"]);
  REQUIRE(r.col.wait_finished(1));
  auto ev = r.col.last("s0");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  CHECK(std::string(ev.err->what()).find("p0/prefill") != std::string::npos);
  CHECK(r.col.tokens("s0") == expected_greedy(prompt_of(0), 3));  // what streamed before stays
  {
    std::lock_guard lk(r.prefills[0]->m);
    CHECK(r.prefills[0]->requeues.empty());  // nothing sent to the dead node
  }
  // The other stream is untouched and finishes from decode.
  auto& a = live["s1"];
  while (a.next < 12) r.step(a);
  REQUIRE(r.col.wait_finished(2));
  CHECK(r.col.tokens("s1") == expected_greedy(prompt_of(1), 12));
  CHECK(r.col.duplicate_finishes == 0);
}

TEST_CASE("router requeue: a recompute goes to a live prefill target, and one that dies with it there ends it") {
  limits l = small_limits();
  l.router_migration = false;
  rig r(l, 2, 1);
  // round robin: s0 -> p0, s1 -> p1
  for (int i = 0; i < 2; ++i) r.submit("s" + std::to_string(i), prompt_of(i), 12);
  REQUIRE(r.prefills[0]->wait_submits(1));
  REQUIRE(r.prefills[1]->wait_submits(1));
  auto a0 = rig::start(r.prefills[0]->submit(0));
  auto a1 = rig::start(r.prefills[1]->submit(0));
  CHECK(a0.q.id == "s0");
  for (int k = 0; k < 3; ++k) r.step(a0), r.step(a1);
  REQUIRE(r.col.wait_tokens("s0", 3));
  REQUIRE(r.col.wait_tokens("s1", 3));
  // p0 is lost; s0's recompute goes to p1 (same attempt: no migration).
  r.node_down("p0", "prefill node p0 is down (killed)");
  send_back(r, a0);
  REQUIRE(r.prefills[1]->wait_requeues(1));
  {
    std::lock_guard lk(r.prefills[1]->m);
    CHECK(r.prefills[1]->requeues[0].id == "s0");
    CHECK(r.prefills[1]->requeues[0].generated == expected_greedy(prompt_of(0), 3));
  }
  CHECK(r.stats().value("router_migrations_total") == 0);
  // s1's recompute goes to its own target p1 too; then p1 dies with both there: both end.
  send_back(r, a1);
  REQUIRE(r.prefills[1]->wait_requeues(2));
  CHECK(r.finished() == 0);
  r.node_down("p1", "prefill node p1 is down (killed)");
  REQUIRE(r.col.wait_finished(2));
  for (const char* id : {"s0", "s1"}) {
    auto ev = r.col.last(id);
    REQUIRE(ev.err);
    CHECK(ev.err->kind() == error_kind::disconnected);
    CHECK(std::string(ev.err->what()).find("p1") != std::string::npos);
  }
  CHECK(r.stats().value("requests_inflight") == 0);
}
