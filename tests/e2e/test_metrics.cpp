// /metrics of a running `tandem serve` and docs/metrics.md describe the same metrics.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/e2e/metrics_doc.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"

using namespace tandem;
using namespace tandem::e2e;

TEST_CASE("metrics: every metric a running node renders is in docs/metrics.md, and vice versa") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string());
  // One finished request and one refused by the front end, so the per-event series exist.
  auto ok = test::post(srv.http_port, "/v1/completions", R"({"prompt":"hello","max_tokens":3})");
  REQUIRE(ok.status == 200);
  auto bad = test::post(srv.http_port, "/v1/completions", R"({"prompt":"hello","max_tokens":0})");
  CHECK(bad.status >= 400);
  auto resp = test::get(srv.http_port, "/metrics");
  REQUIRE(resp.status == 200);

  auto docs = documented_metrics();
  auto rendered = rendered_metrics(resp.body);
  REQUIRE(docs.size() > 40);
  REQUIRE(rendered.size() > 40);
  for (const auto& [name, type] : rendered) {
    INFO("rendered metric " << name << " (" << type << ")");
    auto d = docs.find(name);
    CHECK_MESSAGE(d != docs.end(), "add it to docs/metrics.md");
    if (d != docs.end()) CHECK(d->second.type == type);
  }
  for (const auto& [name, row] : docs) {
    INFO("documented metric " << name << " (" << row.rendered << ")");
    // `pd node` rows are checked against a multi-node cluster by test_pd.cpp.
    CHECK((row.rendered == "always" || row.rendered == "after an event" || row.rendered == "cache tier" ||
           row.rendered == "pd node"));
    if (row.rendered == "always") CHECK_MESSAGE(rendered.count(name) == 1, "documented as always rendered");
  }
  // The per-event series this test caused.
  CHECK(rendered.count("tandem_requests_finished_total") == 1);
  CHECK(rendered.count("tandem_http_requests_total") == 1);
  CHECK(resp.body.find("tandem_node_up{node=\"local\"} 1") != std::string::npos);
  CHECK(resp.body.find("tandem_prompt_tokens_total ") != std::string::npos);
}

TEST_CASE("metrics: a request ended by a stop string is counted as stop, not abort") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string());
  // The greedy text without a stop string, then a stop string from its first tokens: the front
  // end cuts the text there and ends the engine request before it finished by itself.
  auto full = test::post(srv.http_port, "/v1/completions",
                         R"({"prompt":"hello","max_tokens":24,"temperature":0})");
  REQUIRE(full.status == 200);
  std::smatch m;
  REQUIRE(std::regex_search(full.body, m, std::regex(R"re("text":"([^"\\]*))re")));
  const std::string text = m[1];
  std::string stop;
  for (size_t i = 0; i < text.size() / 3; ++i)
    if (std::isalnum(static_cast<unsigned char>(text[i]))) {
      stop = text.substr(i, 1);
      break;
    }
  if (stop.empty()) {
    MESSAGE("the micro model's text has no ASCII letter early on: " << text);
    return;
  }
  auto cut = test::post(srv.http_port, "/v1/completions",
                        R"({"prompt":"hello","max_tokens":24,"temperature":0,"stop":")" + stop + R"("})");
  REQUIRE(cut.status == 200);
  CHECK(cut.body.find("\"finish_reason\":\"stop\"") != std::string::npos);
  // The router counts the finish when the front end's end reaches it (asynchronously).
  const std::regex stop_series(R"re(tandem_requests_finished_total\{[^}]*reason="stop"[^}]*\} ([0-9.]+))re");
  const std::regex abort_series(R"re(tandem_requests_finished_total\{[^}]*reason="abort"[^}]*\} ([0-9.]+))re");
  // Polled for up to 30 s: under a loaded 2-core CI machine 5 s was once not enough.
  std::string body;
  for (int i = 0; i < 300; ++i) {
    body = test::get(srv.http_port, "/metrics").body;
    if (std::regex_search(body, m, stop_series) && std::stod(m[1]) >= 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO(body);
  REQUIRE(std::regex_search(body, m, stop_series));
  CHECK(std::stod(m[1]) >= 1);
  CHECK_FALSE(std::regex_search(body, m, abort_series));
}
