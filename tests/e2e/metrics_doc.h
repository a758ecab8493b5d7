#pragma once
/// docs/metrics.md and a /metrics text read the same way by every test that checks one
/// against the other (test_metrics for a single node, test_pd for every node of a cluster).
#include <doctest/doctest.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

namespace tandem::e2e {

/// A row of docs/metrics.md: the metric's type and where it is rendered ("always", "pd node", ...).
struct doc_row {
  std::string type, rendered;
};

/// Rows `| \`tandem_x\` | type | labels | rendered | meaning |` of docs/metrics.md.
inline std::map<std::string, doc_row> documented_metrics() {
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
inline std::map<std::string, std::string> rendered_metrics(const std::string& text) {
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

}  // namespace tandem::e2e
