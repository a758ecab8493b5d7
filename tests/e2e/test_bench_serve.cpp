// End to end: `tandem bench serve` against a real `tandem serve` subprocess on a micro
// model. Checks the accounting (JSON parses, every request has exactly one outcome, the
// status counts match the records), not the timings.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "tests/e2e/process.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

struct bench_fixture {
  bench_fixture() : model(write_micro_model(dir.path)) {}
  /// Runs `tandem bench serve --port P <args> --json F`; returns the parsed JSON.
  json::value bench(uint16_t port, const std::vector<std::string>& args, std::string& out) {
    const std::string json_path = (dir.path / "bench.json").string();
    std::vector<std::string> argv{TANDEM_BINARY, "bench", "serve", "--port", std::to_string(port), "--json", json_path};
    argv.insert(argv.end(), args.begin(), args.end());
    child c(argv, {}, (dir.path / "bench.log").string());
    out = c.read_all(std::chrono::seconds(60));
    const int rc = c.wait(std::chrono::seconds(10));
    std::ifstream in(dir.path / "bench.log");
    std::stringstream err;
    err << in.rdbuf();
    INFO("bench stdout:\n" << out << "\nbench stderr:\n" << err.str());
    REQUIRE(rc == 0);
    std::ifstream j(json_path);
    std::stringstream ss;
    ss << j.rdbuf();
    return json::parse(ss.str());
  }
  temp_dir dir;
  std::string model;
};

int64_t num(const json::value& v, std::string_view path) {
  const json::value* cur = &v;
  std::string p(path);
  size_t start = 0;
  while (true) {
    const size_t dot = p.find('.', start);
    cur = cur->find(p.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    REQUIRE_MESSAGE(cur != nullptr, "missing JSON field " << path);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  REQUIRE_MESSAGE(cur->is_int, path << " is not an integer");
  return cur->i;
}

/// The accounting every run must satisfy, whatever the timings.
void check_counts(const json::value& j, int64_t requests) {
  const json::value* recs = j.find("records");
  REQUIRE(recs != nullptr);
  REQUIRE(int64_t(recs->arr.size()) == requests);
  CHECK(num(j, "requests") == requests);
  const std::vector<std::string> names{"completed", "server_error", "sse_error", "timeout", "client_error",
                                       "client_dropped"};
  int64_t sum = 0;
  for (const auto& n : names) sum += num(j, "outcomes." + n);
  CHECK(sum == requests);
  CHECK(num(j, "sent") == requests - num(j, "outcomes.client_dropped"));
  CHECK(num(j, "status.200") + num(j, "status.503") + num(j, "status.429") + num(j, "status.4xx") +
            num(j, "status.other") ==
        num(j, "sent"));
  std::map<std::string, int64_t> by_outcome;
  std::set<int64_t> indices;
  int64_t rejected = 0;
  for (const json::value& r : recs->arr) {
    indices.insert(num(r, "index"));
    const json::value* o = r.find("outcome");
    REQUIRE(o != nullptr);
    REQUIRE(std::find(names.begin(), names.end(), o->s) != names.end());
    ++by_outcome[o->s];
    const int64_t status = num(r, "status");
    // A non-200 response is a server error and nothing else; a 200 never is.
    CHECK((status != 200 && status != 0) == (o->s == "server_error"));
    if (status != 200 && status != 0) ++rejected;
    if (o->s == "completed") CHECK(num(r, "completion_tokens") == num(j, "max_tokens"));
  }
  CHECK(int64_t(indices.size()) == requests);
  for (const auto& n : names) CHECK(by_outcome[n] == num(j, "outcomes." + n));
  CHECK(num(j, "rejection_ms.n") == rejected);
}

}  // namespace

TEST_CASE("bench serve: closed loop against tandem serve, JSON parses and every request has one outcome") {
  bench_fixture fx;
  server srv(fx.model, (fx.dir.path / "serve.log").string());
  std::string out;
  const std::string svg = (fx.dir.path / "bench.svg").string();
  const json::value j = fx.bench(srv.http_port,
                                 {"--concurrency", "2", "--requests", "6", "--prompt-tokens", "8:24", "--max-tokens", "5",
                                  "--svg", svg},
                                 out);
  INFO(out);
  check_counts(j, 6);
  // A healthy server completes every request with exactly --max-tokens tokens (ignore_eos).
  CHECK(num(j, "outcomes.completed") == 6);
  CHECK(num(j, "status.200") == 6);
  CHECK(num(j, "output_tokens") == 30);
  for (const json::value& r : j.find("records")->arr) CHECK(num(r, "prompt_tokens") > 0);
  CHECK(num(j, "ttft_ms.n") == 6);
  CHECK(num(j, "e2e_ms.n") == 6);
  std::ifstream in(svg);
  std::string first;
  std::getline(in, first);
  CHECK(first.rfind("<svg", 0) == 0);
}

TEST_CASE("bench serve: a burst against --max-queued-requests 1 gets 503s, counted as rejections") {
  bench_fixture fx;
  server srv(fx.model, (fx.dir.path / "serve.log").string(),
             {"--max-queued-requests", "1", "--max-running-seqs", "1"});
  std::string out;
  const int64_t n = 24;
  const json::value j = fx.bench(srv.http_port,
                                 {"--burst", std::to_string(n), "--requests", std::to_string(n), "--prompt-tokens", "64",
                                  "--max-tokens", "16"},
                                 out);
  INFO(out);
  check_counts(j, n);
  CHECK(num(j, "outcomes.client_dropped") == 0);
  // 24 requests at once into 1 running + 1 queued slot: the rest are turned away with 503.
  CHECK(num(j, "status.503") > 0);
  CHECK(num(j, "outcomes.server_error") >= num(j, "status.503"));
  CHECK(num(j, "outcomes.completed") >= 1);
}

TEST_CASE("bench serve --embedded --compare-model: decode, same-work and decode-only comparisons") {
  bench_fixture fx;
  const std::string json_path = (fx.dir.path / "compare.json").string();
  // On an f16 KV cache, which the served cluster and the in-process comparison both use.
  child c({TANDEM_BINARY, "bench", "serve", "--embedded", "--model", fx.model, "--compare-model", "--concurrency", "2",
           "--requests", "4", "--prompt-tokens", "8:24", "--max-tokens", "4", "--kv-cache-dtype", "f16", "--json",
           json_path},
          {}, (fx.dir.path / "compare.log").string());
  const std::string out = c.read_all(std::chrono::seconds(120));
  INFO(out);
  REQUIRE(c.wait(std::chrono::seconds(10)) == 0);
  CHECK(out.find("compare: served") != std::string::npos);
  CHECK(out.find("compare (same work): served") != std::string::npos);
  CHECK(out.find("compare (decode only)") != std::string::npos);
  std::ifstream in(json_path);
  std::stringstream ss;
  ss << in.rdbuf();
  const json::value j = json::parse(ss.str());
  check_counts(j, 4);
  CHECK(num(j, "outcomes.completed") == 4);
  const json::value* same = j.find("compare_model") ? j.find("compare_model")->find("same_work") : nullptr;
  REQUIRE(same != nullptr);
  // The served prompts were 8..24 words: the in-process run prefills prompts of their mean length.
  CHECK(num(*same, "prompt_tokens") >= 8);
  REQUIRE(same->find("prefill_s") != nullptr);
  CHECK(same->find("prefill_s")->num > 0.0);
  CHECK(same->find("tokens_per_s")->num > 0.0);
  CHECK(same->find("ratio")->num > 0.0);
}
