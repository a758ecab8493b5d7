// `tandem inspect` against a running `tandem serve --admin-port 0`: tables, --json, --watch.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

std::string run_inspect(const std::vector<std::string>& args, int& code) {
  std::vector<std::string> argv = {TANDEM_BINARY, "inspect"};
  argv.insert(argv.end(), args.begin(), args.end());
  child p(argv, {}, "/dev/null");
  std::string out = p.read_all(std::chrono::seconds(30));
  code = p.wait(std::chrono::seconds(30));
  return out;
}

}  // namespace

TEST_CASE("inspect: tandem inspect lists the actors and KV pool of a running node") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  server srv(model, (dir.path / "serve.log").string(), {"--admin-port", "0"});
  REQUIRE(test::post(srv.http_port, "/v1/completions", R"({"prompt":"hi","max_tokens":2})").status == 200);
  std::string addr = "127.0.0.1:" + std::to_string(srv.admin_port);

  int code = -1;
  auto js = run_inspect({addr, "--json"}, code);
  REQUIRE(code == 0);
  auto v = json::parse(js);
  CHECK(v.find("healthy")->b);
  CHECK(v.find("node")->s == "local");
  const auto& actors = v.find("actors")->arr;
  REQUIRE(actors.size() == 5);
  CHECK(actors[0].find("name")->s == "router");
  CHECK(actors[0].find("state")->s == "running");
  CHECK(actors[0].find("mailbox_bound")->i == 4096);
  CHECK(actors[0].find("messages_handled")->i >= 1);
  CHECK(actors[4].find("name")->s == "cache_tier");
  const auto& pools = v.find("pools")->arr;
  REQUIRE(pools.size() == 1);
  CHECK(pools[0].find("pages_total")->i > 0);
  CHECK(v.find("requests")->arr.empty());

  auto text = run_inspect({addr}, code);
  CHECK(code == 0);
  CHECK(text.find("ACTOR") != std::string::npos);
  CHECK(text.find("cache_tier") != std::string::npos);
  CHECK(text.find("KV POOLS") != std::string::npos);

  auto watch = run_inspect({addr, "--json", "--watch", "0.05", "--count", "2"}, code);
  CHECK(code == 0);
  CHECK(std::count(watch.begin(), watch.end(), '\n') == 2);

  run_inspect({"127.0.0.1:1"}, code);
  CHECK(code == 1);
  run_inspect({"nonsense"}, code);
  CHECK(code == 1);
}

TEST_CASE("inspect: a node marks the roles other nodes run as remote, its own as running") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  node_cluster cl(dir.path, cluster_config_head(model, "fail", true),
                  {{"router", {"router"}, {}},
                   {"prefill-0", {"prefill", "cache", "worker"}, {}},
                   {"decode-0", {"decode", "cache", "worker"}, {}}});
  INFO(cl.logs());
  auto states = [&](const std::string& node) {
    int code = -1;
    auto out = run_inspect({"127.0.0.1:" + std::to_string(cl.node(node).admin), "--json"}, code);
    INFO(out);
    REQUIRE(code == 0);
    auto v = json::parse(out);
    std::map<std::string, std::string> by_name;
    for (const auto& a : v.find("actors")->arr) by_name[a.find("name")->s] = a.find("state")->s;
    return by_name;
  };
  auto router = states("router");
  CHECK(router["router"] == "running");
  CHECK(router["prefill"] == "remote");
  CHECK(router["decode"] == "remote");
  CHECK(router.count("worker") == 0);
  auto decode = states("decode-0");
  CHECK(decode["decode"] == "running");
  CHECK(decode["worker"] == "running");
  CHECK(decode["cache_tier"] == "running");
  for (const auto& [name, state] : decode)
    if (name != "decode" && name != "worker" && name != "cache_tier") CHECK_MESSAGE(state == "remote", name);
}
