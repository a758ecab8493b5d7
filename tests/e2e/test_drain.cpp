// A rolling restart of a decode node loses nothing (issue 25): a router, a prefill node and
// two decode nodes as four `tandem serve` processes on loopback.
//  - Drain: `tandem inspect --drain` of a decode node under 40 streams: no new request goes
//    there, every stream finishes (zero errors), the node reports drained; restarted, it takes
//    traffic again.
//  - Restart under load: a decode node killed and restarted while clients keep sending: zero
//    failed requests (its streams move to the other decode node; the restarted node is routed
//    to only once the prefill node reaches it again).
//  - A prefill node that dies while a decode node holds handoffs parked for pages (their KV
//    still on the prefill node): they end at node-down, not when pages free up.
#include <doctest/doctest.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;
using clk = std::chrono::steady_clock;

namespace {

/// Room for 40 streams over two decode nodes without a refusal. The default heartbeat (1 s):
/// a decode node that takes over a killed one's streams on a loaded 2-core machine can be
/// silent for a few hundred ms, which a short heartbeat would count as lost.
std::string head(const std::string& model) {
  return "[limits]\npage_size = 16\nkv_cache_mb = 64\nmax_running_seqs = 32\nmax_decode_waiting_seqs = -1\n"
         "\n[model]\npath = \"" +
         model + "\"\n\n[cache]\nenabled = false\n\n[transfer]\nfailure_policy = \"recompute\"\ntimeout_ms = 5000\n\n"
         "[router]\npolicy = \"round_robin\"\nmigration = true\n";
}

std::vector<node_spec> nodes() {
  return {{"router", {"router"}, {}},
          {"prefill-0", {"prefill", "cache", "worker"}, {}},
          {"decode-0", {"decode", "cache", "worker"}, {}},
          {"decode-1", {"decode", "cache", "worker"}, {}}};
}

std::string routed(const std::string& target) { return "tandem_router_routed_total{target=\"" + target + "\"}"; }

/// `tandem inspect ADMIN --json [extra]`: its one report.
std::string inspect(uint16_t admin, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> argv{TANDEM_BINARY, "inspect", "127.0.0.1:" + std::to_string(admin), "--json"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  if (extra.empty()) argv.insert(argv.end(), {"--count", "1"});
  child p(argv, {}, "/dev/null");
  std::string out = p.read_all(std::chrono::seconds(30));
  p.wait(std::chrono::seconds(30));
  return out;
}

/// Waits until the router routes to every target of the cluster (fresh credits, reachable).
std::string wait_routable(uint16_t router) {
  return poll_metrics(router, [](const std::string& m) {
    return series(m, "tandem_router_live_targets{role=\"decode\"}") == 2 &&
           series(m, "tandem_router_live_targets{role=\"prefill\"}") == 1;
  });
}

/// A streamed completion (SSE keeps the socket busy, so a slow machine does not hit the test
/// client's 10 s receive timeout): its status and body.
struct streamed {
  int status = 0;
  std::string body;
  /// 200, every chunk through [DONE], no in-band error, finished by length.
  bool ok() const {
    return status == 200 && body.find("data: [DONE]") != std::string::npos &&
           body.find("\"error\"") == std::string::npos && body.find("\"finish_reason\":\"length\"") != std::string::npos;
  }
};

streamed stream(uint16_t port, const std::string& prompt, int32_t max_tokens) {
  auto r = test::post(port, "/v1/completions", completion_body(prompt, max_tokens, true));
  return {r.status, r.body};
}

const char* const prompts[] = {"hello world", "The quick brown fox jumps over the lazy dog", "a",
                               "Once upon a time in a land far away", "1 2 3 4 5 6 7 8 9 10"};

}  // namespace

TEST_CASE("drain: a decode node drained under 40 streams loses none, reports drained, and takes traffic after a restart") {
  temp_dir dir;
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  node_cluster c(dir.path, head(model), nodes());
  INFO(c.logs());
  const uint16_t router = c.node("router").http;
  REQUIRE(series(wait_routable(router), "tandem_router_live_targets{role=\"decode\"}") == 2);

  std::vector<streamed> streams(40);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < streams.size(); ++i)
    ts.emplace_back([&, i] { streams[i] = stream(router, prompts[i % 5], 160); });
  // Drain decode-1 once it is decoding some of them.
  auto dm = poll_metrics(c.node("decode-1").http,
                         [](const std::string& m) { return series(m, "tandem_decode_running_requests") >= 1; });
  REQUIRE(series(dm, "tandem_decode_running_requests") >= 1);
  const std::string drained_report = inspect(c.node("decode-1").admin, {"--drain"});
  INFO("inspect --drain: " << drained_report);
  CHECK(drained_report.find("\"drain\":\"draining\"") != std::string::npos);
  // The router sees it draining; new requests meanwhile go to decode-0 only.
  auto rm = poll_metrics(router, [](const std::string& m) {
    return series(m, "tandem_router_target_draining{target=\"decode-1/decode\"}") == 1;
  });
  REQUIRE(series(rm, "tandem_router_target_draining{target=\"decode-1/decode\"}") == 1);
  const double to_d1 = series(rm, routed("decode-1/decode"));
  std::vector<streamed> more(8);
  {
    std::vector<std::thread> ws;
    for (size_t i = 0; i < more.size(); ++i) ws.emplace_back([&, i] { more[i] = stream(router, prompts[i % 5], 16); });
    for (auto& t : ws) t.join();
  }
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < streams.size(); ++i) {
    INFO("stream " << i << ": " << streams[i].status << " " << streams[i].body.substr(streams[i].body.size() > 600 ? streams[i].body.size() - 600 : 0));
    CHECK(streams[i].ok());
  }
  for (size_t i = 0; i < more.size(); ++i) {
    INFO("request during the drain " << i << ": " << more[i].status << " " << more[i].body);
    CHECK(more[i].ok());
  }
  rm = test::get(router, "/metrics").body;
  CHECK(series(rm, routed("decode-1/decode")) == to_d1);
  CHECK(!(series(rm, "tandem_requests_finished_total{reason=\"error\"}") > 0));  // absent or 0

  // Drained: readiness says so (503 "drained"), the metric and inspect too.
  auto m = poll_metrics(c.node("decode-1").http,
                        [](const std::string& t) { return series(t, "tandem_node_drain_state{node=\"decode-1\"}") == 2; });
  INFO("decode-1 metrics:\n" << m);
  REQUIRE(series(m, "tandem_node_drain_state{node=\"decode-1\"}") == 2);
  CHECK(series(m, "tandem_node_ready{node=\"decode-1\"}") == 0);
  auto ready = test::get(c.node("decode-1").http, "/health/ready");
  CHECK(ready.status == 503);
  CHECK(json::parse(ready.body).find("status")->s == "drained");
  auto report = inspect(c.node("decode-1").admin);
  INFO("inspect: " << report);
  CHECK(report.find("\"state\":\"drained\"") != std::string::npos);

  // Stopped and started again (a rolling restart): the router routes to it again.
  c.kill("decode-1");
  c.restart("decode-1");
  rm = wait_routable(router);
  REQUIRE(series(rm, "tandem_router_live_targets{role=\"decode\"}") == 2);
  CHECK(series(rm, "tandem_router_target_draining{target=\"decode-1/decode\"}") == 0);
  for (int i = 0; i < 6; ++i) {
    auto r = complete_greedy(router, prompts[i % 5], 16);
    INFO("after the restart " << i << ": " << r.raw);
    CHECK(r.status == 200);
  }
  CHECK(series(test::get(router, "/metrics").body, routed("decode-1/decode")) >= to_d1 + 2);
}

TEST_CASE("drain: a decode node restarted under load fails no request") {
  temp_dir dir;
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  node_cluster c(dir.path, head(model), nodes());
  INFO(c.logs());
  const uint16_t router = c.node("router").http;
  REQUIRE(series(wait_routable(router), "tandem_router_live_targets{role=\"decode\"}") == 2);

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0};
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  for (int k = 0; k < 8; ++k)
    clients.emplace_back([&, k] {
      for (int i = 0; !stop; ++i) {
        auto r = stream(router, prompts[(k + i) % 5], 48);
        if (r.ok()) ++ok;
        else {
          std::lock_guard lk(mu);
          failures.push_back(std::to_string(r.status) + " " + r.body.substr(r.body.size() > 600 ? r.body.size() - 600 : 0));
        }
      }
    });
  poll_metrics(c.node("decode-1").http, [](const std::string& m) { return series(m, "tandem_decode_running_requests") >= 1; });
  c.kill("decode-1");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // load goes on meanwhile: it is the point
  const double before = series(test::get(router, "/metrics").body, routed("decode-1/decode"));
  c.restart("decode-1");
  // Load goes on until the restarted node has served requests again.
  auto rm = poll_metrics(router, [&](const std::string& m) { return series(m, routed("decode-1/decode")) >= before + 8; },
                         std::chrono::seconds(30));
  stop = true;
  for (auto& t : clients) t.join();
  INFO("router metrics:\n" << rm);
  CHECK(series(rm, routed("decode-1/decode")) >= before + 8);
  std::lock_guard lk(mu);
  std::string all;
  for (const auto& f : failures) all += f + "\n";
  INFO("failed requests:\n" << all);
  CHECK(failures.empty());
  CHECK(ok > 16);
  MESSAGE("decode node restarted under load: " << ok.load() << " requests, " << failures.size() << " failed");
}

TEST_CASE("drain: handoffs parked for decode pages end at node-down when their prefill node dies") {
  temp_dir dir;
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  // A decode pool of a few long prompts: the handoffs beyond it wait for pages (parked), their
  // KV on the prefill node, while the first ones decode slowly.
  pd_options o;
  o.policy = "recompute";
  o.kv_cache_mb = 6;
  o.extra_limits = "decode_page_admission = false\nmax_decode_waiting_seqs = -1\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  std::string prompt;
  for (int i = 0; i < 40; ++i) prompt += "the cat sat on ";
  std::vector<streamed> got(5);
  std::vector<clk::time_point> ended(got.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < got.size(); ++i)
    ts.emplace_back([&, i] {
      got[i] = stream(pd.router().http, prompt, 60);
      ended[i] = clk::now();
    });
  auto dm = poll_metrics(pd.decode().http,
                         [](const std::string& m) { return series(m, "tandem_decode_kv_page_waiting_requests") >= 1; });
  INFO("decode metrics:\n" << dm);
  REQUIRE(series(dm, "tandem_decode_kv_page_waiting_requests") >= 1);
  ::kill(pd.prefill().proc->pid(), SIGKILL);
  const auto killed_at = clk::now();
  dm = poll_metrics(pd.decode().http,
                    [](const std::string& m) { return series(m, "tandem_decode_kv_page_waiting_requests") == 0; });
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(clk::now() - killed_at).count();
  CHECK(series(dm, "tandem_decode_kv_page_waiting_requests") == 0);
  for (auto& t : ts) t.join();
  int64_t last_failed_ms = 0;
  int failed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("request " << i << ": " << got[i].status << " " << got[i].body.substr(got[i].body.size() > 400 ? got[i].body.size() - 400 : 0));
    if (got[i].ok()) continue;  // its KV was on the decode node already: it finished
    ++failed;
    last_failed_ms = std::max<int64_t>(
        last_failed_ms, std::chrono::duration_cast<std::chrono::milliseconds>(ended[i] - killed_at).count());
  }
  MESSAGE("prefill node killed with handoffs parked: parked ones gone after " << took << " ms, " << failed
                                                                                << " requests ended, the last "
                                                                                << last_failed_ms << " ms after the kill");
  CHECK(failed >= 1);
  CHECK(took <= 1000);            // node-down, not the end of a decoding sequence (seconds here)
  CHECK(last_failed_ms <= 1500);  // and the client hears it then
}
