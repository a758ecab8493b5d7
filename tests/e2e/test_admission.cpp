// End to end: admission against a real `tandem serve` on a micro model. Overload is 503 with
// Retry-After and a JSON error, the per-client rate limit 429, a started stream that runs out
// of KV pages gets an in-band error then [DONE], a request queued past limits.queue_timeout_ms
// is 504, and every request gets exactly one final answer (a status, and for 200 streams
// [DONE]). Timings are not checked.
#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

/// One final answer per request: a known status, with an error body for non-200 and a
/// properly framed SSE stream ending in [DONE] for 200.
void check_final_answer(const test::http_response& r) {
  INFO("status " << r.status << " body " << r.body.substr(0, 300));
  REQUIRE((r.status == 200 || r.status == 503 || r.status == 504 || r.status == 429));
  if (r.status == 200) {
    bool framing = false;
    test::sse_events(r.body, framing);
    CHECK(framing);
  } else {
    auto j = json::parse(r.body);
    REQUIRE(j.find("error"));
    CHECK(!j.find("error")->find("message")->s.empty());
    CHECK(std::stoi(r.headers.at("retry-after")) >= 1);
  }
}

/// `n` streaming completions at once; their responses.
std::vector<test::http_response> burst(uint16_t port, int n, int max_tokens) {
  std::vector<std::future<test::http_response>> fs;
  const std::string body = R"({"prompt":"the quick brown fox jumps over the lazy dog","stream":true,"ignore_eos":true,"max_tokens":)" +
                           std::to_string(max_tokens) + "}";
  for (int i = 0; i < n; ++i)
    fs.push_back(std::async(std::launch::async, [&] { return test::post(port, "/v1/completions", body); }));
  std::vector<test::http_response> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

}  // namespace

TEST_CASE("admission e2e: a full queue answers 503 with Retry-After and a JSON error, every request one answer") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string(), {"--max-queued-requests", "1", "--max-running-seqs", "1"});
  auto rs = burst(srv.http_port, 32, 48);
  int n503 = 0;
  for (const auto& r : rs) {
    check_final_answer(r);
    if (r.status != 503) continue;
    ++n503;
    auto j = json::parse(r.body);
    CHECK(j.find("error")->find("code")->s == "overloaded");
    CHECK(j.find("error")->find("message")->s.find("max_queued_requests") != std::string::npos);
  }
  CHECK(n503 > 0);
  auto met = test::get(srv.http_port, "/metrics");
  CHECK(met.body.find("tandem_rejections_total{actor=\"router\",reason=\"queue_requests\"}") != std::string::npos);
}

TEST_CASE("admission e2e: the per-client rate limit answers 429") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string(), {"--rate-limit-rps", "1", "--rate-limit-burst", "1"});
  const std::string body = R"({"prompt":"hello","max_tokens":2})";
  int n200 = 0, n429 = 0;
  for (int i = 0; i < 3; ++i) {
    auto r = test::post(srv.http_port, "/v1/completions", body);
    if (r.status == 200) ++n200;
    if (r.status == 429) {
      ++n429;
      CHECK(std::stoi(r.headers.at("retry-after")) >= 1);
      CHECK(json::parse(r.body).find("error")->find("code")->s == "rate_limited");
    }
  }
  CHECK(n200 >= 1);
  CHECK(n429 >= 1);
  CHECK(n200 + n429 == 3);
}

TEST_CASE("admission e2e: a stream that started and runs out of KV pages gets an in-band error, then [DONE]") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  // 4 pages of 16 tokens: a lone sequence cannot be preempted for room and fails at 64 tokens.
  server srv(model, (dir.path / "serve.log").string(), {"--device-pages", "4"});
  auto r = test::post(srv.http_port, "/v1/completions",
                      R"({"prompt":"hello","stream":true,"ignore_eos":true,"max_tokens":120})");
  REQUIRE(r.status == 200);
  bool framing = false;
  auto evs = test::sse_events(r.body, framing);
  CHECK(framing);  // ends with data: [DONE]
  REQUIRE(evs.size() >= 2);
  auto first = json::parse(evs.front());
  CHECK(first.find("choices"));  // text came first: the status was already 200
  auto last = json::parse(evs.back());
  REQUIRE(last.find("error"));
  CHECK(last.find("error")->find("code")->s == "overloaded");
  CHECK(last.find("error")->find("message")->s.find("KV cache exhausted") != std::string::npos);
  CHECK(test::get(srv.http_port, "/metrics").body.find("tandem_http_stream_errors_total 1") != std::string::npos);
}

TEST_CASE("admission e2e: a request still queued past limits.queue_timeout_ms is 504") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string(), {"--queue-timeout-ms", "1", "--max-running-seqs", "1"});
  auto rs = burst(srv.http_port, 24, 32);
  int n504 = 0;
  for (const auto& r : rs) {
    check_final_answer(r);
    if (r.status != 504) continue;
    ++n504;
    CHECK(json::parse(r.body).find("error")->find("code")->s == "queue_timeout");
  }
  CHECK(n504 > 0);
  auto met = test::get(srv.http_port, "/metrics");
  CHECK(met.body.find("tandem_rejections_total{actor=\"router\",reason=\"queue_timeout\"} 0") == std::string::npos);
}
