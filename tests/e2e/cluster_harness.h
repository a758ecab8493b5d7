#pragma once
// N-node clusters of real `tandem serve --config X --node N` processes on loopback, for
// end-to-end tests: the config (fixed free ports, a kv_port on every prefill-only node), the
// processes (each waited for until it listens), and the HTTP helpers the tests read them with.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/e2e/ports.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

namespace tandem::e2e {

inline std::string file_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// One node of a cluster to start: its name, its roles (TOML list items) and extra environment.
struct node_spec {
  std::string name;
  std::vector<std::string> roles;
  std::map<std::string, std::string> env;
  std::string toml = {};  ///< appended after the node's keys, e.g. a [node.cache] table
};

/// A started node: its ports, its log (stderr) and its process.
struct cluster_node {
  std::string name;
  std::vector<std::string> roles;
  uint16_t http = 0, rpc = 0, admin = 0, cluster = 0, kv = 0;
  std::string log;
  std::unique_ptr<child> proc;
  bool has(const std::string& role) const {
    for (const auto& r : roles)
      if (r == role) return true;
    return false;
  }
};

/// The part of a config before its [[node]] tables: limits, model, cache, transfer and router.
inline std::string cluster_config_head(const std::string& model, const std::string& failure_policy,
                                       bool prefix_cache, const std::string& router_policy = "round_robin") {
  return "[limits]\npage_size = 16\nkv_cache_mb = 16\nmax_running_seqs = 8\n\n[model]\npath = \"" + model +
         "\"\n\n[cache]\nenabled = " + (prefix_cache ? "true" : "false") + "\n\n[transfer]\nfailure_policy = \"" +
         failure_policy + "\"\ntimeout_ms = 5000\n\n[router]\npolicy = \"" + router_policy + "\"\n";
}

/// The nodes of one config, all started at once (each links to the others with a deadline),
/// each waited for until it prints its three listening lines (http, rpc, admin).
class node_cluster {
 public:
  node_cluster(const std::filesystem::path& dir, const std::string& head, const std::vector<node_spec>& specs) {
    std::set<uint16_t> taken;
    std::string cfg = head;
    for (const auto& sp : specs) {
      cluster_node n;
      n.name = sp.name;
      n.roles = sp.roles;
      n.http = free_tcp_port(taken);
      n.rpc = free_tcp_port(taken);
      n.admin = free_tcp_port(taken);
      n.cluster = free_tcp_port(taken);
      if (n.has("prefill") && !n.has("decode")) n.kv = free_tcp_port(taken);
      n.log = (dir / (n.name + ".log")).string();
      std::string roles;
      for (const auto& r : n.roles) roles += (roles.empty() ? "\"" : ", \"") + r + "\"";
      cfg += "\n[[node]]\nname = \"" + n.name + "\"\nhost = \"127.0.0.1\"\nroles = [" + roles +
             "]\nhttp_port = " + std::to_string(n.http) + "\nrpc_port = " + std::to_string(n.rpc) +
             "\nadmin_port = " + std::to_string(n.admin) + "\ncluster_port = " + std::to_string(n.cluster) + "\n" +
             (n.kv ? "kv_port = " + std::to_string(n.kv) + "\n" : "") + sp.toml;
      nodes_.push_back(std::move(n));
    }
    config_ = (dir / "cluster.toml").string();
    std::ofstream(config_) << cfg;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      auto& n = nodes_[i];
      n.proc = std::make_unique<child>(
          std::vector<std::string>{TANDEM_BINARY, "serve", "--config", config_, "--node", n.name, "--log-level", "info"},
          specs[i].env, n.log);
    }
    for (auto& n : nodes_) {
      int seen = 0;
      while (seen < 3) {
        auto line = n.proc->read_line(std::chrono::seconds(30));
        if (!line) throw std::runtime_error("node " + n.name + " did not print its listening lines:\n" + logs());
        if (line->find(" listening on 127.0.0.1:") != std::string::npos) ++seen;
      }
    }
  }

  cluster_node& node(const std::string& name) {
    for (auto& n : nodes_)
      if (n.name == name) return n;
    throw std::runtime_error("no node " + name + " in the cluster");
  }
  std::vector<cluster_node>& nodes() { return nodes_; }
  const std::string& config() const { return config_; }
  /// SIGKILLs a node and reaps it (its ports stay in the config; the others see it go).
  void kill(const std::string& name) {
    auto& n = node(name);
    ::kill(n.proc->pid(), SIGKILL);
    n.proc->wait(std::chrono::seconds(10));
  }
  /// Starts a killed node again: same config and ports; its log goes on in `<log>.restart.log`.
  /// Waits for its listening lines.
  void restart(const std::string& name, const std::map<std::string, std::string>& env = {}) {
    auto& n = node(name);
    n.proc.reset();
    n.log += ".restart.log";
    n.proc = std::make_unique<child>(
        std::vector<std::string>{TANDEM_BINARY, "serve", "--config", config_, "--node", n.name, "--log-level", "info"},
        env, n.log);
    for (int seen = 0; seen < 3;) {
      auto line = n.proc->read_line(std::chrono::seconds(30));
      if (!line) throw std::runtime_error("node " + n.name + " did not print its listening lines again:\n" + logs());
      if (line->find(" listening on 127.0.0.1:") != std::string::npos) ++seen;
    }
  }
  /// Every node's log, for INFO on failure.
  std::string logs() const {
    std::string s;
    for (const auto& n : nodes_) s += "--- " + n.name + "\n" + file_text(n.log);
    return s;
  }

 private:
  std::string config_;
  std::vector<cluster_node> nodes_;
};

/// A greedy /v1/completions body.
inline std::string completion_body(const std::string& prompt, int32_t max_tokens, bool stream = false) {
  json::writer w;
  w.begin_object()
      .key("prompt").str(prompt)
      .key("max_tokens").num(max_tokens)
      .key("temperature").real(0)
      .key("stream").boolean(stream)
      .end_object();
  return w.take();
}

struct completion_result {
  int status = 0;
  std::string text, finish_reason, raw;
};

inline completion_result complete_greedy(uint16_t port, const std::string& prompt, int32_t max_tokens) {
  // Non-streamed: nothing comes back before the last token, which on 2 loaded cores (CI runs
  // two tests at once) can take longer than the default 10 s for a few hundred tokens.
  auto resp = test::post(port, "/v1/completions", completion_body(prompt, max_tokens), 120);
  completion_result c;
  c.status = resp.status;
  c.raw = resp.body;
  if (resp.status != 200) return c;
  auto v = json::parse(resp.body);
  const auto& choice = v.find("choices")->arr.at(0);
  c.text = choice.find("text")->s;
  c.finish_reason = choice.find("finish_reason")->s;
  return c;
}

/// The value of a series in a /metrics text: `name` or `name{labels}` exactly as rendered (NaN if absent).
inline double series(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  return std::nan("");
}

/// Polls /metrics of `port` until `ok(text)` holds or the deadline passes; the last text.
inline std::string poll_metrics(uint16_t port, const std::function<bool(const std::string&)>& ok,
                                std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::string text;
  while (true) {
    text = test::get(port, "/metrics").body;
    if (ok(text) || std::chrono::steady_clock::now() >= until) return text;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a condition, with a deadline
  }
}

}  // namespace tandem::e2e
