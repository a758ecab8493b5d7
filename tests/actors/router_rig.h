#pragma once
// The router against scripted targets (test_router_{admission,drain,node_down,migration}):
// each test plays the prefill and decode stages by hand, on CAF's test scheduler and its
// simulated clock (tests/actors/test_system.h), so every decision the router makes is
// deterministic: the actors run one message at a time in one thread, a wait runs them until
// its condition holds (or fails at once when they go quiet), and the router's ticks,
// heartbeats and backoffs fire only when a test advances the clock. One scripted target
// records everything the router sends it; one rig owns the actor system, the targets and the
// router, and each test file adds the helpers (credits, tokens) its cases speak in.
#include <doctest/doctest.h>

#include <caf/all.hpp>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "actors/common/protocol.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "tests/actors/support.h"
#include "tests/actors/test_system.h"

namespace tandem::test {

/// A scripted prefill or decode target: records the submissions, aborts, requeues and credit
/// queries the router sends it. While `answer` is set and `router` is known, it answers each
/// credit query with a credit, as a live stage does (a rig that sets no router gets none).
struct target_box {
  std::string name, role;
  std::mutex m;
  std::condition_variable cv;
  std::vector<seq_request> submits;
  std::vector<std::string> aborts;
  std::vector<seq_request> requeues;
  std::vector<int32_t> holds;  ///< each credit query's holds, in order
  int queries = 0;
  bool answer = true;  ///< answers credit queries (alive); false = silent
  bounded_actor router;
  uint64_t seq = 0;
  /// Runs the actors until a condition holds (the rig's test_system::run_until).
  std::function<bool(const std::function<bool()>&, const std::string&)> pump;

  void push(const wire& w) {
    wire_reader rd(w);
    auto env = rd.root();
    std::lock_guard lk(m);
    // A prefill target gets PrefillIn messages, a decode target DecodeIn ones.
    const bool pre = env.isPrefill(), dec = env.isDecode();
    if (pre && env.getPrefill().isSubmit()) submits.push_back(seq_request::read(env.getPrefill().getSubmit()));
    if (dec && env.getDecode().isSubmit()) submits.push_back(seq_request::read(env.getDecode().getSubmit()));
    if (pre && env.getPrefill().isAbort()) aborts.push_back(env.getPrefill().getAbort().getId().cStr());
    if (dec && env.getDecode().isAbort()) aborts.push_back(env.getDecode().getAbort().getId().cStr());
    if (pre && env.getPrefill().isRequeue()) requeues.push_back(seq_request::read(env.getPrefill().getRequeue()));
    if ((pre && env.getPrefill().isCreditQuery()) || (dec && env.getDecode().isCreditQuery())) {
      holds.push_back(pre ? env.getPrefill().getCreditQuery().getHolds() : env.getDecode().getCreditQuery().getHolds());
      // The answer goes out before the query is counted: a test that saw the query and then
      // asks the router something finds the credit processed.
      if (answer && router) {
        router.gate->enter_control();
        caf::anon_send(router.handle, wire_atom::value, make_role_wire<router_role, msg::credit>([&](schema::Credit::Builder c) {
                         c.setTarget(name);
                         c.setRole(role == "decode" ? schema::StageRole::DECODE : schema::StageRole::PREFILL);
                         c.setSeq(++seq);
                         c.setFreePages(-1);
                       }));
      }
      queries += 1;
    }
    cv.notify_all();
  }
  /// Runs the actors until `ok` holds (evaluated with `m` held); false if they went quiet first.
  bool wait(const std::function<bool()>& ok, const std::string& what = "") {
    return pump(
        [&] {
          std::lock_guard lk(m);
          return ok();
        },
        what.empty() ? "the awaited state of target " + name : what + " at target " + name);
  }
  bool wait_submits(size_t n) {
    return wait([&] { return submits.size() >= n; }, std::to_string(n) + " submissions");
  }
  bool wait_requeues(size_t n) {
    return wait([&] { return requeues.size() >= n; }, std::to_string(n) + " requeues");
  }
  bool wait_queries(int n) {
    return wait([&] { return queries >= n; }, std::to_string(n) + " credit queries");
  }
  int query_count() {
    std::lock_guard lk(m);
    return queries;
  }
  seq_request submit(size_t i) {
    std::lock_guard lk(m);
    return submits.at(i);
  }
  /// The ids submitted here, in order (call with `m` held).
  std::vector<std::string> submit_ids() const {
    std::vector<std::string> ids;
    for (const auto& q : submits) ids.push_back(q.id);
    return ids;
  }
  void set_answer(bool a) {
    std::lock_guard lk(m);
    answer = a;
  }
};

inline caf::behavior scripted_target(caf::event_based_actor*, std::shared_ptr<mailbox_gate> gate,
                                     std::shared_ptr<target_box> box) {
  return {[gate, box](wire_atom, const wire& w) {
    gate->leave();
    box->push(w);
  }};
}

/// A router over scripted targets on the test scheduler: add the targets, then launch() it
/// with the options. `clk` (the scheduler's clock) is the router's cluster clock; move it
/// with advance_ms().
struct router_rig : test_system {
  std::vector<std::shared_ptr<target_box>> prefill, decode;
  std::vector<route_target> prefill_targets, decode_targets;
  std::vector<caf::actor> targets;  ///< every scripted target (stopped with the router)
  bounded_actor router;
  collector col;
  bool stopped_ = false;

  router_rig() {
    start();
    col.pump = [this](const std::function<bool()>& ok, const std::string& what) { return run_until(ok, what); };
  }
  ~router_rig() { stop(); }
  /// Stops the router and the targets and ends the system. A rig whose own members the actors
  /// reach (a collector callback writing them) calls it from its destructor, before they go.
  void stop() {
    if (stopped_) return;
    stopped_ = true;
    auto all = targets;
    all.push_back(router.handle);
    shutdown(all);
  }
  router_rig(const router_rig&) = delete;
  router_rig& operator=(const router_rig&) = delete;

  /// A scripted target `name` of `role` ("prefill" or "decode"), its mailbox gate named `gate_name`.
  void add_target(const std::string& name, const std::string& role, const std::string& gate_name) {
    auto box = std::make_shared<target_box>();
    box->name = name;
    box->role = role;
    box->pump = col.pump;
    auto gate = std::make_shared<mailbox_gate>(gate_name, 1024);
    const bool is_prefill = role == "prefill";
    (is_prefill ? prefill : decode).push_back(box);
    targets.push_back(sys->spawn(scripted_target, gate, box));
    (is_prefill ? prefill_targets : decode_targets).push_back(route_target{name, bounded_actor{targets.back(), gate}});
  }
  /// Spawns the router over the targets added so far; `answering` targets get its handle.
  void launch(const router_options& ro, bool answering = false) {
    router = spawn_router(*sys, ro, std::move(prefill_targets), std::move(decode_targets), clk,
                          make_actor_logger("router", quiet_sink(), "off"));
    if (!answering) return;
    for (auto* v : {&prefill, &decode})
      for (auto& b : *v) {
        std::lock_guard lk(b->m);
        b->router = router;
      }
  }

  /// Submits `id` with `prompt`, at most `max_tokens` tokens.
  void submit(const std::string& id, std::vector<int32_t> prompt = {1, 2, 3, 4}, int32_t max_tokens = 8,
              bool ignore_eos = false) {
    seq_request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.ignore_eos = ignore_eos;
    submit(r);
  }
  void submit(const seq_request& r) {
    router.gate->enter_control();
    caf::anon_send(router.handle, submit_atom::value,
                   make_role_wire<router_role, msg::submit>([&](schema::SubmitRequest::Builder b) { r.write(b); }),
                   callback_box{col.cb()});
  }
  void send(const wire& w) {
    router.gate->enter_control();
    caf::anon_send(router.handle, wire_atom::value, w);
  }
  /// Where `id` went: (prefill index, the decode target it names); runs the actors until it
  /// was submitted somewhere ({-1, ""} if they went quiet first).
  std::pair<int, std::string> placed(const std::string& id) {
    std::pair<int, std::string> at{-1, ""};
    auto find = [&] {
      for (size_t i = 0; i < prefill.size(); ++i) {
        std::lock_guard lk(prefill[i]->m);
        // The latest submission of `id` there (a retry names another decode target).
        for (auto q = prefill[i]->submits.rbegin(); q != prefill[i]->submits.rend(); ++q)
          if (q->id == id) {
            at = {int(i), q->decode_target};
            return true;
          }
      }
      return false;
    };
    run_until(find, "a submission of " + id);
    return at;
  }
  /// The router's stats, after it processed everything sent so far.
  stats_snapshot stats() { return stats_of(router.handle); }
};

}  // namespace tandem::test
