// Multi-target routing across real nodes: a router, two prefill and two decode nodes as five
// `tandem serve` processes of one config on loopback. The router routes to each node by name
// (`node/role`, the name its credits carry); a prefill node hands its KV pages to the decode
// node the router chose. Checked against the single-process server, then with a decode node
// and then a prefill node SIGKILLed.
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <algorithm>
#include <thread>

#include "tests/e2e/cluster_harness.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

const std::vector<std::string> prompts = {
    "hello world",
    "The quick brown fox jumps over the lazy dog and keeps running across the field until the sun goes down",
    "a",
    "Once upon a time in a land far away there lived a king who had three daughters and a very old dog named "
    "Rex who liked to sleep by the fire every evening after dinner",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
};

const char* const workers[] = {"prefill-0", "prefill-1", "decode-0", "decode-1"};

std::string routed(const std::string& target) {
  return "tandem_router_routed_total{target=\"" + target + "\"}";
}
std::string healthy(const std::string& target) {
  return "tandem_router_target_healthy{target=\"" + target + "\"}";
}

}  // namespace

TEST_CASE("pd multi: two prefill and two decode nodes each serve, byte for byte, and a dead node is routed around") {
  temp_dir dir;
  // The shared r15m model: its output depends on every position's KV, so a page that went to
  // the wrong decode node (or arrived in the wrong place) changes the text.
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  std::vector<completion_result> want, want_long;
  {
    server single(model, (dir.path / "single.log").string());
    for (const auto& p : prompts) want.push_back(complete_greedy(single.http_port, p, 24));
    for (size_t i = 0; i < 4; ++i) want_long.push_back(complete_greedy(single.http_port, prompts[i], 400));
  }
  node_cluster c(dir.path, cluster_config_head(model, "fail", false, "round_robin"),
                 {{"router", {"router"}, {}},
                  {"prefill-0", {"prefill", "cache", "worker"}, {}},
                  {"prefill-1", {"prefill", "cache", "worker"}, {}},
                  {"decode-0", {"decode", "cache", "worker"}, {}},
                  {"decode-1", {"decode", "cache", "worker"}, {}}});
  INFO(c.logs());
  const uint16_t router = c.node("router").http;
  std::map<std::string, double> free_at_start;
  for (const char* n : workers) {
    free_at_start[n] = series(test::get(c.node(n).http, "/metrics").body, "tandem_kv_pages_free");
    REQUIRE(free_at_start[n] > 0);
  }
  // The router sees every node as its own target, named like that node's credits.
  auto rm = poll_metrics(router, [](const std::string& m) {
    for (const char* t : {"prefill-0/prefill", "prefill-1/prefill", "decode-0/decode", "decode-1/decode"})
      if (series(m, healthy(t)) != 1) return false;
    return true;
  });
  for (const char* t : {"prefill-0/prefill", "prefill-1/prefill", "decode-0/decode", "decode-1/decode"}) {
    INFO("router metrics:\n" << rm);
    CHECK(series(rm, healthy(t)) == 1);
  }

  // In sequence, then twice over at once: the single-process text, byte for byte.
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto got = complete_greedy(router, prompts[i], 24);
    INFO("prompt " << i << ": " << got.raw);
    REQUIRE(got.status == 200);
    CHECK(got.text == want[i].text);
    CHECK(got.finish_reason == want[i].finish_reason);
  }
  std::vector<completion_result> got(prompts.size() * 2);
  {
    std::vector<std::thread> ts;
    for (size_t i = 0; i < got.size(); ++i)
      ts.emplace_back([&, i] { got[i] = complete_greedy(router, prompts[i % prompts.size()], 24); });
    for (auto& t : ts) t.join();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("concurrent request " << i << ": " << got[i].raw);
    CHECK(got[i].status == 200);
    CHECK(got[i].text == want[i % prompts.size()].text);
  }
  // round_robin spread the 15 requests over both nodes of each role, and the KV pages really
  // went from each prefill node to each decode node the router chose.
  rm = test::get(router, "/metrics").body;
  INFO("router metrics:\n" << rm);
  const double n = double(prompts.size() * 3);
  CHECK(series(rm, routed("prefill-0/prefill")) + series(rm, routed("prefill-1/prefill")) == n);
  CHECK(series(rm, routed("decode-0/decode")) + series(rm, routed("decode-1/decode")) == n);
  for (const char* t : {"prefill-0/prefill", "prefill-1/prefill", "decode-0/decode", "decode-1/decode"})
    CHECK(series(rm, routed(t)) >= 7);
  double sends = 0, receives = 0;
  for (const char* w : workers) {
    auto m = test::get(c.node(w).http, "/metrics").body;
    INFO(w << " metrics:\n" << m);
    if (std::string(w).rfind("prefill", 0) == 0) {
      CHECK(series(m, "tandem_worker_kv_sends_total") >= 7);
      sends += series(m, "tandem_worker_kv_sends_total");
    } else {
      CHECK(series(m, "tandem_decode_kv_receives_total") == series(rm, routed(std::string(w) + "/decode")));
      receives += series(m, "tandem_decode_kv_receives_total");
    }
  }
  CHECK(sends == n);
  CHECK(receives == n);

  // Streams the client hangs up on (queued, at the first token, mid-decode) on every node
  // pair: the aborts reach the nodes that hold them, and every pool is whole again.
  {
    std::vector<std::thread> hangups;
    for (int i = 0; i < 16; ++i)
      hangups.emplace_back([&, i] {
        int fd = test::connect_to(router);
        if (fd < 0) return;
        test::send_all(fd, test::request_text("POST", "/v1/completions",
                                              completion_body(prompts[size_t(i) % prompts.size()], 200, true)));
        const size_t after = size_t(i % 4) * 300;  // 0: before anything came back
        size_t got_bytes = 0;
        char buf[4096];
        while (got_bytes < after) {
          ssize_t k = test::recv_some(fd, buf, std::min(sizeof buf, after - got_bytes));
          if (k <= 0) break;
          got_bytes += size_t(k);
        }
        ::close(fd);
      });
    for (auto& t : hangups) t.join();
    auto m = poll_metrics(router, [](const std::string& t) { return series(t, "tandem_requests_inflight") == 0; });
    CHECK(series(m, "tandem_requests_inflight") == 0);
    CHECK(series(m, "tandem_requests_finished_total{reason=\"abort\"}") >= 8);
    for (const char* w : workers) {
      const double want_free = free_at_start[w];
      auto wm = poll_metrics(c.node(w).http, [want_free](const std::string& t) {
        return series(t, "tandem_kv_pages_free") == want_free && series(t, "tandem_kv_transfer_live") == 0;
      });
      INFO(w << " metrics after the hang-ups:\n" << wm);
      CHECK(series(wm, "tandem_kv_pages_free") == want_free);
      CHECK(series(wm, "tandem_kv_transfer_live") == 0);
    }
  }

  // Requests decoding on both decode nodes; decode-1 dies under them. With [router] migration
  // (on by default) the streams it held continue on decode-0 from the tokens they streamed:
  // every stream finishes with the single process's text, no token lost or repeated.
  const double before_d0 = series(test::get(c.node("decode-0").http, "/metrics").body, "tandem_decode_kv_receives_total");
  std::vector<completion_result> long_runs(4);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < long_runs.size(); ++i)
    ts.emplace_back([&, i] { long_runs[i] = complete_greedy(router, prompts[i], 400); });
  auto dm = poll_metrics(c.node("decode-1").http,
                         [](const std::string& m) { return series(m, "tandem_decode_running_requests") >= 1; });
  REQUIRE(series(dm, "tandem_decode_running_requests") >= 1);
  c.kill("decode-1");
  for (auto& t : ts) t.join();
  for (size_t i = 0; i < long_runs.size(); ++i) {
    INFO("long run " << i << ": " << long_runs[i].raw);
    CHECK(long_runs[i].status == 200);
    CHECK(long_runs[i].text == want_long[i].text);
    CHECK(long_runs[i].finish_reason == want_long[i].finish_reason);
  }
  rm = test::get(router, "/metrics").body;
  CHECK(series(rm, "tandem_router_migrations_total") >= 1);  // decode-1 held at least one

  // The router marked only decode-1 down; every new request goes to decode-0, from both prefill nodes.
  rm = poll_metrics(router, [](const std::string& m) { return series(m, healthy("decode-1/decode")) == 0; });
  CHECK(series(rm, healthy("decode-1/decode")) == 0);
  CHECK(series(rm, healthy("decode-0/decode")) == 1);
  CHECK(series(rm, healthy("prefill-0/prefill")) == 1);
  CHECK(series(rm, healthy("prefill-1/prefill")) == 1);
  const double routed_d1 = series(rm, routed("decode-1/decode"));
  const double p0 = series(rm, routed("prefill-0/prefill")), p1 = series(rm, routed("prefill-1/prefill"));
  for (size_t i = 0; i < 6; ++i) {
    auto r = complete_greedy(router, prompts[i % prompts.size()], 24);
    INFO("after the kill, request " << i << ": " << r.raw);
    CHECK(r.status == 200);
    CHECK(r.text == want[i % prompts.size()].text);
  }
  rm = test::get(router, "/metrics").body;
  CHECK(series(rm, routed("decode-1/decode")) == routed_d1);
  CHECK(series(rm, routed("prefill-0/prefill")) >= p0 + 3);
  CHECK(series(rm, routed("prefill-1/prefill")) >= p1 + 3);
  const double after_d0 = series(test::get(c.node("decode-0").http, "/metrics").body, "tandem_decode_kv_receives_total");
  CHECK(after_d0 >= before_d0 + 6);

  // A prefill node dies too: only its target goes down, the requests go to the other one.
  c.kill("prefill-1");
  rm = poll_metrics(router, [](const std::string& m) { return series(m, healthy("prefill-1/prefill")) == 0; });
  CHECK(series(rm, healthy("prefill-1/prefill")) == 0);
  CHECK(series(rm, healthy("prefill-0/prefill")) == 1);
  const double routed_p1 = series(rm, routed("prefill-1/prefill"));
  for (size_t i = 0; i < 3; ++i) {
    auto r = complete_greedy(router, prompts[i], 24);
    INFO("after both kills, request " << i << ": " << r.raw);
    CHECK(r.status == 200);
    CHECK(r.text == want[i].text);
  }
  CHECK(series(test::get(router, "/metrics").body, routed("prefill-1/prefill")) == routed_p1);

  // Every surviving node's pool is whole again and no transfer holds pages.
  rm = poll_metrics(router, [](const std::string& m) { return series(m, "tandem_requests_inflight") == 0; });
  CHECK(series(rm, "tandem_requests_inflight") == 0);
  for (const char* w : {"prefill-0", "decode-0"}) {
    const double want_free = free_at_start[w];
    auto m = poll_metrics(c.node(w).http, [want_free](const std::string& t) {
      return series(t, "tandem_kv_pages_free") == want_free && series(t, "tandem_kv_transfer_live") == 0 &&
             series(t, "tandem_kv_transfer_quarantined_pages") == 0;
    });
    INFO(w << " metrics:\n" << m);
    CHECK(series(m, "tandem_kv_pages_free") == want_free);
    CHECK(series(m, "tandem_kv_transfer_live") == 0);
    CHECK(series(m, "tandem_kv_transfer_quarantined_pages") == 0);
  }
}
