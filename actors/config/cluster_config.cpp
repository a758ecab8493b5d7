#include "actors/config/cluster_config.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "actors/config/cache_table.h"
#include "actors/config/config_checker.h"
#include "actors/config/node_memory.h"
#include "actors/common/limits_table.h"
#include "actors/config/toml.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/isa.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/arch/registry.h"
#include "kernels/model/kv_pool.h"

namespace tandem {

namespace {

using toml::value;
using toml::value_type;
using config_detail::checker;
using config_detail::article_type;
using config_detail::fmt_gib;
using config_detail::gib;


/// [security]: the key file must exist and be private (the same rules `tandem serve` enforces
/// when it reads the keys); allowlisted paths are absolute.
void check_security(checker& ck, const value& t, cluster_config& cfg) {
  ck.known_keys(t, "security", {"api_key_file", "auth_allowlist"});
  if (ck.string(t, "security", "api_key_file", cfg.api_key_file)) {
    const value* v = t.find("api_key_file");
    struct stat st {};
    if (cfg.api_key_file.empty())
      ck.error(v->pos, "security.api_key_file", v, "is empty; give a file with one key per line, or drop the key (auth off)");
    else if (::stat(cfg.api_key_file.c_str(), &st) != 0)
      ck.error(v->pos, "security.api_key_file", v,
               fmt::format("{}; create it with one key per line (e.g. `openssl rand -hex 32 > FILE`) and chmod 600 it",
                           std::strerror(errno)));
    else if (!S_ISREG(st.st_mode))
      ck.error(v->pos, "security.api_key_file", v, "is not a regular file; give a file with one key per line");
    else if (st.st_mode & (S_IRWXG | S_IRWXO))
      ck.error(v->pos, "security.api_key_file", v,
               fmt::format("is accessible by group or others (mode {:03o}); run `chmod 600 {}`", st.st_mode & 0777,
                           cfg.api_key_file));
  }
  if (const value* v = t.find("auth_allowlist")) {
    bool ok = v->type == value_type::array;
    std::vector<std::string> paths;
    if (ok)
      for (const auto& e : v->items) {
        if (e.type != value_type::string || e.str.empty() || e.str[0] != '/') ok = false;
        else paths.push_back(e.str);
      }
    if (!ok)
      ck.error(v->pos, "security.auth_allowlist", v,
               "expected an array of absolute paths; write auth_allowlist = [\"/health\"] (add \"/metrics\" for an "
               "unauthenticated Prometheus scrape)");
    else
      cfg.auth_allowlist = std::move(paths);
  }
}

/// Addresses that reach this machine; the RAM and NUMA checks apply to nodes on them.
bool is_local_host(const std::string& h) {
  if (h == "127.0.0.1" || h == "localhost" || h == "::1" || h == "0.0.0.0" || h == "::") return true;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && h == name) return true;
  return false;
}

/// Hosts that name the same machine share one port space.
std::string host_key(const std::string& h) { return is_local_host(h) ? std::string("<this machine>") : h; }

struct model_kv {
  bool known = false;
  model_config config;  ///< what the architecture module read (shapes the KV layout)
  int32_t n_ctx = 0;
  /// Bytes of the copy `kernels = "amx"` makes of the f16/bf16 matmul weights (padded to
  /// whole 16 x 32 tiles, as amx_pack does).
  uint64_t amx_copy_bytes = 0;
  kv_dtype dtype = kv_dtype::f32;  ///< [model] kv_cache_dtype
  kv_layout layout(int32_t page_size) const { return model_kv_layout(config, page_size, dtype); }
  kv_pools_layout pools(int32_t page_size) const { return model_pools_layout(config, page_size, dtype); }
};

/// The KV shape from GGUF metadata alone, read by the same architecture module the loader
/// uses (kernels/model/arch), without touching the weights.
model_kv read_model_kv(const std::string& path) {
  auto f = gguf::file::open(path);
  model_kv m;
  m.config = arch::read_config(f);
  m.n_ctx = m.config.n_ctx;
  // The matmul weights: every 2-D tensor but the embedding table, which is a matmul only as
  // the tied output (no output.weight).
  const bool tied = f.find_tensor("output.weight") == nullptr;
  for (const auto& t : f.tensors()) {
    if (t.dims.size() != 2 || (t.type != ggml_type::f16 && t.type != ggml_type::bf16)) continue;
    if (t.name == "token_embd.weight" && !tied) continue;
    m.amx_copy_bytes += cpu::amx_packed_bytes(t.view());
  }
  m.known = true;
  return m;
}

}  // namespace

config_check check_cluster_config(const std::string& text, const std::string& source_name, const machine_info& m) {
  config_check out;
  cluster_config& cfg = out.cfg;
  value root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    out.errors.push_back(std::string(e.what()) + " (syntax error; nothing else was checked)");
    return out;
  }
  checker ck(source_name, out.errors);
  ck.known_keys(root, "", {"limits", "model", "cache", "node", "router", "transfer", "security"});
  size_t errors_before_limits = out.errors.size();

  // --- [limits]
  bool limits_threads_set = false;
  const value* lim_t = ck.table(root, "limits");
  if (lim_t) {
    std::vector<std::string> known;
    for (const auto& f : limit_fields()) known.push_back(f.key);
    ck.known_keys(*lim_t, "limits", known);
    for (const auto& f : limit_fields()) {
      if (!f.is_integer()) {
        bool b = false;
        if (ck.boolean(*lim_t, "limits", f.key, b)) f.set(cfg.lim, b);
        continue;
      }
      int64_t v = 0;
      if (ck.integer(*lim_t, "limits", f.key, f.min, f.max, f.fix, v)) {
        f.set(cfg.lim, v);
        if (std::string(f.key) == "threads") limits_threads_set = true;
      }
    }
  }
  toml::position lim_pos = lim_t ? lim_t->pos : toml::position{1, 1};

  // --- [model]
  toml::position model_path_pos{1, 1};
  if (const value* t = ck.table(root, "model")) {
    ck.known_keys(*t, "model", {"path", "threads", "kernels", "kv_cache_dtype", "backend", "device"});
    ck.choice(*t, "model", "kv_cache_dtype", {"f32", "f16"}, cfg.kv_cache_dtype);
    int64_t dev = 0;
    if (ck.integer(*t, "model", "device", 0, 1023, "use the CUDA device index, e.g. 0", dev))
      cfg.device = static_cast<int32_t>(dev);
    if (ck.choice(*t, "model", "backend", {"cpu", "cuda"}, cfg.backend) && cfg.backend == "cuda") {
      const value* b = t->find("backend");
      if (m.cuda_devices < 0)
        ck.error(b->pos, "model.backend", b,
                 "this tandem was built without the CUDA backend; rebuild it with -DTANDEM_CUDA=ON (cmake --preset "
                 "cuda, needs nvcc) or use backend = \"cpu\"");
      else if (cfg.device >= m.cuda_devices)
        ck.error(b->pos, "model.backend", b,
                 m.cuda_devices == 0
                     ? std::string("no CUDA device is visible here (no driver or no GPU); use backend = \"cpu\"")
                     : fmt::format("[model] device = {} but this machine has {} CUDA device{}; use a device in "
                                   "0..{}",
                                   cfg.device, m.cuda_devices, m.cuda_devices == 1 ? "" : "s", m.cuda_devices - 1));
    }
    // The kernel path: every name is checked, and one this machine cannot run is refused
    // here rather than when the worker builds the model.
    std::vector<std::string> paths;
    for (cpu_isa i : cpu::all_isas) paths.emplace_back(cpu::to_string(i));
    if (ck.choice(*t, "model", "kernels", paths, cfg.kernel_isa) && !m.kernel_paths.empty() &&
        std::find(m.kernel_paths.begin(), m.kernel_paths.end(), cfg.kernel_isa) == m.kernel_paths.end()) {
      std::string list;
      for (const auto& k : m.kernel_paths) list += (list.empty() ? "" : ", ") + k;
      ck.error(t->find("kernels")->pos, "model.kernels", t->find("kernels"),
               fmt::format("this machine cannot run the {} kernels; use one of: {}", cfg.kernel_isa, list));
    }
    if (ck.string(*t, "model", "path", cfg.model_path)) {
      model_path_pos = t->find("path")->pos;
      if (cfg.model_path.empty())
        ck.error(model_path_pos, "model.path", t->find("path"), "is empty; give the GGUF file every node loads, or drop the key");
    }
    int64_t th = 0;
    if (ck.integer(*t, "model", "threads", 1, 4096, "use the number of cores to compute on", th)) {
      if (limits_threads_set && th != cfg.lim.threads)
        ck.error(t->find("threads")->pos, "model.threads", t->find("threads"),
                 fmt::format("conflicts with limits.threads = {}; set only one of them", cfg.lim.threads));
      cfg.lim.threads = int32_t(th);
    }
  }

  // Cross-field limits (only once every field was readable, so one mistake is not reported twice).
  if (out.errors.size() == errors_before_limits) {
    if (auto msg = cfg.lim.validate(); !msg.empty())
      out.errors.push_back(fmt::format("{}:{}:{}: {}", source_name, lim_pos.line, lim_pos.column, msg));
  }

  // --- [cache] (types and ranges; the tier's own rules live in validate_cache_config)
  toml::position cache_pos{1, 1};
  if (const value* t = ck.table(root, "cache")) {
    cache_pos = t->pos;
    config_detail::read_cache_table(ck, *t, "cache", cfg.cache);
    // The checks that need the model's KV layout (size_kv_pools) run with the layout below.
  }

  // --- [router], [transfer]
  if (const value* t = ck.table(root, "router")) {
    ck.known_keys(*t, "router", {"policy", "balance_abs_tokens", "balance_rel", "migration"});
    ck.choice(*t, "router", "policy", {"round_robin", "power_of_two", "cache_aware"}, cfg.router_policy);
    // cache_aware leaves a target with the cached prefix once it holds more than
    // balance_abs_tokens more queued tokens than the least loaded one AND more than
    // balance_rel times as many: below 1x every choice would fall back (no cache affinity).
    int64_t abs_tokens = 0;
    if (ck.integer(*t, "router", "balance_abs_tokens", 0, int64_t(1) << 40,
                   "use e.g. 2048 (prompt tokens; 0 = the relative threshold alone decides)", abs_tokens))
      cfg.router_balance_abs_tokens = abs_tokens;
    double rel = 0;
    if (ck.real(*t, "router", "balance_rel", 1.0, 1e6,
                "use e.g. 1.5 (times the least loaded target's queued tokens; 1 = balance as soon as busier)", rel))
      cfg.router_balance_rel = rel;
    ck.boolean(*t, "router", "migration", cfg.lim.router_migration);
  }
  if (const value* t = ck.table(root, "transfer")) {
    ck.known_keys(*t, "transfer", {"failure_policy", "timeout_ms"});
    std::string policy = to_string(cfg.transfer_failure_policy);
    if (ck.choice(*t, "transfer", "failure_policy", {"recompute", "fail"}, policy))
      cfg.transfer_failure_policy = parse_kv_failure_policy(policy).value_or(cfg.transfer_failure_policy);
    int64_t v = 0;
    if (ck.integer(*t, "transfer", "timeout_ms", 1, 3600000, "use e.g. 10000 (10 s)", v))
      cfg.transfer_timeout_ms = int32_t(v);
  }

  // --- [security]
  if (const value* t = ck.table(root, "security")) check_security(ck, *t, cfg);

  // --- [[node]]
  const value* nodes_v = root.find("node");
  if (!nodes_v) {
    out.errors.push_back(fmt::format(
        "{}:1:1: node: no [[node]] entries; add one per process, e.g. [[node]] name = \"n0\" roles = [\"router\", "
        "\"prefill\", \"decode\", \"cache\", \"worker\"]",
        source_name));
  } else if (nodes_v->type != value_type::array || !nodes_v->from_array_of_tables) {
    ck.error(nodes_v->pos, "node", nullptr,
             fmt::format("is {}, not an array of tables; write each node as [[node]] (double brackets)",
                         article_type(nodes_v->type)));
    nodes_v = nullptr;
  }
  std::vector<const value*> node_tables;
  if (nodes_v)
    for (const auto& t : nodes_v->items) node_tables.push_back(&t);
  bool single = node_tables.size() == 1;
  std::map<std::string, std::string> port_owner;  // "<host>:<port>" -> "node 'x' http_port"
  std::set<std::string> names;
  for (size_t idx = 0; idx < node_tables.size(); ++idx) {
    const value& t = *node_tables[idx];
    node_config n;
    n.line = t.pos.line;
    std::string tname = fmt::format("node[{}]", idx);
    ck.known_keys(t, tname, {"name", "host", "roles", "http_port", "rpc_port", "admin_port", "numa_node", "page_size",
                            "cluster_port", "kv_port", "cache"});
    // [node.cache]: this node's cache settings over the cluster's [cache] (same rules).
    n.cache = cfg.cache;
    if (const value* ct = t.find("cache")) {
      if (ct->type != value_type::table)
        ck.error(ct->pos, tname + ".cache", ct,
                 fmt::format("expected a table, got {}; write a [node.cache] header below this [[node]]",
                             article_type(ct->type)));
      else
        config_detail::read_cache_table(ck, *ct, tname + ".cache", n.cache);
    }
    if (!ck.string(t, tname, "name", n.name)) {
      if (!t.find("name"))
        ck.error(t.pos, tname + ".name", nullptr, "is missing; give every node a unique name = \"...\"");
    } else {
      bool ok_chars = !n.name.empty() && std::all_of(n.name.begin(), n.name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
      });
      if (!ok_chars)
        ck.error(t.find("name")->pos, tname + ".name", t.find("name"),
                 "is not a node name; use letters, digits, '-', '_' and '.' (it is passed to --node)");
      else if (!names.insert(n.name).second)
        ck.error(t.find("name")->pos, tname + ".name", t.find("name"), "is used by another node; node names must be unique");
    }
    std::string label = n.name.empty() ? tname : fmt::format("{} ('{}')", tname, n.name);
    if (ck.string(t, tname, "host", n.host) && n.host.empty())
      ck.error(t.find("host")->pos, tname + ".host", t.find("host"), "is empty; give the address the node binds, e.g. \"10.0.0.5\"");
    if (const value* r = t.find("roles")) {
      if (r->type != value_type::array) {
        ck.error(r->pos, tname + ".roles", r,
                 fmt::format("expected an array of strings, got {}; write roles = [\"prefill\", \"cache\", \"worker\"]",
                             article_type(r->type)));
      } else {
        if (r->items.empty())
          ck.error(r->pos, tname + ".roles", r, "is empty; a node needs at least one of router, prefill, decode, cache, worker");
        for (const auto& item : r->items) {
          if (item.type != value_type::string) {
            ck.error(item.pos, tname + ".roles", &item, "is not a role name; roles are strings like \"decode\"");
            continue;
          }
          const auto& known = node_roles();
          if (std::find(known.begin(), known.end(), item.str) == known.end()) {
            std::string guess = did_you_mean(item.str, known);
            ck.error(item.pos, tname + ".roles", &item,
                     fmt::format("unknown role; {}use router, prefill, decode, cache or worker",
                                 guess.empty() ? "" : "did you mean '" + guess + "'? "));
            continue;
          }
          if (n.has_role(item.str)) {
            ck.error(item.pos, tname + ".roles", &item, "is listed twice; list each role once");
            continue;
          }
          n.roles.push_back(item.str);
        }
      }
    } else {
      ck.error(t.pos, tname + ".roles", nullptr,
               "is missing; list what the node runs, e.g. roles = [\"decode\", \"cache\", \"worker\"]");
    }
    int64_t v = 0;
    for (auto [key, member] : {std::pair{"http_port", &node_config::http_port}, std::pair{"rpc_port", &node_config::rpc_port},
                               std::pair{"admin_port", &node_config::admin_port}}) {
      if (ck.integer(t, tname, key, 0, 65535, "use a TCP port 1..65535", v)) {
        if (v == 0 && !single) {
          ck.error(t.find(key)->pos, tname + "." + key, t.find(key),
                   "0 (any free port) only works for a single-node cluster: peers must know the port; give a fixed port");
          continue;
        }
        n.*member = int32_t(v);
      }
    }
    for (auto [key, member] : {std::pair{"cluster_port", &node_config::cluster_port},
                               std::pair{"kv_port", &node_config::kv_port}}) {
      if (ck.integer(t, tname, key, 1, 65535, "use a TCP port 1..65535 (omit the key for none)", v))
        n.*member = int32_t(v);
    }
    if (ck.integer(t, tname, "numa_node", -1, 1023, "use -1 (not pinned) or a NUMA node id", v)) {
      n.numa_node = int32_t(v);
      if (n.numa_node >= 0 && is_local_host(n.host) && !m.numa_node_bytes.empty() &&
          size_t(n.numa_node) >= m.numa_node_bytes.size())
        ck.error(t.find("numa_node")->pos, tname + ".numa_node", t.find("numa_node"),
                 fmt::format("this machine has NUMA nodes 0..{}; use one of them or -1", m.numa_node_bytes.size() - 1));
    }
    if (ck.integer(t, tname, "page_size", 1, 4096, "use 16 tokens per page, the same on every prefill and decode node", v))
      n.page_size = int32_t(v);
    // Ports: within a node and across nodes on the same host.
    for (auto [key, port] : {std::pair{"http_port", n.http_port}, std::pair{"rpc_port", n.rpc_port},
                             std::pair{"admin_port", n.admin_port}, std::pair{"cluster_port", n.cluster_port},
                             std::pair{"kv_port", n.kv_port}}) {
      if (port == 0) continue;
      std::string where = fmt::format("{}.{}", label, key);
      std::string k = host_key(n.host) + ":" + std::to_string(port);
      auto [it, fresh] = port_owner.emplace(k, where);
      if (!fresh) {
        const value* pv = t.find(key);
        ck.error(pv ? pv->pos : t.pos, tname + "." + key, pv,
                 fmt::format("port {} on host {} is already taken by {}; give each port of a host to one listener",
                             port, n.host, it->second));
      }
    }
    cfg.nodes.push_back(std::move(n));
  }

  // --- roles across the cluster
  if (!node_tables.empty()) {
    auto with_role = [&](const std::string& r) {
      std::vector<const node_config*> v;
      for (const auto& n : cfg.nodes)
        if (n.has_role(r)) v.push_back(&n);
      return v;
    };
    auto routers = with_role("router");
    toml::position first = nodes_v->pos;
    if (routers.empty())
      ck.error(first, "node.roles", nullptr, "no node has the role \"router\"; give exactly one node the router role");
    if (routers.size() > 1) {
      std::string list;
      for (auto* n : routers) list += (list.empty() ? "'" : ", '") + n->name + "'";
      ck.error(first, "node.roles", nullptr,
               fmt::format("{} nodes have the role \"router\" ({}); keep it on exactly one node", routers.size(), list));
    }
    if (with_role("prefill").empty())
      ck.error(first, "node.roles", nullptr, "no node has the role \"prefill\"; give at least one node the prefill role");
    if (with_role("decode").empty())
      ck.error(first, "node.roles", nullptr, "no node has the role \"decode\"; give at least one node the decode role");
    for (size_t i = 0; i < cfg.nodes.size(); ++i) {
      const auto& n = cfg.nodes[i];
      bool computes = n.has_role("prefill") || n.has_role("decode");
      toml::position p = node_tables[i]->pos;
      for (const char* need : {"worker", "cache"}) {
        if (computes && !n.has_role(need))
          ck.error(p, fmt::format("node[{}].roles", i), nullptr,
                   fmt::format("node '{}' runs a scheduler but no {}: prefill and decode drive a local worker and cache "
                               "tier; add \"{}\" to its roles",
                               n.name, need, need));
        if (!computes && n.has_role(need))
          ck.error(p, fmt::format("node[{}].roles", i), nullptr,
                   fmt::format("node '{}' has a {} but no prefill or decode to use it; add a scheduler role or remove \"{}\"",
                               n.name, need, need));
      }
    }
    // Links between nodes: the middleman port of every node, the KV listener of every prefill
    // node whose decode is elsewhere.
    if (cfg.nodes.size() > 1) {
      for (size_t i = 0; i < cfg.nodes.size(); ++i) {
        const auto& n = cfg.nodes[i];
        toml::position p = node_tables[i]->pos;
        if (n.cluster_port == 0)
          ck.error(p, fmt::format("node[{}].cluster_port", i), nullptr,
                   fmt::format("node '{}' has no cluster_port: in a cluster of {} nodes the actors of the other nodes "
                               "reach this one's there; add cluster_port = <free TCP port>",
                               n.name, cfg.nodes.size()));
        if (n.has_role("prefill") && !n.has_role("decode") && n.kv_port == 0)
          ck.error(p, fmt::format("node[{}].kv_port", i), nullptr,
                   fmt::format("prefill node '{}' has no kv_port: its decode runs on another node, which connects "
                               "there to receive KV pages over UCX; add kv_port = <free TCP port>",
                               n.name));
      }
    }
    // Page sizes: KV pages move between prefill and decode nodes as they are.
    const node_config* ref = nullptr;
    for (size_t i = 0; i < cfg.nodes.size(); ++i) {
      const auto& n = cfg.nodes[i];
      if (!(n.has_role("prefill") || n.has_role("decode"))) continue;
      int32_t ps = n.page_size ? n.page_size : cfg.lim.page_size;
      if (!ref) {
        ref = &n;
        continue;
      }
      int32_t ref_ps = ref->page_size ? ref->page_size : cfg.lim.page_size;
      if (ps != ref_ps) {
        const value* pv = node_tables[i]->find("page_size");
        ck.error(pv ? pv->pos : node_tables[i]->pos, fmt::format("node[{}].page_size", i), pv,
                 fmt::format("node '{}' uses {} tokens per page but node '{}' uses {}; KV pages move between prefill "
                             "and decode as they are, so use one page size on all of them",
                             n.name, ps, ref->name, ref_ps));
      }
    }
  }

  // --- the model's KV layout and memory
  // Nodes on this machine: the model file must be readable here, and their memory is counted.
  auto on_this_machine = [&](const node_config& n) { return n.name == m.node || is_local_host(n.host); };
  std::string local_names;
  for (const auto& n : cfg.nodes)
    if (on_this_machine(n)) local_names += (local_names.empty() ? "'" : ", '") + n.name + "'";
  if (!m.node.empty() && !cfg.find_node(m.node) && !cfg.nodes.empty()) {
    std::string names;
    for (const auto& n : cfg.nodes) names += (names.empty() ? "" : ", ") + n.name;
    out.errors.push_back(fmt::format("{}:1:1: node: there is no node '{}' (--node); use one of: {}", source_name, m.node,
                                     names));
  }
  model_kv kv;
  std::error_code model_ec;
  const bool model_here = !cfg.model_path.empty() && std::filesystem::exists(cfg.model_path, model_ec);
  if (model_here) {
    try {
      kv = read_model_kv(cfg.model_path);
      parse_kv_dtype(cfg.kv_cache_dtype, kv.dtype);  // checked above: f32 or f16
      (void)kv.layout(16);  // a cache type the architecture cannot hold (f16 for MLA) fails here
    } catch (const std::exception& e) {
      kv = model_kv{};
      out.errors.push_back(fmt::format("{}:{}:{}: model.path = \"{}\": is not a usable GGUF model ({}); point it at a "
                                       "model written by llama.cpp or `tandem make-model`",
                                       source_name, model_path_pos.line, model_path_pos.column, cfg.model_path, e.what()));
    }
  } else if (!cfg.model_path.empty() && !local_names.empty()) {
    // `tandem serve` of these nodes would fail loading it: refuse now, once, with the fix.
    out.errors.push_back(fmt::format(
        "{}:{}:{}: model.path = \"{}\": {}; node{} {} run{} on this machine and load{} it: copy the model here or fix "
        "the path",
        source_name, model_path_pos.line, model_path_pos.column, cfg.model_path,
        model_ec ? model_ec.message() : std::string("no such file"), local_names.find(',') == std::string::npos ? "" : "s",
        local_names, local_names.find(',') == std::string::npos ? "s" : "", local_names.find(',') == std::string::npos ? "s" : ""));
  } else if (!cfg.model_path.empty()) {
    out.notes.push_back(fmt::format("model.path = \"{}\" is not on this machine and no node of this config runs here: the "
                                    "KV layout checks were skipped; run `tandem check-config --node NAME` on each node's "
                                    "machine",
                                    cfg.model_path));
  } else if (!m.node.empty()) {
    out.errors.push_back(fmt::format("{}:1:1: model.path: is not set, and node '{}' needs it; add [model] path = "
                                     "\"FILE.gguf\"",
                                     source_name, m.node));
  }
  if (kv.known && cfg.lim.max_context > kv.n_ctx)
    out.errors.push_back(fmt::format("{}:{}:{}: limits.max_context = {}: the model's context is {} tokens; use at most {} "
                                     "(0 = the model's)",
                                     source_name, lim_pos.line, lim_pos.column, cfg.lim.max_context, kv.n_ctx, kv.n_ctx));
  // Each node's pools and tiers, and whether they fit this machine (node_memory.cpp).
  config_detail::node_memory_inputs mem;
  mem.source_name = source_name;
  mem.lim_pos = lim_pos;
  mem.cache_pos = cache_pos;
  for (size_t i = 0; i < cfg.nodes.size(); ++i) {
    const value* own = i < node_tables.size() ? node_tables[i]->find("cache") : nullptr;
    mem.node_cache_pos.push_back(own && own->type == value_type::table ? own->pos : cache_pos);
  }
  if (kv.known) {
    mem.model.layout = [kv](int32_t ps) { return kv.layout(ps); };
    mem.model.pools = [kv](int32_t ps) { return kv.pools(ps); };
    mem.model.n_ctx = kv.n_ctx;
    if (cfg.kernel_isa == "amx") mem.amx_copy_bytes = kv.amx_copy_bytes;
  }
  mem.on_this_machine = on_this_machine;
  config_detail::check_node_memory(mem, m, out);
  return out;
}

config_check check_cluster_config_file(const std::string& path, const machine_info& m) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tandem::error(fmt::format("cannot read config file '{}'; check the path and its permissions", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw tandem::error(fmt::format("error reading config file '{}'", path));
  return check_cluster_config(ss.str(), path, m);
}

}  // namespace tandem
