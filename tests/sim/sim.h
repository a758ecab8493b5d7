#pragma once
// Deterministic simulation of one node's actors (router, prefill, decode, worker with the fake
// model, cache tier, supervisor) on CAF's single-threaded test scheduler and its simulated clock,
// with seeded faults on the message paths. Every choice (which actor runs next, when time moves,
// which fault) comes from one RNG seeded per run, so a seed replays exactly.
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/common/bounded_mailbox.h"
#include "kernels/base/clock.h"
#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"

namespace tandem::sim {

/// splitmix64: the same sequence on every platform and standard library.
class sim_rng {
 public:
  explicit sim_rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n); n > 0.
  uint64_t below(uint64_t n) { return next() % n; }
  /// Uniform in [lo, hi].
  int64_t between(int64_t lo, int64_t hi) { return lo + int64_t(below(uint64_t(hi - lo + 1))); }
  /// Always draws, so turning one fault off (TANDEM_SIM_OFF) keeps every other choice of the run.
  bool chance(double p) { return double(next() >> 11) * 0x1.0p-53 < p; }

 private:
  uint64_t s_;
};

/// The fault menu of one run (chosen from the seed; some runs are nearly fault free).
struct fault_menu {
  double gate_reject = 0;   ///< a work-creating send finds the mailbox full (every gate)
  double delay = 0;         ///< a message waits on its cross-node link (FIFO per link kept)
  int32_t max_delay_ms = 0;
  double drop = 0;          ///< lost on a cross-node link (only messages whose loss a deadline covers)
  double duplicate = 0;     ///< delivered twice on a cross-node link (idempotent messages only)
  double forward_fail = 0;  ///< the worker's forward pass fails (KV write/transfer failure)
  int32_t crashes = 0;      ///< actor crashes (exit with an error; the supervisor restarts the set)
  double time_step = 0;     ///< before a step, simulated time moves 1..max_time_step_ms
  int32_t max_time_step_ms = 1;
  std::string reject_only;  ///< if set, only this actor's gate refuses (regression tests)
};

/// What one run found; `ok()` iff every invariant held.
struct sim_result {
  uint64_t seed = 0;
  std::vector<std::string> violations;
  std::vector<std::string> trace;  ///< the last events, oldest first
  int64_t steps = 0;
  int64_t sim_ms = 0;
  int32_t requests = 0, completed = 0, errors = 0, restarts = 0, faults = 0;
  int64_t kv_transfers = 0;  ///< KV transfers delivered (the cluster simulation)
  std::string replay;  ///< the command that replays this run (default: the one-node simulation's)
  bool ok() const { return violations.empty(); }
  /// The seed, the replay command, the violations and the trace.
  std::string report() const;
};

/// Runs one seed to quiescence and checks the invariants. `menu`: these faults instead of the
/// seed's own choice (the limits and the workload still come from the seed).
sim_result run_seed(uint64_t seed, const fault_menu* menu = nullptr);

}  // namespace tandem::sim
