#pragma once
// A router node, a prefill node and a decode node as three `tandem serve --config pd.toml
// --node NAME` processes on loopback, and the client helpers the PD and fault tests share
// (test_pd.cpp, test_faults.cpp). Reading files and /metrics (file_text, series,
// poll_metrics) comes from cluster_harness.h, which the multi-node tests use too.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/cluster_harness.h"
#include "tests/e2e/ports.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

namespace tandem::e2e {

struct node_proc {
  std::string name;
  uint16_t http = 0, rpc = 0, admin = 0, cluster = 0, kv = 0;
  std::string log;
  std::map<std::string, std::string> env;
  std::unique_ptr<child> proc;
};

/// A role's gauge is 0, or the node does not run the role (a prefill node renders no decode gauges).
inline bool zero_or_absent(const std::string& text, const std::string& name) {
  const double v = series(text, name);
  return std::isnan(v) || v == 0;
}

/// What a pd_cluster's config and processes get beyond the defaults.
struct pd_options {
  std::string policy = "fail";        ///< [transfer] failure_policy
  bool prefix_cache = false;
  int32_t kv_cache_mb = 16, max_running_seqs = 8;
  std::string extra_limits;           ///< more `key = value` lines of [limits]
  int64_t transfer_timeout_ms = 5000; ///< [transfer] timeout_ms
  std::map<std::string, std::string> prefill_env, decode_env;
  std::string extra_config;           ///< more sections before the nodes (e.g. [security])
};

/// Router, prefill and decode as three `tandem serve` processes of one config.
struct pd_cluster {
  pd_cluster(const std::string& model, const std::filesystem::path& dir, const std::string& policy, bool prefix_cache,
             const std::map<std::string, std::string>& prefill_env = {})
      : pd_cluster(model, dir, pd_options{policy, prefix_cache, 16, 8, "", 5000, prefill_env, {}, ""}) {}

  pd_cluster(const std::string& model, const std::filesystem::path& dir, const pd_options& o) {
    std::set<uint16_t> taken;
    const char* names[] = {"router", "prefill-0", "decode-0"};
    const char* roles[] = {R"(["router"])", R"(["prefill", "cache", "worker"])", R"(["decode", "cache", "worker"])"};
    std::string cfg = "[limits]\npage_size = 16\nkv_cache_mb = " + std::to_string(o.kv_cache_mb) +
                      "\nmax_running_seqs = " + std::to_string(o.max_running_seqs) + "\n" + o.extra_limits +
                      "\n\n[model]\npath = \"" + model + "\"\n\n[cache]\nenabled = " +
                      (o.prefix_cache ? "true" : "false") + "\n\n[transfer]\nfailure_policy = \"" + o.policy +
                      "\"\ntimeout_ms = " + std::to_string(o.transfer_timeout_ms) + "\n" + o.extra_config;
    for (int i = 0; i < 3; ++i) {
      node_proc n;
      n.name = names[i];
      n.http = free_tcp_port(taken);
      n.rpc = free_tcp_port(taken);
      n.admin = free_tcp_port(taken);
      n.cluster = free_tcp_port(taken);
      if (i == 1) n.kv = free_tcp_port(taken);
      n.log = (dir / (n.name + ".log")).string();
      n.env = i == 1 ? o.prefill_env : i == 2 ? o.decode_env : std::map<std::string, std::string>{};
      cfg += "\n[[node]]\nname = \"" + n.name + "\"\nhost = \"127.0.0.1\"\nroles = " + roles[i] +
             "\nhttp_port = " + std::to_string(n.http) + "\nrpc_port = " + std::to_string(n.rpc) +
             "\nadmin_port = " + std::to_string(n.admin) + "\ncluster_port = " + std::to_string(n.cluster) + "\n" +
             (n.kv ? "kv_port = " + std::to_string(n.kv) + "\n" : "");
      nodes.push_back(std::move(n));
    }
    config = (dir / "pd.toml").string();
    std::ofstream(config) << cfg;
    // All three start at once: each waits (with a deadline) for the others' ingress.
    for (auto& n : nodes) spawn(n);
    for (auto& n : nodes) wait_listening(n);
    for (auto& n : nodes) wait_links_up(n);
    wait_targets_healthy(router());
  }
  node_proc& router() { return nodes[0]; }
  node_proc& prefill() { return nodes[1]; }
  node_proc& decode() { return nodes[2]; }
  std::string logs() {
    std::string s;
    for (auto& n : nodes) s += "--- " + n.name + "\n" + file_text(n.log);
    return s;
  }
  /// Starts node `n` again (after it was killed): same config, ports and environment; its log
  /// goes on in `<name>.restart.log`.
  void restart(node_proc& n, std::map<std::string, std::string> env) {
    n.proc.reset();
    n.env = std::move(env);
    n.log = n.log + ".restart.log";
    spawn(n);
    wait_listening(n);
  }
  /// True while the process of `n` has not exited.
  static bool alive(node_proc& n) { return n.proc && n.proc->wait(std::chrono::milliseconds(0)) == -1 && ::kill(n.proc->pid(), 0) == 0; }

  std::string config;
  std::vector<node_proc> nodes;

 private:
  void spawn(node_proc& n) {
    n.proc = std::make_unique<child>(
        std::vector<std::string>{TANDEM_BINARY, "serve", "--config", config, "--node", n.name, "--log-level", "info"},
        n.env, n.log);
  }
  /// Waits until `n` reaches every peer. Nodes that dial each other at the same moment can
  /// lose the link both opened (the node redials it within redial_first_ms); a test that
  /// starts in that window sees its first requests refused as "not reachable".
  void wait_links_up(node_proc& n) { wait_all_one(n, "tandem_remote_node_up{", 2, "did not reach its peers"); }
  /// Waits until the router counts every prefill and decode target healthy. A link lost and
  /// redialled at start-up is up again before the target's fresh credit reaches the router,
  /// and until then the router refuses requests with "no healthy prefill target" (seen once on
  /// a busy machine, 16 ms after the redial).
  void wait_targets_healthy(node_proc& n) {
    wait_all_one(n, "tandem_router_target_healthy{", 2, "did not count its targets healthy");
  }
  /// Polls n's /metrics until at least `min_series` series start with `prefix` and each is 1;
  /// throws with the ones that are not and n's log when the poll's deadline passes.
  static void wait_all_one(node_proc& n, const std::string& prefix, int min_series, const std::string& what) {
    auto not_one = [&](const std::string& m) {
      std::istringstream in(m);
      std::string line, out;
      int seen = 0;
      while (std::getline(in, line)) {
        if (line.rfind(prefix, 0) != 0) continue;
        ++seen;
        if (line.substr(line.rfind(' ') + 1) != "1") out += line + "\n";
      }
      return seen < min_series ? "fewer than " + std::to_string(min_series) + " series " + prefix + "...}\n" + out : out;
    };
    const std::string left = not_one(poll_metrics(n.http, [&](const std::string& m) { return not_one(m).empty(); }));
    if (!left.empty()) throw std::runtime_error("node " + n.name + " " + what + ":\n" + left + file_text(n.log));
  }
  void wait_listening(node_proc& n) {
    int seen = 0;
    while (seen < 3) {
      auto line = n.proc->read_line(std::chrono::seconds(30));
      if (!line) throw std::runtime_error("node " + n.name + " did not print its listening lines:\n" + file_text(n.log));
      if (line->find(" listening on 127.0.0.1:") != std::string::npos) ++seen;
    }
  }
};

/// The PD tests' names for cluster_harness.h's greedy completion helpers.
inline std::string body(const std::string& prompt, int32_t max_tokens, bool stream = false) {
  return completion_body(prompt, max_tokens, stream);
}
using completion = completion_result;
inline completion complete(uint16_t port, const std::string& prompt, int32_t max_tokens) {
  return complete_greedy(port, prompt, max_tokens);
}

/// A worker node's pool is whole: every page free, no transfer live or quarantined, no send
/// or receive in flight (the actors answer a scrape one after another: all parts must agree).
inline std::function<bool(const std::string&)> pool_settled(double free_pages) {
  return [free_pages](const std::string& m) {
    return series(m, "tandem_kv_pages_free") == free_pages && series(m, "tandem_kv_transfer_live") == 0 &&
           series(m, "tandem_kv_transfer_quarantined_pages") == 0 &&
           zero_or_absent(m, "tandem_worker_kv_sends_inflight") && zero_or_absent(m, "tandem_decode_kv_receiving_requests");
  };
}

inline const std::vector<std::string> pd_prompts = {
      "hello world",
      "The quick brown fox jumps over the lazy dog and keeps running across the field until the sun goes down",
      "a",
      "Once upon a time in a land far away there lived a king who had three daughters and a very old dog named "
      "Rex who liked to sleep by the fire every evening after dinner",
      "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18",
};

}  // namespace tandem::e2e
