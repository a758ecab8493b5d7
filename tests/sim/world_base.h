#pragma once
// What both simulations (one node: sim.cpp, a cluster: cluster_world.h) share: the simulated
// clock, the actor system on CAF's test scheduler, the bounded trace, what the front end saw per
// request, the seeded workload and the invariants checked at the end of every run. Internal to
// tests/sim.
#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>

#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/limits.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/runtime/node_plan.h"
#include "actors/runtime/serving_api.h"
#include "kernels/base/clock.h"
#include "tests/actors/test_system.h"
#include "tests/sim/sim.h"

namespace tandem::sim {

// The clock and the function-actor spawn of the test scheduler, shared with tests/actors.
using test::sim_clock;
using test::spawn_fn;

/// Per request, what the front end saw.
struct req_record {
  std::vector<int32_t> prompt;
  int32_t max_tokens = 0;
  std::vector<int32_t> tokens;
  int finished = 0;
  finish_reason reason = finish_reason::none;
  std::string error;
};

/// The limits both simulations draw (small bounds so every rejection path runs), in one order
/// so a seed replays; `timeout_min_ms`: the least request timeout drawn.
void draw_limits(sim_rng& r, limits& l, int32_t timeout_min_ms);

/// The plan `tandem serve` would run a node of `spec` with on the test model (its sizes are the
/// spec's: limits.device_pages, page_size); the actors' options are its views
/// (actors/runtime/node_plan_views.h). Throws naming the reason if the plan refuses the node.
node_plan sim_plan(const node_spec& spec, const llama_model& model);

/// One request of a run's workload.
struct arrival {
  int64_t at_ms = 0;
  std::string id;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 0;
  int64_t deadline_in_ms = 0;
};

/// The shape of a run's workload: n_min..n_max requests ("r0", "r1", ...), half of them sharing
/// a prefix; each arrives in the first 40 ms with chance `early`, else in 40..late_until_ms.
struct workload_shape {
  int n_min = 2, n_max = 7;
  double early = 1;  ///< 1: all early (no draw)
  int64_t late_until_ms = 0;
  double deadline = 0.3;  ///< chance of a deadline of 5..300 ms
};

/// The actor system on the test scheduler (test::test_system), run in the seed's order.
struct world_base : test::test_system {
  sim_rng rng;
  std::shared_ptr<spdlog::sinks::sink> sink = std::make_shared<spdlog::sinks::null_sink_mt>();
  std::deque<std::string> trace;
  std::map<std::string, req_record> reqs;
  std::vector<std::string> violations;

  world_base(uint64_t rng_seed, size_t trace_len) : rng(rng_seed), trace_len_(trace_len) {}

  int64_t now() const { return clk->now_ms(); }
  void note(std::string s);
  void violate(std::string s);
  /// The front end's view of request `id`: one finished event, nothing after it.
  void on_event(const std::string& id, token_event ev);
  /// Records a submit of `id` and builds its request: greedy (the output is known:
  /// test::expected_greedy), ignoring EOS, with the deadline.
  seq_request make_request(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens,
                           int64_t deadline_in_ms);
  /// Sends `r` to the router through its gate (a full gate answers overloaded at once).
  void send_submit(const bounded_actor& router, const seq_request& r);
  /// The actor system on the test scheduler, its clock an hour past zero (so no time is 0).
  void start_system();
  /// Runs one job, chosen by the seed.
  void step();
  /// Runs every job (no time passes): for queries at the end.
  void drain();
  std::optional<stats_snapshot> stats_of(const caf::actor& a);

  /// The workload of a run, by arrival time.
  std::vector<arrival> make_workload(const workload_shape& shape);
  /// Every request ended exactly once; completed outputs equal greedy, streamed ones are a prefix.
  void check_requests(const std::vector<arrival>& arrivals, sim_result& res);
  /// Every page of a device pool is free or evictable (`where`: "device pool", "node d0").
  void check_pages(const caf::actor& cache, int32_t n_pages, const std::string& where);
  /// A mailbox gate after quiescence: empty (when `depth`), and never past its bound by more
  /// than `slack` control messages.
  void check_gate(const mailbox_gate& g, int64_t slack, const std::string& where, bool depth);

 private:
  size_t trace_len_;
};

}  // namespace tandem::sim
