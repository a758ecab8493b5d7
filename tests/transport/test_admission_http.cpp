// HTTP side of admission: rate limits (429), Retry-After from the router's estimate, queue
// timeouts (504), in-band errors on started streams.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/rate_limiter.h"

using namespace tandem;
using namespace tandem::test;

namespace {
json::value body_of(const http_response& r) { return json::parse(r.body); }
}  // namespace

TEST_CASE("rate_limiter: token bucket per client, refill, bounded table") {
  transport::rate_limiter off(0, 0, 4);
  for (int i = 0; i < 100; ++i) CHECK(off.take("a", 0).allowed);
  transport::rate_limiter rl(2, 3, 2);  // 2/s, burst 3, 2 clients
  for (int i = 0; i < 3; ++i) CHECK(rl.take("a", 1000).allowed);
  auto v = rl.take("a", 1000);
  CHECK_FALSE(v.allowed);
  CHECK(v.retry_after_ms == 500);  // one token at 2/s
  CHECK(rl.take("b", 1000).allowed);  // another client has its own bucket
  CHECK(rl.take("a", 1250).allowed == false);
  CHECK(rl.take("a", 1500).allowed);  // 0.5 s refilled one token
  CHECK(rl.refused() == 2);
  rl.take("c", 1500);  // a third client evicts the least recently seen (b)
  CHECK(rl.clients() == 2);
  CHECK(rl.evicted() == 1);
  CHECK(transport::rate_limit_key("Bearer sk-1", "1.2.3.4").rfind("key:", 0) == 0);
  CHECK(transport::rate_limit_key("Bearer sk-1", "1.2.3.4").find("sk-1") == std::string::npos);
  CHECK(transport::rate_limit_key("Bearer sk-1", "x") == transport::rate_limit_key("Bearer sk-1", "y"));
  CHECK(transport::rate_limit_key("", "1.2.3.4") == "addr:1.2.3.4");
}

TEST_CASE("http: per-client rate limit answers 429 with Retry-After and a JSON error, per bearer token") {
  limits lim;
  lim.rate_limit_rps = 1;
  lim.rate_limit_burst = 2;
  server_fixture s(lim);
  const std::string body = R"({"prompt":"x","max_tokens":2})";
  auto with_key = [&](const std::string& key) {
    return http_exchange(s.http_port, request_text("POST", "/v1/completions", body, "Authorization: Bearer " + key + "\r\n"));
  };
  CHECK(with_key("alice").status == 200);
  CHECK(with_key("alice").status == 200);
  auto r = with_key("alice");
  CHECK(r.status == 429);
  CHECK(r.headers["retry-after"] == "1");
  auto rj = body_of(r);
  auto e = rj.find("error");
  REQUIRE(e);
  CHECK(e->find("code")->s == "rate_limited");
  CHECK(e->find("message")->s.find("rate_limit_rps") != std::string::npos);
  CHECK(with_key("bob").status == 200);  // another key, another bucket
  // Without a key the client address is the key: 2 allowed, then 429.
  int ok = 0, limited = 0;
  for (int i = 0; i < 3; ++i) {
    auto a = post(s.http_port, "/v1/completions", body);
    (a.status == 200 ? ok : limited) += a.status == 200 || a.status == 429 ? 1 : 0;
  }
  CHECK(ok == 2);
  CHECK(limited == 1);
  auto met = get(s.http_port, "/metrics");
  CHECK(met.body.find("tandem_http_rate_limited_total 2") != std::string::npos);
  CHECK(met.body.find("tandem_http_requests_total{route=\"/v1/completions\",status=\"429\"} 2") != std::string::npos);
}

TEST_CASE("http: Retry-After comes from the router's drain estimate, queue timeouts are 504") {
  server_fixture s;
  fake_behavior b;
  b.fail = error(error_kind::overloaded, "queue full");
  b.reject_reason = "queue_wait";
  b.retry_after_ms = 2300;
  s.api.set(b);
  for (bool stream : {false, true}) {
    auto r = post(s.http_port, "/v1/completions", stream ? R"({"prompt":"x","stream":true})" : R"({"prompt":"x"})");
    CHECK(r.status == 503);
    CHECK(r.headers["retry-after"] == "3");
    CHECK(body_of(r).find("error")->find("code")->s == "overloaded");
  }
  b.reject_reason = "queue_timeout";
  b.retry_after_ms = 0;
  s.api.set(b);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x"})");
  CHECK(r.status == 504);
  CHECK(r.headers["retry-after"] == "1");
  CHECK(body_of(r).find("error")->find("code")->s == "queue_timeout");
  // A deadline that passed after the prefill started, before any token: the same 504.
  b.reject_reason = "deadline";
  s.api.set(b);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"x"})");
  CHECK(r.status == 504);
  CHECK(body_of(r).find("error")->find("code")->s == "deadline_exceeded");
}

TEST_CASE("http: a stream that started and is then refused gets the error in-band, then [DONE]") {
  server_fixture s;
  fake_behavior b;
  b.fail = error(error_kind::overloaded, "KV cache exhausted");
  b.fail_after = 3;
  s.api.set(b);
  auto st = post(s.http_port, "/v1/completions", R"({"prompt":"x","stream":true,"max_tokens":50})");
  CHECK(st.status == 200);
  bool framing = false;
  auto evs = sse_events(st.body, framing);
  CHECK(framing);
  REQUIRE(evs.size() == 2);
  auto ej = json::parse(evs[1]);
  auto e = ej.find("error");
  REQUIRE(e);
  CHECK(e->find("code")->s == "overloaded");
  CHECK(e->find("message")->s == "KV cache exhausted");
  CHECK(get(s.http_port, "/metrics").body.find("tandem_http_stream_errors_total 1") != std::string::npos);
}
