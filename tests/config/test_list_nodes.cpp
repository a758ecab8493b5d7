// `tandem check-config --list-nodes`: the machine-readable node list the deploy scripts read
// (deploy/launch-cluster.sh, deploy/systemd/install-units.sh, tests/netns/run.sh).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/e2e/process.h"

namespace fs = std::filesystem;

namespace {

struct listed {
  int code = -1;
  std::string out, err;
};

listed list_nodes(const fs::path& cfg, const fs::path& dir) {
  const std::string err_path = (dir / "list-nodes.err").string();
  listed r;
  {
    tandem::e2e::child p({TANDEM_BINARY, "check-config", "--list-nodes", cfg.string()}, {}, err_path);
    r.out = p.read_all(std::chrono::seconds(30));
    r.code = p.wait(std::chrono::seconds(30));
  }
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

const char* three_nodes = R"([limits]
page_size = 16
kv_cache_mb = 64

[[node]]
name = "r"
host = "10.0.0.1"
roles = ["router"]
cluster_port = 9000
http_port = 9080
admin_port = 9082

[[node]]
name = "p"
host = "10.0.0.2"
roles = ["prefill", "cache", "worker"]
numa_node = 0
page_size = 16
cluster_port = 9000
kv_port = 9001

[[node]]
name = "d"
host = "10.0.0.3"
roles = ["decode", "cache", "worker"]
rpc_port = 7001
cluster_port = 9000
)";

}  // namespace

TEST_CASE("cli: check-config --list-nodes prints one tab-separated line per valid node, nothing for an invalid config") {
  tandem::e2e::temp_dir dir;
  std::ofstream(dir.path / "ok.toml") << three_nodes;
  auto ok = list_nodes(dir.path / "ok.toml", dir.path);
  INFO(ok.err);
  CHECK(ok.code == 0);
  // name host numa_node roles http_port rpc_port admin_port page_size api_key_file; unset keys have their
  // defaults, and page_size is the effective one (r and d inherit limits.page_size).
  CHECK(ok.out ==
        "r\t10.0.0.1\t-1\trouter\t9080\t8081\t9082\t16\t-\n"
        "p\t10.0.0.2\t0\tprefill,cache,worker\t8080\t8081\t8082\t16\t-\n"
        "d\t10.0.0.3\t-1\tdecode,cache,worker\t8080\t7001\t8082\t16\t-\n");

  // The same file with a typo: exit 78 (EX_CONFIG), every problem on stderr, nothing on stdout a script could start.
  std::string bad = three_nodes;
  bad.replace(bad.find("\"decode\""), 8, "\"decoder\"");
  std::ofstream(dir.path / "bad.toml") << bad;
  auto b = list_nodes(dir.path / "bad.toml", dir.path);
  CHECK(b.code == 78);
  CHECK(b.out.empty());
  CHECK(b.err.find("node[2].roles = \"decoder\": unknown role; did you mean 'decode'?") != std::string::npos);
  CHECK(b.err.find("no node has the role \"decode\"") != std::string::npos);

  auto missing = list_nodes(dir.path / "missing.toml", dir.path);
  CHECK(missing.code == 78);
  CHECK(missing.out.empty());
}
