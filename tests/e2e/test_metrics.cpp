// /metrics of a running `tandem serve` and docs/metrics.md describe the same metrics.
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

struct doc_row {
  std::string type, rendered;
};

/// Rows `| \`tandem_x\` | type | labels | rendered | meaning |` of docs/metrics.md.
std::map<std::string, doc_row> documented_metrics() {
  std::ifstream in(std::string(TANDEM_SOURCE_DIR) + "/docs/metrics.md");
  REQUIRE(in);
  std::map<std::string, doc_row> out;
  std::regex row(R"(^\| `(tandem_[a-z0-9_]+)` \| ([a-z]+) \|[^|]*\| ([a-z ]+) \|)");
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, row)) out[m[1]] = {m[2], m[3]};
  }
  return out;
}

/// `# TYPE name type` lines of a Prometheus text exposition.
std::map<std::string, std::string> rendered_metrics(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) != 0) continue;
    std::istringstream f(line.substr(7));
    std::string name, type;
    f >> name >> type;
    out[name] = type;
  }
  return out;
}

}  // namespace

TEST_CASE("metrics: every metric a running node renders is in docs/metrics.md, and vice versa") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string());
  // One finished request and one refused by the front end, so the per-event series exist.
  auto ok = test::post(srv.http_port, "/v1/completions", R"({"model":"m","prompt":"hello","max_tokens":3})");
  REQUIRE(ok.status == 200);
  auto bad = test::post(srv.http_port, "/v1/completions", R"({"model":"m","prompt":"hello","max_tokens":0})");
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
