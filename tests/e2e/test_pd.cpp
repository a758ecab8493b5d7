// Prefill/decode disaggregation across processes: a router node, a prefill node and a decode
// node (`tandem serve --config pd.toml --node NAME`, three processes on loopback) linked by
// CAF's middleman, the KV pages moving over UCX. Checked against the single-process server.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "tests/e2e/metrics_doc.h"
#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {
const auto& prompts = pd_prompts;
}  // namespace

TEST_CASE("pd: router, prefill and decode processes give the single-process greedy output byte for byte") {
  temp_dir dir;
  // The shared r15m model: its output depends on every position's KV, so a page that did not
  // arrive (or arrived in the wrong place) changes the text; the micro model's barely does.
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  server single(model, (dir.path / "single.log").string());
  std::vector<completion> want;
  for (const auto& p : prompts) want.push_back(complete(single.http_port, p, 24));
  pd_cluster pd(model, dir.path, "fail", true);
  INFO(pd.logs());
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto got = complete(pd.router().http, prompts[i], 24);
    INFO("prompt " << i << ": " << got.raw);
    REQUIRE(got.status == 200);
    CHECK(got.text == want[i].text);
    CHECK(got.finish_reason == want[i].finish_reason);
  }
  // Log-probabilities cross the nodes with their tokens (the first from the prefill node, the
  // rest from the decode node) and equal the single process's.
  {
    json::writer w;
    w.begin_object().key("prompt").str(prompts[0]).key("max_tokens").num(6).key("temperature").real(0);
    w.key("logprobs").num(2).end_object();
    const std::string lp_body = w.take();
    auto one = test::post(single.http_port, "/v1/completions", lp_body);
    auto split = test::post(pd.router().http, "/v1/completions", lp_body);
    INFO(one.body << "\n" << split.body);
    REQUIRE(one.status == 200);
    REQUIRE(split.status == 200);
    auto lp = [](const std::string& b) { return *json::parse(b).find("choices")->arr.at(0).find("logprobs"); };
    const json::value a = lp(one.body), b = lp(split.body);
    REQUIRE(a.find("tokens")->arr.size() == 6);
    REQUIRE(b.find("tokens")->arr.size() == 6);
    for (size_t i = 0; i < 6; ++i) {
      CHECK(a.find("tokens")->arr[i].s == b.find("tokens")->arr[i].s);
      CHECK(a.find("token_logprobs")->arr[i].num == doctest::Approx(b.find("token_logprobs")->arr[i].num).epsilon(1e-4));
      CHECK(b.find("top_logprobs")->arr[i].obj.size() >= 1);
    }
  }
  // n = 3 across nodes: one prefill and one KV transfer, three greedy choices on the decode node
  // (forks sharing the received pages), each the single process's text.
  {
    json::writer w;
    w.begin_object().key("prompt").str(prompts[0]).key("max_tokens").num(24).key("temperature").real(0);
    w.key("n").num(3).end_object();
    auto r = test::post(pd.router().http, "/v1/completions", w.take());
    INFO(r.body);
    REQUIRE(r.status == 200);
    const json::value v = json::parse(r.body);
    const auto& ch = v.find("choices")->arr;
    REQUIRE(ch.size() == 3);
    for (size_t k = 0; k < 3; ++k) {
      CHECK(ch[k].find("index")->i == int64_t(k));
      CHECK(ch[k].find("text")->s == want[0].text);
    }
    CHECK(series(test::get(pd.decode().http, "/metrics").body, "tandem_decode_forks_total") == 2);
  }
  // Concurrent: the same prompts, three times over, all at once (batched on both sides).
  std::vector<completion> got(prompts.size() * 3);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < got.size(); ++i)
    ts.emplace_back([&, i] { got[i] = complete(pd.router().http, prompts[i % prompts.size()], 24); });
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("concurrent request " << i << ": " << got[i].raw);
    CHECK(got[i].status == 200);
    CHECK(got[i].text == want[i % prompts.size()].text);
  }
  // The router-only node allocates no KV pool and its log says so; the others log theirs.
  for (auto& node : pd.nodes) {
    const std::string log = file_text(node.log);
    INFO("node " << node.name << ":\n" << log);
    if (node.name == "router") {
      CHECK(log.find("no KV pool on this node") != std::string::npos);
      CHECK(log.find("KV pages of") == std::string::npos);
    } else {
      CHECK(log.find("KV pages of") != std::string::npos);
    }
  }
  // The KV really crossed: every request's pages were sent by prefill and received by decode.
  const auto n = double(prompts.size() * 4 + 2);  // + the logprobs and the n = 3 requests
  auto pm = test::get(pd.prefill().http, "/metrics").body;
  auto dm = test::get(pd.decode().http, "/metrics").body;
  CHECK(series(pm, "tandem_worker_kv_sends_total") == n);
  CHECK(series(dm, "tandem_decode_kv_receives_total") == n);
  CHECK(series(dm, "tandem_kv_transfer_done_total") == n);
  // docs/metrics.md both ways: what the nodes render is documented; every `pd node` row is
  // rendered by at least one of them.
  auto docs = documented_metrics();
  std::set<std::string> seen;
  for (auto& n : pd.nodes) {
    for (const auto& [name, type] : rendered_metrics(test::get(n.http, "/metrics").body)) {
      INFO("node " << n.name << " renders " << name << " (" << type << ")");
      seen.insert(name);
      auto d = docs.find(name);
      CHECK_MESSAGE(d != docs.end(), "add it to docs/metrics.md");
      if (d != docs.end()) CHECK(d->second.type == type);
    }
  }
  for (const auto& [name, row] : docs) {
    if (row.rendered != "pd node") continue;
    INFO("documented pd node metric " << name);
    CHECK(seen.count(name) == 1);
  }
  // A node without the router refuses requests and names the router node.
  auto r = test::post(pd.decode().http, "/v1/completions", body("hi", 4));
  CHECK(r.status != 200);
  CHECK(r.body.find("send requests to node router") != std::string::npos);
}

TEST_CASE("pd: 200 requests aborted at random points leave every node's KV pool as it started") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  pd_cluster pd(model, dir.path, "recompute", false);
  INFO(pd.logs());
  auto start_p = test::get(pd.prefill().http, "/metrics").body;
  auto start_d = test::get(pd.decode().http, "/metrics").body;
  const double free_p = series(start_p, "tandem_kv_pages_free"), free_d = series(start_d, "tandem_kv_pages_free");
  REQUIRE(free_p > 0);
  REQUIRE(free_d > 0);

  // Each request streams and the client hangs up after a seeded number of bytes of the
  // response: 0 (queued or mid-prefill), a few (around the first token: mid-transfer) or more
  // (mid-decode). Some finish before the hang-up point: those end normally.
  std::mt19937 rng(20261203);
  struct plan {
    std::string prompt;
    int32_t max_tokens;
    size_t hangup_after;
  };
  std::vector<plan> plans;
  for (int i = 0; i < 200; ++i) {
    std::string p;
    const int words = std::uniform_int_distribution<int>(1, 60)(rng);
    for (int w = 0; w < words; ++w) p += "w" + std::to_string(std::uniform_int_distribution<int>(0, 99)(rng)) + " ";
    const int where = std::uniform_int_distribution<int>(0, 3)(rng);
    size_t after = where == 0 ? 0 : where == 1 ? std::uniform_int_distribution<size_t>(1, 200)(rng)
                                               : std::uniform_int_distribution<size_t>(200, 2000)(rng);
    plans.push_back({p, std::uniform_int_distribution<int32_t>(1, 48)(rng), after});
  }
  std::atomic<size_t> next{0};
  std::atomic<int> hung_up{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 12; ++t)
    ts.emplace_back([&] {
      for (size_t i = next++; i < plans.size(); i = next++) {
        const auto& pl = plans[i];
        int fd = test::connect_to(pd.router().http);
        if (fd < 0) continue;
        test::send_all(fd, test::request_text("POST", "/v1/completions", body(pl.prompt, pl.max_tokens, true)));
        size_t got = 0;
        char buf[4096];
        bool closed_early = true;
        while (got < pl.hangup_after) {
          ssize_t n = test::recv_some(fd, buf, std::min(sizeof buf, pl.hangup_after - got));
          if (n <= 0) {
            closed_early = false;
            break;
          }
          got += static_cast<size_t>(n);
          if (std::string(buf, static_cast<size_t>(n)).find("0\r\n\r\n") != std::string::npos) {
            closed_early = false;
            break;
          }
        }
        if (closed_early) ++hung_up;
        ::close(fd);
      }
    });
  for (auto& t : ts) t.join();
  CHECK(hung_up > 100);

  // Every request ends (the router's table empties), then every pool is whole again and no
  // transfer holds pages.
  auto rm = poll_metrics(pd.router().http, [](const std::string& m) {
    return series(m, "tandem_requests_inflight") == 0;
  });
  INFO("router metrics:\n" << rm);
  auto pm = poll_metrics(pd.prefill().http, pool_settled(free_p));
  auto dm = poll_metrics(pd.decode().http, pool_settled(free_d));
  INFO("prefill metrics:\n" << pm);
  INFO("decode metrics:\n" << dm);
  CHECK(series(pm, "tandem_kv_pages_free") == free_p);
  CHECK(series(dm, "tandem_kv_pages_free") == free_d);
  CHECK(series(pm, "tandem_kv_transfer_live") == 0);
  CHECK(series(dm, "tandem_kv_transfer_live") == 0);
  CHECK(series(pm, "tandem_worker_kv_sends_inflight") == 0);
  CHECK(series(dm, "tandem_decode_kv_receiving_requests") == 0);
  CHECK(series(dm, "tandem_kv_transfer_quarantined_pages") == 0);
  MESSAGE("prefill: sends " << series(pm, "tandem_worker_kv_sends_total") << ", send failures " << series(pm, "tandem_worker_kv_send_failures_total") << "; decode: receives " << series(dm, "tandem_decode_kv_receives_total") << ", receive failures " << series(dm, "tandem_decode_kv_receive_failures_total") << ", hung up " << hung_up.load());
  // The cluster still serves.
  auto ok = complete(pd.router().http, "still alive", 8);
  INFO(ok.raw);
  CHECK(ok.status == 200);
}

TEST_CASE("pd: a failed KV transfer is recomputed or failed as transfer.failure_policy says") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server single(model, (dir.path / "single.log").string());
  const auto want = complete(single.http_port, prompts[1], 16);
  REQUIRE(want.status == 200);
  SUBCASE("recompute: the request is prefilled again and the output is the same") {
    pd_cluster pd(model, dir.path, "recompute", true, {{"TANDEM_KV_FAULT", "put:fail:1"}});
    INFO(pd.logs());
    auto got = complete(pd.router().http, prompts[1], 16);
    INFO(got.raw);
    REQUIRE(got.status == 200);
    CHECK(got.text == want.text);
    auto dm = test::get(pd.decode().http, "/metrics").body;
    CHECK(series(dm, "tandem_decode_kv_recomputes_total") == 1);
    CHECK(series(dm, "tandem_decode_kv_receive_failures_total") == 1);
  }
  SUBCASE("fail: the client gets an explicit error naming the transfer, the next request works") {
    pd_cluster pd(model, dir.path, "fail", true, {{"TANDEM_KV_FAULT", "put:fail:1"}});
    INFO(pd.logs());
    auto got = complete(pd.router().http, prompts[1], 16);
    INFO(got.raw);
    CHECK(got.status == 502);
    CHECK(got.raw.find("KV transfer of request") != std::string::npos);
    CHECK(got.raw.find("from prefill node prefill-0 to decode node decode-0 failed") != std::string::npos);
    CHECK(got.raw.find("transfer.failure_policy = fail") != std::string::npos);
    auto again = complete(pd.router().http, prompts[1], 16);
    CHECK(again.status == 200);
    CHECK(again.text == want.text);
  }
  SUBCASE("a byte flipped in transit fails the transfer on the manifest's checksum, never decodes on it") {
    pd_cluster pd(model, dir.path, "fail", true, {{"TANDEM_KV_FAULT", "put:flip-pool:0"}});
    INFO(pd.logs());
    auto got = complete(pd.router().http, prompts[1], 16);
    INFO(got.raw);
    CHECK(got.status == 502);
    CHECK(got.raw.find("pool 0 (full): checksum") != std::string::npos);
    auto dm = test::get(pd.decode().http, "/metrics").body;
    CHECK(series(dm, "tandem_kv_transfer_failed_total{reason=\"checksum\"}") == 1);
    CHECK(series(dm, "tandem_kv_transfer_done_total") == 0);
  }
}

TEST_CASE("pd: killing the decode node ends its requests with disconnected and frees the prefill node's pages") {
  temp_dir dir;
  // r15m decodes slowly enough that the requests are still decoding when the node dies.
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  pd_cluster pd(model, dir.path, "fail", false);
  INFO(pd.logs());
  const double free_p = series(test::get(pd.prefill().http, "/metrics").body, "tandem_kv_pages_free");
  std::vector<completion> got(4);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < got.size(); ++i)
    ts.emplace_back([&, i] { got[i] = complete(pd.router().http, prompts[i], 400); });
  auto dm = poll_metrics(pd.decode().http,
                         [](const std::string& m) { return series(m, "tandem_decode_running_requests") >= 1; });
  REQUIRE(series(dm, "tandem_decode_running_requests") >= 1);
  ::kill(pd.decode().proc->pid(), SIGKILL);
  for (auto& t : ts) t.join();
  int ended_by_the_failure = 0;
  for (const auto& c : got) {
    INFO(c.raw);
    if (c.status == 200) continue;  // finished before the node died
    CHECK(c.status == 502);
    CHECK(c.raw.find("decode") != std::string::npos);
    ++ended_by_the_failure;
  }
  CHECK(ended_by_the_failure >= 1);
  // The prefill node let go of every page it was sending to the dead node.
  auto pm = poll_metrics(pd.prefill().http, [&](const std::string& m) {
    return series(m, "tandem_kv_pages_free") == free_p && series(m, "tandem_worker_kv_sends_inflight") == 0;
  });
  INFO("prefill metrics:\n" << pm);
  CHECK(series(pm, "tandem_kv_pages_free") == free_p);
  CHECK(series(pm, "tandem_worker_kv_sends_inflight") == 0);
  // New requests get an explicit error naming the missing role instead of hanging.
  auto after = complete(pd.router().http, prompts[0], 8);
  INFO(after.raw);
  CHECK(after.status == 502);
  CHECK(after.raw.find("no decode node is reachable") != std::string::npos);
}

TEST_CASE("pd: handoffs that find the decode pool full wait for pages instead of failing, and every pool comes back whole") {
  // A small decode pool and long generations: sequences grow until the batch preempts; the
  // preempted ones are prefilled again and handed back while the pool is still full. Those
  // handoffs wait (their KV stays on the prefill node) until a sequence ends, so with
  // transfer.failure_policy = fail every request still completes with the single-process text.
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server single(model, (dir.path / "single.log").string());
  const int32_t n = 6, max_tokens = 120;
  std::vector<completion> want;
  for (int32_t i = 0; i < n; ++i) want.push_back(complete(single.http_port, prompts[size_t(i) % prompts.size()], max_tokens));
  pd_options o;
  o.policy = "fail";
  o.extra_limits = "device_pages = 30\ndecode_page_admission = false\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  auto free_at_start = [&](node_proc& nd) { return series(test::get(nd.http, "/metrics").body, "tandem_kv_pages_free"); };
  const double prefill_free = free_at_start(pd.prefill()), decode_free = free_at_start(pd.decode());
  std::vector<completion> got(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int32_t i = 0; i < n; ++i)
    ts.emplace_back([&, i] { got[size_t(i)] = complete(pd.router().http, prompts[size_t(i) % prompts.size()], max_tokens); });
  for (auto& t : ts) t.join();
  for (int32_t i = 0; i < n; ++i) {
    INFO("request " << i << ": " << got[size_t(i)].raw);
    CHECK(got[size_t(i)].status == 200);
    CHECK(got[size_t(i)].text == want[size_t(i)].text);
  }
  auto dm = test::get(pd.decode().http, "/metrics").body;
  CHECK(series(dm, "tandem_decode_preemptions_total") >= 1);
  CHECK(series(dm, "tandem_decode_kv_handoffs_parked_total") >= 1);
  CHECK(series(dm, "tandem_decode_kv_receive_failures_total") == 0);
  CHECK(series(dm, "tandem_decode_kv_page_waiting_requests") == 0);
  // Pages come back (cached prefixes are evictable: compare free + cached).
  for (int k = 0; k < 100; ++k) {
    if (free_at_start(pd.prefill()) == prefill_free && free_at_start(pd.decode()) == decode_free) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(free_at_start(pd.prefill()) == prefill_free);
  CHECK(free_at_start(pd.decode()) == decode_free);
}
