#pragma once
// Actors on CAF's deterministic test scheduler (caf::scheduler::test_coordinator): one thread,
// one message per step, time moves only when the test moves it. The router rigs of tests/actors
// run on it in FIFO order; the simulations (tests/sim/world_base.h) pick each step by seed.
// Every run is bounded: a flow that hangs fails at once, naming what it waited for.
#include <doctest/doctest.h>

#include <algorithm>
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "kernels/base/clock.h"

namespace tandem::test {

/// The cluster clock read from the test scheduler's simulated time (ms): the actors' deadlines
/// and the CAF timers (router ticks, heartbeats, retry backoffs) move together.
class sim_clock final : public cluster_clock {
 public:
  explicit sim_clock(caf::detail::test_actor_clock& c) : c_(c) {}
  int64_t now_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(c_.current_time.time_since_epoch()).count();
  }

 private:
  caf::detail::test_actor_clock& c_;
};

/// Spawns the function actor `f(Self*)`. CAF 0.17's init_fun_factory dereferences a null
/// argument tuple when the function takes nothing besides `self` (UBSan: reference binding to
/// a null pointer), so every function actor on the test scheduler goes through this, which
/// hands it one unused argument.
template <class Self, class F>
caf::actor spawn_fn(caf::actor_system& sys, F f) {
  return sys.spawn([f = std::move(f)](Self* self, int) mutable { return f(self); }, 0);
}

/// An actor system on the test scheduler, its clock an hour past zero (so no time is 0).
/// Actors spawned on it must not be detached (a detached actor gets a thread of its own).
struct test_system {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::scheduler::test_coordinator* sched = nullptr;
  std::shared_ptr<sim_clock> clk;
  /// The most jobs one run may take before it counts as a hang (a livelock, a message loop).
  int64_t max_steps = 2'000'000;
  /// Jobs this returns false for wait (an actor held as if stuck); null = every job runs.
  std::function<bool(caf::resumable*)> runnable;
  /// When a wait finds the actors quiet, it moves the clock to the next timer if that is due at
  /// most this long after the wait began (a scheduler's retry tick); 0 = only advance_ms moves it.
  int64_t timers_within_ms = 0;

  test_system() = default;
  test_system(const test_system&) = delete;
  test_system& operator=(const test_system&) = delete;

  void start() {
    cfg.set("scheduler.policy", caf::atom("testing"));
    cfg.set("logger.verbosity", caf::atom("quiet"));
    cfg.set("logger.console", caf::atom("none"));
    cfg.add_message_type<wire>("tandem_wire");
    sys = std::make_unique<caf::actor_system>(cfg);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(sys->scheduler());
    sched->clock().current_time += std::chrono::hours(1);
    clk = std::make_shared<sim_clock>(sched->clock());
  }

  int64_t now_ms() const { return clk->now_ms(); }

  /// Runs one job that may run (FIFO among them); false if there is none.
  bool step_once() {
    auto& jobs = sched->jobs;
    auto it = jobs.begin();
    if (runnable)
      while (it != jobs.end() && !runnable(*it)) ++it;
    if (it == jobs.end()) return false;
    std::rotate(jobs.begin(), it, it + 1);
    sched->run_once();
    return true;
  }

  /// Runs the actors until `done()` holds. No time passes (but see timers_within_ms): a timer
  /// fires only when the test advances the clock. False, with a message naming `what`, if the
  /// actors went quiet first (nothing left to run) or did not within `max_steps` jobs (a hang).
  bool run_until(const std::function<bool()>& done, const std::string& what = "the awaited state") {
    const int64_t until_ms = now_ms() + timers_within_ms;
    for (int64_t steps = 0;; ++steps) {
      if (done()) return true;
      if (steps >= max_steps) {
        MESSAGE("still waiting for " << what << " after " << steps << " jobs: the actors do not go quiet");
        return false;
      }
      if (step_once()) continue;
      if (timers_within_ms > 0 && next_timer_ms() <= until_ms) {
        sched->trigger_timeout();
        continue;
      }
      MESSAGE("the actors went quiet at t=" << now_ms() << " ms without " << what);
      return false;
    }
  }
  /// When the next timer is due (INT64_MAX if none).
  int64_t next_timer_ms() const {
    const auto& sc = sched->clock().schedule();
    if (sc.empty()) return INT64_MAX;
    return std::chrono::duration_cast<std::chrono::milliseconds>(sc.begin()->first.time_since_epoch()).count();
  }

  /// Runs every job there is (no time passes); false if they do not end within `max_steps`.
  bool run() {
    for (int64_t steps = 0; steps < max_steps; ++steps)
      if (!step_once()) return true;
    FAIL_CHECK("the actors do not go quiet after " << max_steps << " jobs");
    return false;
  }

  /// Moves the clock by `ms` as if it jumped: every timer due by then (ticks, heartbeats,
  /// backoffs, request timeouts) fires once, at the new time, and the actors run until quiet.
  void advance_ms(int64_t ms) {
    run();
    sched->advance_time(std::chrono::milliseconds(ms));
    run();
  }

  /// The answer of `a` to the request `xs...` (its first value of type T), after running the
  /// actors; nullopt if it answered an error or not at all.
  template <class T, class... Ts>
  std::optional<T> ask(const caf::actor& a, Ts... xs) {
    auto out = std::make_shared<std::optional<T>>();
    auto done = std::make_shared<bool>(false);
    spawn_fn<caf::event_based_actor>(*sys, [a, out, done, xs...](caf::event_based_actor* self) {
      self->request(a, caf::infinite, xs...)
          .then([out, done](const T& v) {
                  *out = v;
                  *done = true;
                },
                [done](caf::error&) { *done = true; });
    });
    run_until([&] { return *done; }, "an answer");
    return *out;
  }

  /// The stats snapshot of `a` (empty if it did not answer).
  stats_snapshot stats_of(const caf::actor& a) {
    auto w = ask<wire>(a, stats_atom::value);
    return w ? read_stats(*w) : stats_snapshot{};
  }

  /// Stops `actors` and ends the system (the actors' exits run first).
  void shutdown(const std::vector<caf::actor>& actors) {
    if (!sys) return;
    runnable = nullptr;  // held actors run their exits too
    for (const auto& a : actors)
      if (a) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    run();
    sys->await_actors_before_shutdown(false);
    sys.reset();
  }
};

}  // namespace tandem::test
