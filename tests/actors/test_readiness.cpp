// node_readiness (actors/runtime/readiness.h): alive vs able to serve.
#include <doctest/doctest.h>

#include "actors/runtime/readiness.h"

using namespace tandem;

namespace {

stats_snapshot router_view(double prefill_targets, double prefill_live, double decode_targets, double decode_live) {
  stats_snapshot s;
  s.actor = "router";
  s.metrics.push_back({"router_targets", "role=\"prefill\"", prefill_targets, "gauge", ""});
  s.metrics.push_back({"router_targets", "role=\"decode\"", decode_targets, "gauge", ""});
  s.metrics.push_back({"router_live_targets", "role=\"prefill\"", prefill_live, "gauge", ""});
  s.metrics.push_back({"router_live_targets", "role=\"decode\"", decode_live, "gauge", ""});
  return s;
}

}  // namespace

TEST_CASE("readiness: a node is ready when alive and its router has a live target of every role") {
  auto all = router_view(1, 1, 2, 1);
  CHECK(node_readiness(true, "ok", &all).ready);
  CHECK(node_readiness(true, "ok", &all).reason == "ready");
  CHECK(node_readiness(true, "ok", nullptr).ready);  // no router: nothing to route to
  auto no_decode_role = router_view(1, 1, 0, 0);     // a router that does not route decode
  CHECK(node_readiness(true, "ok", &no_decode_role).ready);

  auto decode_down = router_view(1, 1, 1, 0);
  auto r = node_readiness(true, "ok", &decode_down);
  CHECK(!r.ready);
  CHECK(r.reason.find("no live decode target") != std::string::npos);
  CHECK(r.reason.find("prefill") == std::string::npos);

  auto both_down = router_view(2, 0, 1, 0);
  r = node_readiness(true, "ok", &both_down);
  CHECK(!r.ready);
  CHECK(r.reason.find("no live prefill target (2 configured") != std::string::npos);
  CHECK(r.reason.find("no live decode target") != std::string::npos);

  r = node_readiness(false, "escalated: worker failed 4 times", &all);
  CHECK(!r.ready);
  CHECK(r.reason == "escalated: worker failed 4 times");
}

TEST_CASE("readiness: a prefill node that reaches none of its decode nodes is not ready, one that reaches some is") {
  stats_snapshot p;
  p.actor = "prefill";
  p.metrics = {{"prefill_unreachable_decode_targets", "", 2, "gauge", ""}};
  auto r = handoff_readiness(&p, 2);
  CHECK(!r.ready);
  CHECK(r.reason.find("reaches none of its 2 decode node(s)") != std::string::npos);
  p.metrics[0].value = 1;
  CHECK(handoff_readiness(&p, 2).ready);
  CHECK(handoff_readiness(nullptr, 2).ready);  // no prefill role here
  CHECK(handoff_readiness(&p, 0).ready);       // every decode is local (or none)
}
