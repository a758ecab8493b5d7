// The node supervisor: a failed actor restarts the node's actor set within the restart
// intensity, in-flight requests end with `disconnected`, and one failure too many escalates.
// On the test scheduler (tests/actors/cluster_rig.h): the failures, restarts and escalation
// land in the order the messages run, every wait runs the actors until quiet.
#include <doctest/doctest.h>

#include "actors/runtime/actor_cluster.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;

namespace {

actor_cluster_options sup_opts(int32_t max_restarts) {
  actor_cluster_options o;
  o.lim = small_limits();
  o.lim.supervisor_max_restarts = max_restarts;
  o.lim.supervisor_period_ms = 600000;
  o.sink = quiet_sink();
  o.eos_id = -1;
  o.node_name = "n0";
  return o;
}

double supervisor_value(cluster_rig& c, const std::string& name, const std::string& labels) {
  for (const auto& s : c.snapshots(false))
    if (s.actor == "supervisor") return s.value(name, labels);
  return -1;
}

/// Whether the supervisor reports `n` restarts after failures of `actor` once the actors are quiet.
bool wait_restarts(cluster_rig& c, const std::string& actor, double n) {
  c.run();
  const double v = supervisor_value(c, "actor_restarts_total", "node=\"n0\",actor=\"" + actor + "\"");
  if (v < n) MESSAGE("the supervisor reports " << v << " restarts of " << actor << ", want " << n);
  return v >= n;
}

token_event run_one(cluster_rig& c, const std::string& id) {
  collector col;
  c.submit(make_req(id, {1, 2, 3, 4, 5}, 6), col.cb());
  REQUIRE(col.wait_finished(1));
  return col.last(id);
}

}  // namespace

TEST_CASE("supervisor: a failed worker is restarted and the node serves again, the failure is exported") {
  cluster_rig c(std::make_shared<fake_model>(), sup_opts(3));
  auto before = run_one(c, "a");
  REQUIRE_FALSE(before.err);
  c.inject_failure("worker", "worker crashed in a drill");
  REQUIRE(wait_restarts(c, "worker", 1));
  auto after = run_one(c, "b");
  CHECK_FALSE(after.err);
  CHECK(after.reason == finish_reason::length);
  CHECK(c.health().ok);
  auto text = c.metrics_text();
  CHECK(text.find("tandem_actor_restarts_total{node=\"n0\",actor=\"worker\"} 1") != std::string::npos);
  CHECK(text.find("tandem_actor_restarts_total{node=\"n0\",actor=\"router\"} 0") != std::string::npos);
  CHECK(text.find("tandem_actor_failures_total{node=\"n0\",actor=\"worker\"} 1") != std::string::npos);
  CHECK(text.find("cause=\"") != std::string::npos);
  CHECK(text.find("worker crashed in a drill") != std::string::npos);
  CHECK(text.find("tandem_node_up{node=\"n0\"} 1") != std::string::npos);
  CHECK_THROWS_WITH(c.inject_failure("gpu"), doctest::Contains("use router, prefill, decode, worker or cache_tier"));
}

TEST_CASE("supervisor: a request in flight when the router fails ends with disconnected, not silence") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  cluster_rig c(std::make_shared<fake_model>(gate), sup_opts(3));
  collector col;
  c.submit(make_req("r", {1, 2, 3}, 8), col.cb());
  REQUIRE(gate->wait_paused());
  c.inject_failure("router");
  REQUIRE(col.wait_finished(1));
  gate->release();
  auto last = col.last("r");
  REQUIRE(last.err);
  CHECK(last.err->kind() == error_kind::disconnected);
  CHECK(std::string(last.err->what()).find("restarted") != std::string::npos);
  REQUIRE(wait_restarts(c, "router", 1));
  CHECK_FALSE(run_one(c, "after").err);
  CHECK(col.duplicate_finishes == 0);
}

TEST_CASE("supervisor: one failure more than the restart intensity escalates and the node is unhealthy") {
  cluster_rig c(std::make_shared<fake_model>(), sup_opts(1));
  c.inject_failure("decode");
  REQUIRE(wait_restarts(c, "decode", 1));
  c.inject_failure("prefill");
  // Escalation, once the supervisor has acted.
  c.run();
  auto h = c.health();
  CHECK_FALSE(h.ok);
  CHECK(h.status.find("node n0 is unhealthy: actor prefill failed") != std::string::npos);
  CHECK(h.status.find("limits.supervisor_max_restarts = 1") != std::string::npos);
  auto ev = run_one(c, "late");
  REQUIRE(ev.err);
  CHECK(ev.err->kind() == error_kind::disconnected);
  auto text = c.metrics_text();
  CHECK(text.find("tandem_node_up{node=\"n0\"} 0") != std::string::npos);
  CHECK(text.find("tandem_node_escalated{node=\"n0\"} 1") != std::string::npos);
  CHECK(text.find("tandem_actor_restarts_total{node=\"n0\",actor=\"prefill\"} 0") != std::string::npos);
  CHECK(text.find("tandem_actor_failures_total{node=\"n0\",actor=\"prefill\"} 1") != std::string::npos);
}
