// GET /health (liveness) and GET /health/ready (readiness) over HTTP against the fake API.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("http: /health/ready is 503 with the reason while the node cannot serve, /health stays 200") {
  server_fixture s;
  auto r = get(s.http_port, "/health/ready");
  CHECK(r.status == 200);
  auto j = json::parse(r.body);
  CHECK(j.find("status")->s == "ready");
  CHECK(j.find("ready")->b);

  s.api.set_ready(false, "no live decode target (1 configured, none connected with fresh credits)");
  r = get(s.http_port, "/health/ready");
  CHECK(r.status == 503);
  j = json::parse(r.body);
  CHECK(j.find("status")->s == "degraded");
  CHECK(!j.find("ready")->b);
  CHECK(j.find("reason")->s.find("no live decode target") != std::string::npos);
  CHECK(get(s.http_port, "/health").status == 200);

  s.api.set_ready(true, "ready");
  CHECK(get(s.http_port, "/health/ready").status == 200);
  auto m = get(s.http_port, "/metrics").body;
  CHECK(m.find("tandem_http_requests_total{route=\"/health/ready\",status=\"503\"} 1") != std::string::npos);
  CHECK(m.find("tandem_http_requests_total{route=\"/health/ready\",status=\"200\"} 2") != std::string::npos);
}
