#include "actors/config/node_table.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "actors/config/cache_table.h"

namespace tandem::config_detail {

bool is_local_host(const std::string& h) {
  if (h == "127.0.0.1" || h == "localhost" || h == "::1" || h == "0.0.0.0" || h == "::") return true;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && h == name) return true;
  return false;
}

namespace {

/// Hosts that name the same machine share one port space.
std::string host_key(const std::string& h) { return is_local_host(h) ? std::string("<this machine>") : h; }

/// What the node tables read so far hold: names and ports must be unique.
struct nodes_seen {
  std::map<std::string, std::string> port_owner;  // "<host>:<port>" -> "node 'x' http_port"
  std::set<std::string> names;
};

/// The [[node]] tables of `root` (none, or not an array of tables: reported).
std::vector<const value*> node_tables_of(checker& ck, const value& root, const std::string& source_name,
                                         std::vector<std::string>& errors) {
  const value* nodes_v = root.find("node");
  if (!nodes_v) {
    errors.push_back(fmt::format(
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
  return node_tables;
}

/// name = "...": present, a valid name, unique.
void read_node_name(checker& ck, const value& t, const std::string& tname, nodes_seen& seen, node_config& n) {
  auto& names = seen.names;
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
}

/// roles = [...]: known names, each once.
void read_node_roles(checker& ck, const value& t, const std::string& tname, node_config& n) {
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
}

/// http_port, rpc_port, admin_port (0 = any: single-node clusters only), cluster_port, kv_port.
void read_node_ports(checker& ck, const value& t, const std::string& tname, bool single, node_config& n) {
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
}

/// Each port of a host to one listener, within a node and across nodes.
void check_port_owners(checker& ck, const value& t, const std::string& tname, const node_config& n, nodes_seen& seen) {
  auto& port_owner = seen.port_owner;
  std::string label = n.name.empty() ? tname : fmt::format("{} ('{}')", tname, n.name);
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
}

/// One [[node]] table (its index `idx` names it in messages).
node_config read_node(checker& ck, const value& t, size_t idx, bool single, const machine_info& m,
                      const cluster_config& cfg, nodes_seen& seen) {
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
  read_node_name(ck, t, tname, seen, n);
  if (ck.string(t, tname, "host", n.host) && n.host.empty())
    ck.error(t.find("host")->pos, tname + ".host", t.find("host"), "is empty; give the address the node binds, e.g. \"10.0.0.5\"");
  read_node_roles(ck, t, tname, n);
  read_node_ports(ck, t, tname, single, n);
  int64_t v = 0;
  if (ck.integer(t, tname, "numa_node", -1, 1023, "use -1 (not pinned) or a NUMA node id", v)) {
    n.numa_node = int32_t(v);
    if (n.numa_node >= 0 && is_local_host(n.host) && !m.numa_node_bytes.empty() &&
        size_t(n.numa_node) >= m.numa_node_bytes.size())
      ck.error(t.find("numa_node")->pos, tname + ".numa_node", t.find("numa_node"),
               fmt::format("this machine has NUMA nodes 0..{}; use one of them or -1", m.numa_node_bytes.size() - 1));
  }
  if (ck.integer(t, tname, "page_size", 1, 4096, "use 16 tokens per page, the same on every prefill and decode node", v))
    n.page_size = int32_t(v);
  check_port_owners(ck, t, tname, n, seen);
  return n;
}

/// One router, at least one prefill and one decode node.
void check_role_counts(checker& ck, const cluster_config& cfg, toml::position first) {
  auto with_role = [&](const std::string& r) {
    std::vector<const node_config*> v;
    for (const auto& n : cfg.nodes)
      if (n.has_role(r)) v.push_back(&n);
    return v;
  };
  auto routers = with_role("router");
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
}

/// A worker and a cache tier beside every scheduler, and only there.
void check_scheduler_companions(checker& ck, const cluster_config& cfg, const std::vector<const value*>& node_tables) {
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
}

/// Links between nodes of a cluster of several: a cluster_port each, a kv_port on prefill
/// nodes whose decode runs elsewhere.
void check_links(checker& ck, const cluster_config& cfg, const std::vector<const value*>& node_tables) {
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
}

/// One page size on every prefill and decode node.
void check_page_sizes(checker& ck, const cluster_config& cfg, const std::vector<const value*>& node_tables) {
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

}  // namespace

std::vector<const value*> read_nodes(checker& ck, const value& root, const std::string& source_name,
                                     const machine_info& m, cluster_config& cfg, std::vector<std::string>& errors) {
  const std::vector<const value*> node_tables = node_tables_of(ck, root, source_name, errors);
  const bool single = node_tables.size() == 1;
  nodes_seen seen;
  for (size_t idx = 0; idx < node_tables.size(); ++idx)
    cfg.nodes.push_back(read_node(ck, *node_tables[idx], idx, single, m, cfg, seen));
  return node_tables;
}

void check_node_roles(checker& ck, const cluster_config& cfg, const std::vector<const value*>& tables,
                      toml::position first) {
  check_role_counts(ck, cfg, first);
  check_scheduler_companions(ck, cfg, tables);
  check_links(ck, cfg, tables);
  check_page_sizes(ck, cfg, tables);
}

}  // namespace tandem::config_detail
