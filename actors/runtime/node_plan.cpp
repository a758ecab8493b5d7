#include "actors/runtime/node_plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "actors/common/limits_table.h"
#include "actors/config/cluster_config.h"
#include "kernels/model/llama.h"

namespace tandem {

namespace {

/// Whether every limit is within its own bounds (the sizing divides by some of them).
bool fields_in_range(const limits& lim) {
  for (const auto& f : limit_fields())
    if (f.is_integer() && !check_limit(f, f.get(lim)).empty()) return false;
  return true;
}

int32_t page_count(int64_t pages) { return static_cast<int32_t>(std::clamp<int64_t>(pages, 1, int64_t(1) << 30)); }

}  // namespace

const char* to_string(node_role r) {
  switch (r) {
    case node_role::router: return "router";
    case node_role::prefill: return "prefill";
    case node_role::decode: return "decode";
    case node_role::cache: return "cache";
    case node_role::worker: return "worker";
  }
  return "router";
}

std::optional<node_role> parse_node_role(std::string_view name) {
  for (auto r : {node_role::router, node_role::prefill, node_role::decode, node_role::cache, node_role::worker})
    if (name == to_string(r)) return r;
  return std::nullopt;
}

std::vector<std::string> role_names(const std::vector<node_role>& roles) {
  std::vector<std::string> out;
  for (auto r : roles) out.emplace_back(to_string(r));
  return out;
}

bool node_plan::has(node_role role) const {
  return spec.roles.empty() || std::find(spec.roles.begin(), spec.roles.end(), role) != spec.roles.end();
}

std::string node_plan::remote_decode_node() const {
  if (has(node_role::decode)) return "";
  for (const auto& n : spec.remote_nodes)
    if (std::find(n.roles.begin(), n.roles.end(), to_string(node_role::decode)) != n.roles.end()) return n.name;
  return "";
}

model_shape shape_of(const llama_model& model, int32_t eos_id) {
  model_shape m;
  m.layout = [&model](int32_t page_size) { return model.layout(page_size); };
  m.pools = [&model](int32_t page_size) { return model.pools_layout(page_size); };
  m.n_ctx = model.config().n_ctx;
  m.n_vocab = model.config().n_vocab;
  m.eos_id = eos_id;
  return m;
}

node_spec spec_of(const cluster_config& cfg, const node_config& node) {
  node_spec s;
  s.lim = cfg.lim;
  s.lim.page_size = node.effective_page_size(cfg.lim);
  s.cache = node.cache;
  s.node_name = node.name;
  s.ports = {node.host, node.http_port, node.rpc_port, node.admin_port, node.kv_port};
  // The config check refused an unknown policy name; round_robin is the default.
  s.policy.kind = parse_route_policy(cfg.router_policy).value_or(route_policy_kind::round_robin);
  s.policy.balance_abs_tokens = cfg.router_balance_abs_tokens;
  s.policy.balance_rel = cfg.router_balance_rel;
  if (node.all_roles()) return s;  // an embedded cluster: every role here, no links
  for (const auto& r : node.roles)
    if (auto k = parse_node_role(r)) s.roles.push_back(*k);  // the config check refused other names
  s.cluster_host = node.host;
  s.cluster_port = node.cluster_port;
  for (const auto& n : cfg.nodes)
    if (n.name != node.name) s.remote_nodes.push_back({n.name, n.host, n.cluster_port, n.roles, {}});
  s.transfer_failure_policy = cfg.transfer_failure_policy;
  return s;
}

node_plan plan_node(const node_spec& spec, const model_shape& model, uint64_t host_ram_bytes) {
  node_plan p;
  p.spec = spec;
  const limits& lim = p.spec.lim;
  p.error = lim.validate();
  p.holds_kv = p.has(node_role::worker) || p.has(node_role::cache);
  p.prefix_cache = lim.prefix_cache && spec.cache.enabled;
  int32_t max_context = model.n_ctx > 0 ? model.n_ctx : lim.max_context;
  if (lim.max_context > 0) max_context = std::min(max_context, lim.max_context);
  p.model = model_facts{model.eos_id, max_context, model.n_vocab};
  if (!fields_in_range(lim)) return p;  // `error` names the field

  p.layout = model.layout(lim.page_size);
  p.pools = model.pools(lim.page_size);
  if (p.ok() && max_context <= 1)
    p.error = fmt::format("context length {} is too small; set limits.max_context > 1", max_context);
  // Only a node with a worker or cache tier allocates pools (check-config checks those).
  p.sizing = size_kv_pools(lim, spec.cache, p.pools, host_ram_bytes);
  const auto& k = p.sizing;
  if (p.ok() && !k.ok() && p.holds_kv) {
    p.error = k.problems.size() == 1 ? "invalid KV cache settings: " : "invalid KV cache settings:";
    for (const auto& problem : k.problems) p.error += (k.problems.size() == 1 ? "" : "\n  ") + problem;
  }
  p.n_pages = page_count(k.device_pages);
  for (size_t i = 1; i < k.pool_pages.size(); ++i) p.extra_pages.push_back(page_count(k.pool_pages[i]));
  p.host_pages = static_cast<int32_t>(k.host_pages);
  for (size_t i = 1; i < k.host_pool_pages.size(); ++i) p.extra_host_pages.push_back(static_cast<int32_t>(k.host_pool_pages[i]));
  p.disk_pages = k.disk_pages;
  return p;
}

}  // namespace tandem
