// tandem check-config FILE: every check `tandem serve --config` runs before it starts anything.
// With --list-nodes it also lists the nodes, one tab-separated line each, so deploy scripts
// (deploy/launch-cluster.sh, deploy/systemd/install-units.sh) never parse TOML themselves.
#include <fmt/format.h>
#include <cstdio>
#include <string>

#include "kernels/base/error.h"
#include "actors/config/cluster_config.h"
#include "actors/runtime/node_plan.h"
#include "kernels/base/json.h"
#include "tools/tandem/backend_select.h"
#include "tools/tandem/commands.h"
#include "actors/config/cache_table.h"
#include "tools/tandem/config_report.h"
#include "tools/tandem/exit_codes.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

void print_config_problems(const config_check& c) {
  for (const auto& e : c.errors) std::fprintf(stderr, "error: %s\n", e.c_str());
  for (const auto& n : c.notes) std::fprintf(stderr, "note: %s\n", n.c_str());
}

namespace {

/// --list-nodes: one tab-separated line per node (the columns the usage names).
void print_node_list(const config_check& c) {
  for (const auto& n : c.cfg.nodes) {
    const node_ports ports = spec_of(c.cfg, n).ports;  // what serve binds
    std::string roles;
    for (const auto& r : n.roles) roles += (roles.empty() ? "" : ",") + r;
    std::printf("%s\t%s\t%d\t%s\t%d\t%d\t%d\t%d\t%s\n", n.name.c_str(), n.host.c_str(), n.numa_node, roles.c_str(),
                ports.http, ports.rpc, ports.admin, n.effective_page_size(c.cfg.lim),
                c.cfg.api_key_file.empty() ? "-" : c.cfg.api_key_file.c_str());
  }
}

/// --json: each cache node's KV plan as one object.
void print_plans_json(const std::string& path, const config_check& c) {
  // {"nodes":[{"node","numa_node","pools":[{"name","window_tokens","pages","bytes","host_pages","host_bytes",
  //  "disk_bytes"}],
  //  "host":{"bytes"},
  //  "disk":{"blocks","bytes"}}]}: what each node with a cache allocates (the model's layout known here).
  json::writer w;
  w.begin_object().key("config").str(path).key("nodes").begin_array();
  for (const auto& p : c.plans) {
    w.begin_object().key("node").str(p.node).key("numa_node").num(p.numa_node).key("pools").begin_array();
    for (const auto& pool : p.pools)
      w.begin_object()
          .key("name").str(pool.name)
          .key("window_tokens").num(pool.window_tokens)
          .key("pages").num(pool.pages)
          .key("bytes").num(int64_t(pool.bytes))
          .key("host_pages").num(pool.host_pages)
          .key("host_bytes").num(int64_t(pool.host_bytes))
          .key("disk_bytes").num(int64_t(pool.disk_bytes))
          .end_object();
    w.end_array();
    w.key("host").begin_object().key("bytes").num(int64_t(p.host_bytes)).end_object();
    w.key("disk").begin_object().key("blocks").num(p.disk_blocks).key("bytes").num(int64_t(p.disk_bytes)).end_object();
    w.end_object();
  }
  w.end_array().end_object();
  std::printf("%s\n", w.text().c_str());
}

/// The summary: the nodes, and each cache node's cache settings and what it allocates.
void print_summary(const std::string& path, const config_check& c) {
  std::string names;
  for (const auto& n : c.cfg.nodes) names += (names.empty() ? "" : ", ") + n.name;
  std::printf("%s: ok (%zu node%s: %s)\n", path.c_str(), c.cfg.nodes.size(), c.cfg.nodes.size() == 1 ? "" : "s",
              names.c_str());
  // Each node's effective cache settings ([cache] with its [node.cache] over it).
  for (const auto& n : c.cfg.nodes) {
    if (!n.has_role("cache")) continue;
    std::printf("  node %s: cache: %s; page_size %d\n", n.name.c_str(), config_detail::describe_cache(n.cache).c_str(),
                n.effective_page_size(c.cfg.lim));
    // What it allocates, pool by pool (when the model's layout is known here).
    for (const auto& p : c.plans) {
      if (p.node != n.name) continue;
      for (const auto& pool : p.pools)
        std::printf("    KV pool '%s'%s: %lld pages, %.1f MiB on the device\n", pool.name.c_str(),
                    pool.window_tokens > 0 ? fmt::format(" (window {})", pool.window_tokens).c_str() : "",
                    static_cast<long long>(pool.pages), double(pool.bytes) / (1024.0 * 1024.0));
      if (p.host_bytes > 0) {
        std::printf("    host tier: %.2f GiB%s\n", double(p.host_bytes) / (1024.0 * 1024.0 * 1024.0),
                    p.numa_node >= 0 ? fmt::format(" on NUMA node {}", p.numa_node).c_str() : "");
        for (const auto& pool : p.pools)
          std::printf("      pool '%s': %lld host pages, %.1f MiB (%.1f%%)\n", pool.name.c_str(),
                      static_cast<long long>(pool.host_pages), double(pool.host_bytes) / (1024.0 * 1024.0),
                      100.0 * double(pool.host_bytes) / double(p.host_bytes));
      }
      if (p.disk_blocks > 0) {
        std::printf("    disk tier: %lld blocks (a file per pool each), %.2f GiB\n",
                    static_cast<long long>(p.disk_blocks), double(p.disk_bytes) / (1024.0 * 1024.0 * 1024.0));
        if (p.pools.size() > 1)
          for (const auto& pool : p.pools)
            std::printf("      pool '%s': %.1f MiB of files\n", pool.name.c_str(), double(pool.disk_bytes) / (1024.0 * 1024.0));
      }
    }
  }
}

}  // namespace

int check_config(args a) {
  flags f;
  f.sw("list-nodes", "if valid, print one line per node instead of the summary (columns below)");
  f.sw("json", "if valid, print the KV plan of every node as one JSON object instead of the summary");
  f.opt("node", "the node that runs on this machine: its model file must be readable here (as `serve --node` checks)");
  const char* usage = "usage: tandem check-config [--list-nodes | --json] [--node NAME] FILE\n"
                      "  checks a cluster config (TOML; see docs/config.md) without starting anything: the same checks\n"
                      "  and KV pool sizing `tandem serve --config FILE --node NAME` runs before it starts.\n"
                      "  --node NAME: the node of this machine; without it, the nodes whose host is this machine.\n"
                      "    The model file of a node on this machine must be readable here.\n"
                      "  --json: if the config is valid, print each cache node's KV plan (pools, host and disk tiers)\n"
                      "    as one JSON object on stdout.\n"
                      "  --list-nodes: if the config is valid, print one line per node on stdout, fields separated\n"
                      "    by tabs: name host numa_node roles(comma-joined) http_port rpc_port admin_port page_size\n"
                      "    api_key_file (page_size: the node's effective one; api_key_file: [security]'s, - = auth off).\n"
                      "    Fields may be appended later: read the first nine.\n"
                      "    Nothing is listed for an invalid config.\n"
                      "  exit code: 0 valid, 78 invalid or unreadable config (every problem is printed), 64 usage error\n";
  try {
    if (!f.parse(a)) {
      std::fputs(usage, stderr);
      return 0;
    }
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem check-config: %s\n%s", e.what(), usage);
    return exit_usage;
  }
  if (f.positional().size() != 1) {
    std::fprintf(stderr, "tandem check-config: expected one config file, got %zu arguments\n%s", f.positional().size(), usage);
    return exit_usage;
  }
  const std::string& path = f.positional()[0];
  config_check c;
  try {
    machine_info here = machine_info::probe(f.str("node"));
    here.cuda_devices = cuda_devices_here();
    c = check_cluster_config_file(path, here);
  } catch (const tandem::error& e) {
    std::fprintf(stderr, "tandem check-config: %s\n", e.what());
    return exit_config;
  }
  print_config_problems(c);
  if (!c.ok()) {
    std::fprintf(stderr, "%s: %zu problem%s; fix %s and check again\n", path.c_str(), c.errors.size(),
                 c.errors.size() == 1 ? "" : "s", c.errors.size() == 1 ? "it" : "them");
    return exit_config;
  }
  if (f.on("list-nodes")) {
    print_node_list(c);
    return 0;
  }
  if (f.on("json")) {
    print_plans_json(path, c);
    return exit_ok;
  }
  print_summary(path, c);
  return exit_ok;
}

}  // namespace tandem::cli
