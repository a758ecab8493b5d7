// actor_cluster::inspect(): what `tandem inspect` shows, with a request held in flight.
// Threaded on purpose (real CAF threads): the worker's own thread is stuck inside a forward pass
// (forward_gate), and inspect must report it "not answering" after query_timeout_ms while the
// other actors answer. On the test scheduler (tests/actors/cluster_rig.h) a held actor's mail
// schedules nothing, so a blocking query to it could never time out there.
#include <doctest/doctest.h>

#include "actors/runtime/actor_cluster.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("inspect: actors with mailboxes, the in-flight request with its state and age, the KV pool") {
  auto gate = std::make_shared<forward_gate>();
  gate->pause_at = 0;
  actor_cluster_options o;
  o.lim = small_limits();
  o.sink = quiet_sink();
  o.eos_id = -1;
  o.node_name = "n7";
  o.lim.query_timeout_ms = 300;  // the worker is held on purpose; do not wait long for it
  actor_cluster c(std::make_shared<fake_model>(gate), o);
  collector col;
  // A failed REQUIRE below must not leave the worker held: ~actor_cluster would wait for it.
  struct release_on_exit {
    std::shared_ptr<forward_gate> g;
    ~release_on_exit() { g->release(); }
  } guard{gate};
  c.submit(make_req("held", {1, 2, 3, 4, 5, 6}, 4), col.cb());
  REQUIRE(gate->wait_paused());

  // The router answers within query_timeout_ms; on a loaded machine (ASan, parallel builds)
  // one round can miss it, so ask again until the held request shows (bounded).
  auto r = c.inspect();
  for (int i = 0; i < 20 && r.requests.empty(); ++i) r = c.inspect();
  CHECK(r.node == "n7");
  CHECK(r.healthy);
  REQUIRE(r.actors.size() == 5);
  std::vector<std::string> names;
  for (const auto& a : r.actors) names.push_back(a.name);
  CHECK(names == std::vector<std::string>{"router", "prefill", "decode", "worker", "cache_tier"});
  CHECK(r.actors[0].mailbox_bound == o.lim.router_mailbox);
  CHECK(r.actors[0].messages_handled >= 1);  // the submission
  CHECK(r.actors[0].restarts == 0);
  CHECK(r.actors[0].last_error.empty());
  // The worker is busy in the held forward pass, so it cannot answer; the rest can.
  CHECK(r.actors[3].state == "not answering");
  CHECK(r.actors[1].state == "running");
  REQUIRE(r.requests.size() == 1);
  CHECK(r.requests[0].id == "held");
  CHECK(r.requests[0].state != "");
  CHECK(r.requests[0].age_ms >= 0);
  CHECK(r.requests[0].prompt_tokens == 6);
  REQUIRE(r.pools.size() == 1);
  CHECK(r.pools[0].name == "device");
  CHECK(r.pools[0].pages_total == c.n_pages());
  CHECK(r.pools[0].pages_free < c.n_pages());  // the held request's pages

  gate->release();
  REQUIRE(col.wait_finished(1));
  auto after = c.inspect();
  CHECK(after.requests.empty());
  c.inject_failure("decode", "decode drill");
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (c.inspect().actors[2].restarts == 0 && std::chrono::steady_clock::now() < until) {
  }
  auto restarted = c.inspect();
  CHECK(restarted.actors[2].restarts == 1);
  CHECK(restarted.actors[2].last_error.find("decode drill") != std::string::npos);
}
