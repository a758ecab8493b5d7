#pragma once
/// The node plan: everything one node runs with, computed once from what the operator asked
/// (`node_spec`: a config file's node, serve's flags, or a test) and the model's KV shape.
/// `plan_node` is a pure function; `tandem check-config` (actors/config/node_memory.cpp) and
/// `actor_cluster` (what `tandem serve` runs) both call it, so the pools check-config prints
/// are the pools serve allocates. Each actor's options are views of the plan
/// (actors/runtime/node_plan_views.h), so a value such as the page size is stored once.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "actors/common/cache_config.h"
#include "actors/common/kv_failure_policy.h"
#include "actors/common/limits.h"
#include "actors/common/request.h"
#include "actors/router/router_policy.h"
#include "actors/runtime/remote_link.h"
#include "kernels/base/clock.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

struct cluster_config;
struct node_config;
class llama_model;

/// What a node runs: the roles of a [[node]] (their names, as the config and the links write
/// them: to_string).
enum class node_role : uint8_t { router, prefill, decode, cache, worker };
const char* to_string(node_role r);
/// The role named `name`, or nullopt (the config check refuses other names first).
std::optional<node_role> parse_node_role(std::string_view name);
/// The names of `roles`, in order (what the links and the log print).
std::vector<std::string> role_names(const std::vector<node_role>& roles);

/// Where a node listens for clients and peers (0 picks a free port): what `tandem serve` binds,
/// from the node's [[node]] or serve's flags, in one place.
struct node_ports {
  std::string host = "127.0.0.1";  ///< the front ends', the admin port's and the KV listener's address
  int32_t http = 8080;             ///< OpenAI HTTP API
  int32_t rpc = 8081;              ///< Cap'n Proto RPC
  int32_t admin = -1;              ///< `tandem inspect`; -1 = none
  int32_t kv = 0;                  ///< UCX KV transfer listener (a prefill node whose decode runs elsewhere)
};

/// What is asked of one node, before the model is known.
struct node_spec {
  /// lim.page_size is the node's tokens per KV page (a [[node]] page_size is already applied):
  /// the one page size of every pool and every actor of the node.
  limits lim;
  cache_config cache;  ///< hierarchical KV cache tiers (validated with the model's layout by plan_node)
  std::string node_name = "local";  ///< `node` label of the node health metrics; names the pool
  node_ports ports;                  ///< where it listens (the CAF ingress: cluster_host/port below)
  std::shared_ptr<const cluster_clock> clock;  ///< default: steady_clock
  int32_t router_tick_ms = 5;                  ///< deadline check period (real time)
  route_policy_options policy;                 ///< the router's target choice ([router] policy)

  // --- one node of a multi-node cluster (docs/kv_transfer.md); empty `roles` = every role here
  /// The roles of this node.
  std::vector<node_role> roles;
  /// Where this node's ingress listens for the other nodes (CAF middleman).
  std::string cluster_host = "127.0.0.1";
  int32_t cluster_port = 0;
  /// The other nodes; a role not on this node is reached on the first of them that has it.
  std::vector<remote_node> remote_nodes;
  // (how long start-up waits for them: limits.link_timeout_ms)
  kv_failure_policy transfer_failure_policy = kv_failure_policy::recompute;
};

/// The node `node` of a checked config: its limits with its page size, its effective cache
/// settings ([cache] with its [node.cache] over it), its ports, the router policy and, for a node without
/// every role, its roles, ingress and the other nodes. `serve --config` and `check-config` both
/// plan from it.
node_spec spec_of(const cluster_config& cfg, const node_config& node);

/// What the plan needs of the model: its KV layouts for a page size, its context and vocabulary.
struct model_shape {
  std::function<kv_layout(int32_t page_size)> layout;        ///< the one-pool layout
  std::function<kv_pools_layout(int32_t page_size)> pools;   ///< the layout set it serves
  int32_t n_ctx = 0;    ///< the model's context; 0 = unknown (limits.max_context decides)
  int32_t n_vocab = 0;
  int32_t eos_id = -1;  ///< the tokenizer's
};

/// A loaded model's shape (its layouts; `model` must outlive the shape's use).
model_shape shape_of(const llama_model& model, int32_t eos_id);

/// Everything one node runs with. Derived values only: the settings stay in `spec`.
struct node_plan {
  node_spec spec;
  /// eos, the context served (the model's, bounded by limits.max_context), the vocabulary.
  model_facts model;
  /// A worker or cache tier runs here, so the node allocates KV pools (a router-only node does not).
  bool holds_kv = false;
  kv_layout layout;       ///< the model's one-pool layout at spec.lim.page_size (disk files, tables)
  /// The layout set served: a sliding-window model keeps its window layers in a pool of rings
  /// (in every tier, and across nodes: transfers carry every pool).
  kv_pools_layout pools;
  /// size_kv_pools over `pools` (what check-config prints, byte by byte).
  kv_sizing sizing;
  int32_t n_pages = 0;                 ///< device pages of pool 0 (at least 1)
  std::vector<int32_t> extra_pages;    ///< device pages of pools 1..
  int32_t host_pages = 0;              ///< host (L2) pages of pool 0; 0 = no host tier
  std::vector<int32_t> extra_host_pages;  ///< host pages of pools 1..
  int64_t disk_pages = 0;              ///< L3 entries (a file per pool each); 0 = no disk tier
  bool prefix_cache = true;            ///< limits.prefix_cache and cache.enabled
  /// Why the node cannot start with this plan (the first reason, naming the fix); empty = it can.
  std::string error;

  bool ok() const { return error.empty(); }
  /// Whether `role` runs here.
  bool has(node_role role) const;
  /// Names this node's KV pool in page descriptors ("node/worker0").
  std::string pool_id() const { return spec.node_name + "/worker0"; }
  /// The first other node with the decode role when this node has none ("" otherwise): a
  /// prefill scheduler here hands off across nodes.
  std::string remote_decode_node() const;
};

/// Plans a node: checks the limits, sizes the context and the KV pools of every tier (the
/// `host_ram_bytes` of this machine bound the host tier; 0 = not checked). Never throws for bad
/// settings: `error` says why the node cannot start. Sizing is skipped (empty pools) only when a
/// limit is outside its own range.
node_plan plan_node(const node_spec& spec, const model_shape& model, uint64_t host_ram_bytes);

}  // namespace tandem
