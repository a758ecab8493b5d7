// The edges of a PD cluster seen from outside: what its node processes listen on.
#include <doctest/doctest.h>
#include <dirent.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "transport/ucx/kv_engine.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

/// The socket inodes process `pid` holds (its fds that link to "socket:[N]").
std::set<std::string> socket_inodes(int pid) {
  std::set<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
    if (!ec && target.rfind("socket:[", 0) == 0) out.insert(target.substr(8, target.size() - 9));
  }
  return out;
}

/// The local addresses (hex as /proc/net/tcp{,6} writes them) of the listening TCP sockets
/// of `pid`, IPv4 and IPv6.
std::vector<std::string> listening_addresses(int pid) {
  const auto inodes = socket_inodes(pid);
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/net/" + table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, tr, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> tr >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode)) out.push_back(std::string(table) + " " + local);
    }
  }
  return out;
}

/// True for 127.0.0.0/8 (tcp: little-endian hex, so the first octet is the last byte) and
/// ::1 or ::ffff:127.x (tcp6).
bool loopback(const std::string& entry) {
  const std::string addr = entry.substr(entry.find(' ') + 1, entry.find(':') - entry.find(' ') - 1);
  if (entry.rfind("tcp ", 0) == 0) return addr.size() == 8 && addr.substr(6, 2) == "7F";
  if (addr == "00000000000000000000000001000000") return true;                              // ::1
  return addr.size() == 32 && addr.substr(16, 8) == "FFFF0000" && addr.substr(30, 2) == "7F";  // ::ffff:127.x
}

}  // namespace

TEST_CASE("pd edges: a loopback cluster listens on 127.0.0.0/8 only, UCX's transports included") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  pd_cluster pd(model, dir.path, "fail", false);
  INFO(pd.logs());
  // A request first: the decode node dials the prefill node's KV listener, so every UCX
  // endpoint and interface is open when the sockets are read.
  auto c = complete(pd.router().http, "hello there", 4);
  REQUIRE(c.status == 200);
  size_t total = 0;
  for (auto& n : pd.nodes) {
    const auto addrs = listening_addresses(n.proc->pid());
    total += addrs.size();
    for (const auto& a : addrs) {
      INFO("node " << n.name << " listens on " << a);
      CHECK(loopback(a));
    }
  }
  CHECK(total >= 9);  // http, rpc and admin of each node at least
  CHECK(file_text(pd.prefill().log).find("UCX network devices lo") != std::string::npos);
  CHECK(file_text(pd.decode().log).find("UCX network devices lo") != std::string::npos);
}

TEST_CASE("pd edges: with [security] the KV handshake needs the cluster secret, and a rogue peer is refused") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::string keys = (dir.path / "keys").string();
  const std::string key = "pd-edges-cluster-secret-0123456789";
  std::ofstream(keys) << key << "\n";
  std::filesystem::permissions(keys, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write,
                               std::filesystem::perm_options::replace);
  pd_options o;
  o.extra_config = "\n[security]\napi_key_file = \"" + keys +
                   "\"\nauth_allowlist = [\"/health\", \"/health/ready\", \"/metrics\"]\n";
  pd_cluster pd(model, dir.path, o);
  INFO(pd.logs());
  // Both KV nodes hold the secret: the request's pages cross.
  auto r = test::http_exchange(pd.router().http, test::request_text("POST", "/v1/completions", body("hello there", 4),
                                                                    "Authorization: Bearer " + key + "\r\n"));
  REQUIRE(r.status == 200);
  auto pm = test::get(pd.prefill().http, "/metrics").body;
  CHECK(series(pm, "tandem_kv_transfer_done_total") >= 1);
  CHECK(series(pm, "tandem_kv_handshakes_refused_total") == 0);

  // A rogue peer with a wrong secret dials the prefill node's KV listener: refused, no rkey.
  manual_clock clock;
  kv_layout l;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 16;
  l.page_size = 16;
  kv_pool pool(l, 4);
  ucx::engine_options eo;
  eo.tls = "tcp";
  eo.secret = "a-wrong-secret-of-32-bytes-xxxxxx";
  ucx::kv_engine rogue(clock, pool, ucx::kv_identity{"decode-0", "tandem-random-micro", "f32", l}, eo,
                       [](ucx::transfer_id, ucx::transfer_role, const pool_pages&, bool) {});
  auto peer = rogue.add_peer("127.0.0.1", pd.prefill().kv);
  rogue.table().start_receive(1, peer, {{0}});
  const auto refused = poll_metrics(pd.prefill().http, [&](const std::string& m) {
    rogue.progress();
    return series(m, "tandem_kv_handshakes_refused_total") >= 1;
  });
  CHECK(series(refused, "tandem_kv_handshakes_refused_total") >= 1);
  for (int i = 0; i < 1000; ++i) rogue.progress();
  CHECK(rogue.hellos_received() == 0);
  CHECK(file_text(pd.prefill().log).find("KV handshake refused") != std::string::npos);
  // The cluster still serves.
  r = test::http_exchange(pd.router().http, test::request_text("POST", "/v1/completions", body("hello again", 4),
                                                               "Authorization: Bearer " + key + "\r\n"));
  CHECK(r.status == 200);
}
