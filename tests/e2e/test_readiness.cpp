// Liveness and readiness of a router node (router, prefill and decode as three `tandem serve`
// processes on loopback): with the only node of a role killed the router is alive (/health
// 200) but cannot serve (/health/ready 503 naming the role, tandem_node_ready 0, `tandem
// inspect` degraded), and it is ready again once the node is back. Polls with deadlines.
#include <doctest/doctest.h>
#include <signal.h>

#include <chrono>
#include <string>

#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;
using clk = std::chrono::steady_clock;

namespace {

constexpr int32_t heartbeat_ms = 250;

/// Polls GET /health/ready of `port` until its status is `want` or 20 s pass; the last answer.
test::http_response poll_ready(uint16_t port, int want) {
  const auto until = clk::now() + std::chrono::seconds(20);
  test::http_response r;
  while (true) {
    r = test::get(port, "/health/ready");
    if (r.status == want || clk::now() >= until) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a condition, with a deadline
  }
}

std::string inspect_json(uint16_t admin_port) {
  child p({TANDEM_BINARY, "inspect", "127.0.0.1:" + std::to_string(admin_port), "--json", "--count", "1"}, {},
          "/dev/null");
  std::string out = p.read_all(std::chrono::seconds(30));
  p.wait(std::chrono::seconds(30));
  return out;
}

/// Kills the only node of `role`, checks the router is alive but not ready naming the role,
/// restarts the node and checks the router is ready again.
void lose_and_regain(const std::string& role) {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  pd_options o;
  o.extra_limits = "router_heartbeat_ms = " + std::to_string(heartbeat_ms) + "\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  node_proc& victim = role == "decode" ? pd.decode() : pd.prefill();
  const uint16_t port = pd.router().http;

  auto ready = test::get(port, "/health/ready");
  CHECK(ready.status == 200);
  CHECK(json::parse(ready.body).find("status")->s == "ready");
  CHECK(series(test::get(port, "/metrics").body, "tandem_node_ready{node=\"router\"}") == 1);

  ::kill(victim.proc->pid(), SIGKILL);
  const auto killed_at = clk::now();
  auto down = poll_ready(port, 503);
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - killed_at).count();
  INFO("/health/ready: " << down.body);
  REQUIRE(down.status == 503);
  CHECK(took <= 2 * heartbeat_ms + 1000);  // within 2 heartbeats of the loss, plus a loaded machine's slack
  auto j = json::parse(down.body);
  CHECK(j.find("status")->s == "degraded");
  CHECK(!j.find("ready")->b);
  CHECK(j.find("reason")->s.find("no live " + role + " target") != std::string::npos);
  CHECK(test::get(port, "/health").status == 200);  // alive: a liveness probe must not restart it
  CHECK(series(test::get(port, "/metrics").body, "tandem_node_ready{node=\"router\"}") == 0);
  auto report = inspect_json(pd.router().admin);
  INFO("inspect: " << report);
  CHECK(report.find("\"state\":\"degraded\"") != std::string::npos);
  CHECK(report.find("no live " + role + " target") != std::string::npos);
  MESSAGE("kill -9 of the " << role << " node: /health/ready 503 after " << took << " ms (heartbeat " << heartbeat_ms
                            << " ms)");

  pd.restart(victim, {});
  auto back = poll_ready(port, 200);
  INFO("/health/ready after the restart: " << back.body);
  CHECK(back.status == 200);
  CHECK(json::parse(back.body).find("status")->s == "ready");
  CHECK(series(test::get(port, "/metrics").body, "tandem_node_ready{node=\"router\"}") == 1);
}

}  // namespace

TEST_CASE("readiness: the only decode node killed makes the router alive but not ready, until it returns") {
  lose_and_regain("decode");
}

TEST_CASE("readiness: the only prefill node killed makes the router alive but not ready, until it returns") {
  lose_and_regain("prefill");
}
