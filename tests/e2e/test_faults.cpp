// Process-level faults of a PD cluster (router, prefill and decode as three `tandem serve`
// processes on loopback): kill -9 of a node, SIGSTOP/SIGCONT past the deadlines, a slow SSE
// reader, a worker that crashes at start. Each is followed by the invariants of issue 8:
// every accepted request ends with exactly one completion or one explicit error; every
// surviving node's pool is whole again (free pages at their start value, no transfer live or
// quarantined); completed outputs equal the fault-free run; no process but the one killed dies.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;
using clk = std::chrono::steady_clock;

namespace {

/// One streamed request as the client saw it.
struct stream_result {
  int status = 0;              ///< HTTP status (0: no response)
  std::string text;            ///< the completion text of the data events
  int finishes = 0;            ///< chunks with a finish_reason (a completion)
  int errors = 0;              ///< in-band error events
  int dones = 0;               ///< `data: [DONE]`
  bool framing_ok = false;
  std::string error_message;   ///< of the in-band error, or the error body of a refusal
  std::string raw;
  std::string client_error;    ///< why the client's socket calls stopped, if not a complete response
  clk::time_point sent{}, first_byte{}, end{};
  /// Exactly one completion or one explicit error.
  bool ended_once() const {
    if (status != 200) return status >= 400 && !error_message.empty();
    return framing_ok && dones == 1 && finishes + errors == 1;
  }
};

/// Streams `prompt` from `port` to the end; `started` counts the streams whose first event
/// arrived (or that ended before one).
stream_result stream(uint16_t port, const std::string& prompt, int32_t max_tokens,
                     std::atomic<int>* started = nullptr) {
  stream_result r;
  int fd = test::connect_to(port);
  if (fd < 0) {
    r.client_error = std::string("connect: ") + std::strerror(errno);
    return r;
  }
  timeval tv{30, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  r.sent = clk::now();
  test::send_all(fd, test::request_text("POST", "/v1/completions", body(prompt, max_tokens, true)));
  std::string raw;
  char buf[16384];
  bool counted = false;
  while (!test::response_complete(raw)) {
    ssize_t n = test::recv_some(fd, buf, sizeof buf);
    if (n <= 0) {
      r.client_error = n == 0 ? std::string("recv: EOF") : std::string("recv: ") + std::strerror(errno);
      break;
    }
    if (raw.empty()) r.first_byte = clk::now();
    raw.append(buf, static_cast<size_t>(n));
    if (!counted && started && raw.find("data: ") != std::string::npos) {
      counted = true;
      started->fetch_add(1);
    }
  }
  r.end = clk::now();
  ::close(fd);
  if (!counted && started) started->fetch_add(1);  // ended before streaming: counts as started
  r.raw = raw;
  auto resp = test::parse_response(raw);
  r.status = resp.status;
  if (r.status != 200) {
    try {
      auto v = json::parse(resp.body);
      if (auto* e = v.find("error")) r.error_message = e->find("message")->s;
    } catch (const std::exception&) {
    }
    return r;
  }
  auto events = test::sse_events(resp.body, r.framing_ok);
  r.dones = r.framing_ok ? 1 : 0;
  for (const auto& e : events) {
    auto v = json::parse(e);
    if (auto* err = v.find("error")) {
      ++r.errors;
      r.error_message = err->find("message")->s;
      continue;
    }
    const auto& c = v.find("choices")->arr.at(0);
    r.text += c.find("text")->s;
    if (c.find("finish_reason")->k == json::kind::string) ++r.finishes;
  }
  return r;
}

/// SIGSTOPs `pid` and waits until every thread of it is stopped: kill(2) returns before the
/// signal is delivered, and on a loaded machine the process goes on running (serving, sending)
/// for a while. False if it did not stop within 10 s.
bool stop_process(pid_t pid) {
  ::kill(pid, SIGSTOP);
  const auto until = clk::now() + std::chrono::seconds(10);
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  while (clk::now() < until) {
    bool all = true;
    for (const auto& t : std::filesystem::directory_iterator(tasks)) {
      const std::string stat = file_text((t.path() / "stat").string());
      // pid (comm) state ...: comm may hold spaces and parentheses, the state follows the last ')'.
      const auto close = stat.rfind(')');
      if (close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] != 'T') all = false;
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

/// The value of `name{labels}` in a /metrics text (NaN if absent).
double labelled(const std::string& text, const std::string& name, const std::string& labels) {
  return series(text, name + "{" + labels + "}");
}

/// Free pages of a worker node now (its start value once nothing runs).
double free_pages(const node_proc& n) { return series(test::get(n.http, "/metrics").body, "tandem_kv_pages_free"); }

double free_pages_of(uint16_t http) { return series(test::get(http, "/metrics").body, "tandem_kv_pages_free"); }

/// Waits until `n`'s pool is whole again; returns the metrics text.
std::string wait_whole(const node_proc& n, double want) {
  auto m = poll_metrics(n.http, pool_settled(want));
  INFO("node " << n.name << " metrics:\n" << m);
  CHECK(series(m, "tandem_kv_pages_free") == want);
  CHECK(series(m, "tandem_kv_transfer_live") == 0);
  CHECK(series(m, "tandem_kv_transfer_quarantined_pages") == 0);
  CHECK(zero_or_absent(m, "tandem_worker_kv_sends_inflight"));
  CHECK(zero_or_absent(m, "tandem_decode_kv_receiving_requests"));
  return m;
}

/// Waits until the router sees both worker nodes (linked and with fresh credits) and the
/// prefill node reaches the decode node again.
void wait_linked(pd_cluster& pd) {
  auto rm = poll_metrics(pd.router().http, [](const std::string& m) {
    return labelled(m, "tandem_remote_node_up", "role=\"decode\",peer=\"decode-0\"") == 1 &&
           labelled(m, "tandem_remote_node_up", "role=\"prefill\",peer=\"prefill-0\"") == 1 &&
           labelled(m, "tandem_router_target_healthy", "target=\"decode-0/decode\"") == 1 &&
           labelled(m, "tandem_router_target_healthy", "target=\"prefill-0/prefill\"") == 1;
  });
  INFO("router metrics:\n" << rm);
  REQUIRE(labelled(rm, "tandem_router_target_healthy", "target=\"decode-0/decode\"") == 1);
  REQUIRE(labelled(rm, "tandem_router_target_healthy", "target=\"prefill-0/prefill\"") == 1);
  auto pm = poll_metrics(pd.prefill().http, [](const std::string& m) {
    return labelled(m, "tandem_remote_node_up", "role=\"decode\",peer=\"decode-0\"") == 1;
  });
  REQUIRE(labelled(pm, "tandem_remote_node_up", "role=\"decode\",peer=\"decode-0\"") == 1);
}

/// The fault-free outputs of `prompts` (greedy, `max_tokens`) from one `tandem serve` process.
std::vector<completion> fault_free(const std::string& model, const std::filesystem::path& dir,
                                   const std::vector<std::string>& prompts, int32_t max_tokens) {
  server single(model, (dir / "single.log").string());
  std::vector<completion> want;
  for (const auto& p : prompts) {
    want.push_back(complete(single.http_port, p, max_tokens));
    REQUIRE(want.back().status == 200);
  }
  return want;
}

/// The cluster serves `prompts` with the fault-free outputs again.
void serves_fault_free(pd_cluster& pd, const std::vector<std::string>& prompts, const std::vector<completion>& want,
                       int32_t max_tokens) {
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto got = complete(pd.router().http, prompts[i], max_tokens);
    INFO("prompt " << i << ": " << got.raw);
    CHECK(got.status == 200);
    CHECK(got.text == want[i].text);
  }
}

std::string r15m() {
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  return model;
}

}  // namespace

TEST_CASE("faults: kill -9 of the decode node with 50 streams ends every one with an explicit error within 2 heartbeats") {
  temp_dir dir;
  const std::string model = r15m();
  // Small, but credits of a prefill node busy with 50 prompts stay fresh (stale after 3).
  const int32_t heartbeat_ms = 500;
  const auto want = fault_free(model, dir.path, pd_prompts, 16);
  pd_options o;
  o.extra_limits = "router_heartbeat_ms = " + std::to_string(heartbeat_ms) + "\n";
  o.kv_cache_mb = 64;
  o.max_running_seqs = 16;
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  const double free_p = free_pages(pd.prefill());

  // 50 streams, long enough that every one is still running when the node dies.
  const int n = 50;
  std::vector<stream_result> got(n);
  std::atomic<int> started{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = stream(pd.router().http, pd_prompts[size_t(i) % pd_prompts.size()], 400, &started); });
  auto dm = poll_metrics(pd.decode().http, [&](const std::string& m) {
    return started.load() == n && series(m, "tandem_decode_running_requests") >= 8;
  });
  REQUIRE(started.load() == n);
  REQUIRE(series(dm, "tandem_decode_running_requests") >= 8);
  const auto killed_at = clk::now();
  ::kill(pd.decode().proc->pid(), SIGKILL);
  for (auto& t : ts) t.join();

  int streamed_errors = 0, refused = 0;
  int64_t last_ms = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = got[size_t(i)];
    INFO("stream " << i << ": " << r.raw);
    CHECK(r.ended_once());
    // Migration is off: nothing completes after the kill, each ends with an error naming decode
    // (a refusal before the kill, on a slow machine, is an explicit error of its own).
    CHECK(r.finishes == 0);
    if (r.end >= killed_at) CHECK(r.error_message.find("decode") != std::string::npos);
    if (r.status == 200) ++streamed_errors;
    else {
      CHECK(r.status >= 500);
      ++refused;
    }
    last_ms = std::max<int64_t>(last_ms, std::chrono::duration_cast<std::chrono::milliseconds>(r.end - killed_at).count());
  }
  MESSAGE("kill -9 of decode: " << streamed_errors << " streams ended in-band, " << refused
                                << " with an error status; last end " << last_ms << " ms after the kill (2 heartbeats = "
                                << 2 * heartbeat_ms << " ms)");
  CHECK(streamed_errors >= 8);
  CHECK(last_ms <= 2 * heartbeat_ms);

  // Survivors: alive, the prefill pool whole.
  CHECK(pd_cluster::alive(pd.router()));
  CHECK(pd_cluster::alive(pd.prefill()));
  wait_whole(pd.prefill(), free_p);

  // The decode node comes back: the others dial it again and the cluster serves the
  // fault-free outputs.
  pd.restart(pd.decode(), {});
  wait_linked(pd);
  const double free_d = free_pages(pd.decode());
  serves_fault_free(pd, pd_prompts, want, 16);
  wait_whole(pd.prefill(), free_p);
  wait_whole(pd.decode(), free_d);
  CHECK(pd_cluster::alive(pd.router()));
  CHECK(pd_cluster::alive(pd.prefill()));
  CHECK(pd_cluster::alive(pd.decode()));
}

TEST_CASE("faults: kill -9 of one of two decode nodes with 50 streams and migration on: every stream continues with the fault-free text") {
  temp_dir dir;
  const std::string model = r15m();
  const int32_t heartbeat_ms = 500, max_tokens = 160;
  const auto want = fault_free(model, dir.path, pd_prompts, max_tokens);
  // One prefill and two decode nodes, round robin: about half of the streams decode on
  // decode-1. Pools and batches large enough that decode-0 takes all 50 after the kill.
  std::string head = cluster_config_head(model, "fail", false, "round_robin");
  const std::string small = "kv_cache_mb = 16\nmax_running_seqs = 8\n";
  REQUIRE(head.find(small) != std::string::npos);
  head.replace(head.find(small), small.size(),
               "kv_cache_mb = 192\nmax_running_seqs = 64\nrouter_heartbeat_ms = " + std::to_string(heartbeat_ms) + "\n");
  node_cluster c(dir.path, head,
                 {{"router", {"router"}, {}},
                  {"prefill-0", {"prefill", "cache", "worker"}, {}},
                  {"decode-0", {"decode", "cache", "worker"}, {}},
                  {"decode-1", {"decode", "cache", "worker"}, {}}});
  INFO(c.logs());
  const uint16_t router = c.node("router").http;
  const double free_p = free_pages_of(c.node("prefill-0").http), free_d0 = free_pages_of(c.node("decode-0").http);

  const int n = 50;
  std::vector<stream_result> got(n);
  std::atomic<int> started{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = stream(router, pd_prompts[size_t(i) % pd_prompts.size()], max_tokens, &started); });
  auto dm = poll_metrics(c.node("decode-1").http, [&](const std::string& m) {
    return started.load() == n && series(m, "tandem_decode_running_requests") >= 8;
  });
  REQUIRE(started.load() == n);
  const double held = series(dm, "tandem_decode_running_requests");
  REQUIRE(held >= 8);
  c.kill("decode-1");
  for (auto& t : ts) t.join();

  // Every stream completes once, with the text of the fault-free run: the tokens streamed
  // before the kill plus the ones decode-0 made after it, none lost, none repeated.
  int ok = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = got[size_t(i)];
    INFO("stream " << i << ": " << r.raw);
    CHECK(r.ended_once());
    CHECK(r.status == 200);
    CHECK(r.errors == 0);
    CHECK(r.finishes == 1);
    CHECK(r.text == want[size_t(i) % want.size()].text);
    ok += r.status == 200 && r.errors == 0 && r.text == want[size_t(i) % want.size()].text;
  }
  auto rm = poll_metrics(router, [](const std::string& m) { return series(m, "tandem_requests_inflight") == 0; });
  const double migrations = series(rm, "tandem_router_migrations_total");
  MESSAGE("kill -9 of decode-1 holding " << held << " of 50 streams: " << ok << " streams ended with the fault-free text, "
                                         << migrations << " migrations");
  CHECK(migrations >= held);
  CHECK(series(rm, "tandem_router_migration_failures_total{reason=\"no_target\"}") == 0);
  CHECK(series(rm, "tandem_requests_inflight") == 0);
  // Survivors: alive, pools whole (every page back, nothing live or quarantined).
  CHECK(c.node("router").proc->wait(std::chrono::milliseconds(0)) == -1);
  CHECK(c.node("prefill-0").proc->wait(std::chrono::milliseconds(0)) == -1);
  CHECK(c.node("decode-0").proc->wait(std::chrono::milliseconds(0)) == -1);
  for (auto [name, want_free] : {std::pair<const char*, double>{"prefill-0", free_p}, {"decode-0", free_d0}}) {
    auto m = poll_metrics(c.node(name).http, pool_settled(want_free));
    INFO(name << " metrics:\n" << m);
    CHECK(series(m, "tandem_kv_pages_free") == want_free);
    CHECK(series(m, "tandem_kv_transfer_live") == 0);
    CHECK(series(m, "tandem_kv_transfer_quarantined_pages") == 0);
  }
}

TEST_CASE("faults: kill -9 of the prefill node mid-transfer ends the transferring requests with an error and the decode pool is whole") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const auto want = fault_free(model, dir.path, pd_prompts, 16);
  pd_options o;
  o.policy = "recompute";
  // Every put waits 3 s: the transfers are in flight (decode holds their destination pages)
  // when the prefill node dies.
  o.prefill_env = {{"TANDEM_KV_FAULT", "put:delay:3000"}};
  o.extra_limits = "router_heartbeat_ms = 250\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  const double free_d = free_pages(pd.decode());
  const int n = 6;
  std::vector<stream_result> got(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = stream(pd.router().http, pd_prompts[size_t(i) % pd_prompts.size()], 16); });
  auto dm = poll_metrics(pd.decode().http, [&](const std::string& m) {
    return series(m, "tandem_decode_kv_receiving_requests") == n && series(m, "tandem_kv_transfer_live") == n;
  });
  REQUIRE(series(dm, "tandem_decode_kv_receiving_requests") == n);
  REQUIRE(series(dm, "tandem_kv_transfer_live") == n);
  const auto killed_at = clk::now();
  ::kill(pd.prefill().proc->pid(), SIGKILL);
  for (auto& t : ts) t.join();
  int64_t last_ms = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = got[size_t(i)];
    INFO("stream " << i << ": " << r.raw);
    CHECK(r.ended_once());
    CHECK(r.finishes == 0);
    CHECK(r.errors + (r.status != 200 ? 1 : 0) == 1);
    CHECK(r.error_message.find("prefill") != std::string::npos);
    last_ms = std::max<int64_t>(last_ms, std::chrono::duration_cast<std::chrono::milliseconds>(r.end - killed_at).count());
  }
  MESSAGE("kill -9 of prefill mid-transfer: " << n << " transfers in flight, last request ended " << last_ms
                                              << " ms after the kill");
  // Ended by the failure's detection, not by the delayed puts (3 s) or a deadline.
  CHECK(last_ms < 3000);
  // The decode node let go of every destination page: nothing live, nothing quarantined.
  auto m = wait_whole(pd.decode(), free_d);
  CHECK(series(m, "tandem_decode_kv_receive_failures_total") == n);
  CHECK(pd_cluster::alive(pd.router()));
  CHECK(pd_cluster::alive(pd.decode()));

  // The prefill node comes back (without the fault): the cluster serves the fault-free outputs.
  pd.restart(pd.prefill(), {});
  wait_linked(pd);
  const double free_p = free_pages(pd.prefill());
  serves_fault_free(pd, pd_prompts, want, 16);
  wait_whole(pd.prefill(), free_p);
  wait_whole(pd.decode(), free_d);
  CHECK(pd_cluster::alive(pd.router()));
  CHECK(pd_cluster::alive(pd.decode()));
}

TEST_CASE("faults: SIGSTOP of the decode node ends its requests within 2 heartbeats of silence, SIGCONT recovers") {
  temp_dir dir;
  const std::string model = r15m();
  const int32_t deadline_ms = 2500;
  const auto want = fault_free(model, dir.path, pd_prompts, 16);
  pd_options o;
  o.extra_limits = "router_heartbeat_ms = 250\nrequest_timeout_ms = " + std::to_string(deadline_ms) + "\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  const double free_p = free_pages(pd.prefill()), free_d = free_pages(pd.decode());
  const int n = 6;
  std::vector<stream_result> got(n);
  std::atomic<int> started{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = stream(pd.router().http, pd_prompts[size_t(i) % pd_prompts.size()], 400, &started); });
  poll_metrics(pd.decode().http, [&](const std::string& m) {
    return started.load() == n && series(m, "tandem_decode_running_requests") >= 1;
  });
  REQUIRE(started.load() == n);
  REQUIRE(stop_process(pd.decode().proc->pid()));
  const auto stopped_at = clk::now();
  for (auto& t : ts) t.join();
  const auto all_ended = clk::now();
  int64_t worst_ms = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = got[size_t(i)];
    INFO("stream " << i << ": " << r.raw);
    CHECK(r.ended_once());
    CHECK(r.finishes == 0);
    // The router loses a target that is silent for 1.5 heartbeats with requests there (with
    // one decode node there is nowhere to migrate), well before the 2.5 s deadline.
    CHECK(r.error_message.find("stopped answering") != std::string::npos);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(r.end - stopped_at).count();
    worst_ms = std::max<int64_t>(worst_ms, took);
    CHECK(took <= 2 * 250 + 250);  // 2 heartbeats, plus the tick and a loaded machine's slack
  }
  // New requests while the node is stopped get an explicit error too (its credits go stale).
  auto during = complete(pd.router().http, pd_prompts[0], 4);
  INFO(during.raw);
  CHECK(during.status >= 500);
  CHECK(clk::now() - stopped_at < std::chrono::seconds(10));
  MESSAGE("SIGSTOP of decode: " << n << " requests ended " << worst_ms << " ms after the stop at the latest (heartbeat "
                                << 250 << " ms, deadline " << deadline_ms << " ms), all within "
                                << std::chrono::duration_cast<std::chrono::milliseconds>(all_ended - stopped_at).count()
                                << " ms of the stop; a new request got " << during.status);
  ::kill(pd.decode().proc->pid(), SIGCONT);
  // The node catches up: its requests end (past their deadline), every page comes back, the
  // router sees fresh credits and the cluster serves the fault-free outputs.
  wait_whole(pd.decode(), free_d);
  wait_whole(pd.prefill(), free_p);
  wait_linked(pd);
  serves_fault_free(pd, pd_prompts, want, 16);
  wait_whole(pd.decode(), free_d);
  wait_whole(pd.prefill(), free_p);
  for (auto& node : pd.nodes) CHECK(pd_cluster::alive(node));
}

TEST_CASE("faults: SIGSTOP of the prefill node ends the requests sent to it by their deadline, SIGCONT recovers") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const int32_t deadline_ms = 1500;
  const auto want = fault_free(model, dir.path, pd_prompts, 16);
  pd_options o;
  // Credits go stale after 3 heartbeats (6 s) and a silent target is lost after 1.5 (3 s):
  // later than the deadline, so the requests are accepted and end by their deadline.
  o.extra_limits = "router_heartbeat_ms = 2000\nrequest_timeout_ms = " + std::to_string(deadline_ms) + "\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  const double free_p = free_pages(pd.prefill()), free_d = free_pages(pd.decode());
  REQUIRE(stop_process(pd.prefill().proc->pid()));
  const int n = 4;
  std::vector<stream_result> got(n);
  std::vector<std::thread> ts;
  for (int i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = stream(pd.router().http, pd_prompts[size_t(i)], 16); });
  for (auto& t : ts) t.join();
  int64_t worst_ms = 0;
  for (int i = 0; i < n; ++i) {
    const auto& r = got[size_t(i)];
    INFO("stream " << i << ": " << r.raw << " (client: " << r.client_error << ")");
    CHECK(r.ended_once());
    CHECK(r.status == 504);  // nothing streamed yet: the timeout is the response's status
    CHECK(r.error_message.find("request_timeout_ms = 1500") != std::string::npos);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(r.end - r.sent).count();
    worst_ms = std::max<int64_t>(worst_ms, took);
    CHECK(took >= deadline_ms - 50);
    CHECK(took <= deadline_ms + 1000);
  }
  MESSAGE("SIGSTOP of prefill: " << n << " requests ended with 504 by " << worst_ms << " ms (deadline " << deadline_ms
                                 << " ms)");
  ::kill(pd.prefill().proc->pid(), SIGCONT);
  wait_whole(pd.prefill(), free_p);
  wait_whole(pd.decode(), free_d);
  wait_linked(pd);
  serves_fault_free(pd, pd_prompts, want, 16);
  wait_whole(pd.prefill(), free_p);
  wait_whole(pd.decode(), free_d);
  for (auto& node : pd.nodes) CHECK(pd_cluster::alive(node));
}

TEST_CASE("faults: a worker that crashes at start is restarted up to the restart budget, then the node exits and reports") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::string log = (dir.path / "serve.log").string();
  child proc({TANDEM_BINARY, "serve", "--model", model, "--port", "0", "--rpc-port", "0", "--log-level", "info"},
             {{"TANDEM_WORKER_FAULT", "start"}}, log);
  const int rc = proc.wait(std::chrono::seconds(30));
  const std::string text = file_text(log);
  INFO(text);
  CHECK(rc == 1);
  // Three restarts (limits.supervisor_max_restarts = 3), each logged, then the report.
  size_t restarts = 0;
  for (size_t p = text.find("restarting the node's actors"); p != std::string::npos;
       p = text.find("restarting the node's actors", p + 1))
    ++restarts;
  CHECK(restarts == 3);
  CHECK(text.find("tandem serve: error (failed): node local is unhealthy: actor worker failed") != std::string::npos);
  CHECK(text.find("failed at start (injected: TANDEM_WORKER_FAULT=start)") != std::string::npos);
  CHECK(text.find("after 3 restart(s) within 60000 ms (limits.supervisor_max_restarts = 3)") != std::string::npos);
}

TEST_CASE("faults: an SSE client that stops reading is cut off at the backlog bound while the other streams complete") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::vector<std::string> prompts(pd_prompts.begin(), pd_prompts.begin() + 4);
  const auto want = fault_free(model, dir.path, prompts, 64);
  pd_options o;
  o.extra_limits = "http_stream_backlog_tokens = 32\nhttp_stream_socket_bytes = 4096\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  const double free_p = free_pages(pd.prefill()), free_d = free_pages(pd.decode());

  // The slow reader: a small receive buffer, the head of the stream read, then nothing. Its
  // ~480 events (about 200 bytes each) do not fit the two sockets' buffers.
  int slow = ::socket(AF_INET, SOCK_STREAM, 0);
  int small = 2048;
  ::setsockopt(slow, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  timeval tv{30, 0};
  ::setsockopt(slow, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(pd.router().http);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(slow, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  test::send_all(slow, test::request_text("POST", "/v1/completions", body("a slow reader", 480, true)));
  std::string head;
  char buf[512];
  while (head.find("data: ") == std::string::npos) {
    ssize_t n = test::recv_some(slow, buf, sizeof buf);
    REQUIRE(n > 0);
    head.append(buf, static_cast<size_t>(n));
  }
  REQUIRE(head.rfind("HTTP/1.1 200", 0) == 0);

  // Meanwhile the others stream to the end with the fault-free text.
  std::vector<stream_result> got(prompts.size());
  std::vector<std::thread> ts;
  for (size_t i = 0; i < prompts.size(); ++i) ts.emplace_back([&, i] { got[i] = stream(pd.router().http, prompts[i], 64); });
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    INFO("stream " << i << ": " << got[i].raw);
    CHECK(got[i].ended_once());
    CHECK(got[i].finishes == 1);
    CHECK(got[i].text == want[i].text);
  }
  // The slow stream's backlog hit the bound: the request was aborted (the router's table
  // empties, every page returns) and the connection closed.
  auto rm = poll_metrics(pd.router().http, [](const std::string& m) {
    return series(m, "tandem_http_stream_backlog_aborts_total") == 1 && series(m, "tandem_requests_inflight") == 0;
  });
  INFO("router metrics:\n" << rm);
  CHECK(series(rm, "tandem_http_stream_backlog_aborts_total") == 1);
  CHECK(series(rm, "tandem_requests_inflight") == 0);
  CHECK(labelled(rm, "tandem_requests_finished_total", "reason=\"abort\"") == 1);
  wait_whole(pd.prefill(), free_p);
  wait_whole(pd.decode(), free_d);
  // Reading on, the slow client gets what the sockets held, then the end: no [DONE].
  std::string rest = head;
  while (true) {
    ssize_t n = test::recv_some(slow, buf, sizeof buf);
    if (n <= 0) break;
    rest.append(buf, static_cast<size_t>(n));
  }
  ::close(slow);
  CHECK(rest.find("data: [DONE]") == std::string::npos);
  CHECK_FALSE(test::response_complete(rest));
  MESSAGE("slow SSE reader: cut off after " << rest.size() << " bytes (bound: 32 tokens waiting)");
  for (auto& node : pd.nodes) CHECK(pd_cluster::alive(node));
}
