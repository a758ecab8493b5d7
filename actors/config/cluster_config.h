#pragma once
/// The cluster config file (TOML) of a deployment: limits, model, cache, nodes and their
/// roles, router and transfer settings. `load_cluster_config` checks all of it before any
/// actor exists and reports every problem at once; `tandem check-config` and
/// `tandem serve --config` both go through it. The schema is documented in docs/config.md.
#include <cstdint>
#include <string>
#include <vector>

#include "actors/common/cache_config.h"
#include "actors/common/kv_failure_policy.h"
#include "actors/common/limits.h"

namespace tandem {

/// One process of the deployment.
struct node_config {
  std::string name;
  std::string host = "127.0.0.1";
  std::vector<std::string> roles;  ///< among router, prefill, decode, cache, worker
  int32_t http_port = 8080;        ///< OpenAI API (router nodes)
  int32_t rpc_port = 8081;         ///< Cap'n Proto RPC
  int32_t admin_port = 8082;       ///< admin interface (`tandem inspect`)
  int32_t numa_node = -1;          ///< -1 = not pinned
  int32_t page_size = 0;           ///< 0 = limits.page_size
  /// CAF middleman port: the node's ingress actor, where the other nodes' actors reach this
  /// one's (0 = none; needed by every node of a cluster of several nodes).
  int32_t cluster_port = 0;
  /// UCX listener of the KV transfer engine (0 = none; needed by prefill nodes whose decode is
  /// on another node: the decode nodes dial it).
  int32_t kv_port = 0;
  int32_t line = 0;                ///< where the [[node]] starts, for messages
  /// The node's effective cache settings: the cluster's [cache] with its [node.cache] over it.
  cache_config cache;
  /// The node's tokens per KV page: its page_size, else limits.page_size.
  int32_t effective_page_size(const limits& lim) const { return page_size ? page_size : lim.page_size; }

  bool has_role(const std::string& r) const;
  /// Has every role (router, prefill, decode, cache, worker): an embedded cluster.
  bool all_roles() const;
};

struct cluster_config {
  limits lim;
  std::string model_path;
  cache_config cache;  ///< [cache]: the default of every node (node_config::cache is the effective one)
  std::vector<node_config> nodes;
  std::string router_policy = "round_robin";        ///< round_robin | power_of_two | cache_aware
  /// [model] kernels: the CPU kernel path (best | scalar | avx2 | avx512 | amx).
  std::string kernel_isa = "best";
  /// [model] kv_cache_dtype: element type of the KV cache (f32 | f16; f16 halves the bytes
  /// per cached token and what a decode step's attention reads).
  std::string kv_cache_dtype = "f32";
  /// [model] backend: what the model runs on (cpu | cuda) and, for cuda, [model] device (index).
  std::string backend = "cpu";
  int32_t device = 0;
  /// [router] balance_abs_tokens / balance_rel: cache_aware's balance thresholds
  /// (route_policy_options; the defaults are the same).
  int64_t router_balance_abs_tokens = 2048;
  double router_balance_rel = 1.5;
  kv_failure_policy transfer_failure_policy = kv_failure_policy::recompute;
  int32_t transfer_timeout_ms = 10000;
  /// [security]: API keys of the external interfaces ("" = auth off) and the HTTP paths
  /// served without a key (docs/security.md).
  std::string api_key_file;
  std::vector<std::string> auth_allowlist = {"/health", "/health/ready"};

  /// nullptr if no node has that name.
  const node_config* find_node(const std::string& name) const;
  /// The nodes with role `role`, in file order.
  std::vector<const node_config*> nodes_with_role(const std::string& role) const;
};

/// What the checks know about the machine they run on.
struct machine_info {
  uint64_t mem_total_bytes = 0;      ///< 0 = unknown (not checked)
  uint64_t mem_available_bytes = 0;  ///< 0 = unknown
  /// MemTotal of each NUMA node, by node id; empty = unknown (ids are not checked).
  std::vector<uint64_t> numa_node_bytes;
  int32_t cpus = 0;
  /// The CPU kernel paths this machine runs (cpu::isa_supported), "best" first; empty =
  /// unknown (not checked).
  std::vector<std::string> kernel_paths;
  /// CUDA devices this build sees: -1 = a build without the CUDA backend (`tandem` fills it;
  /// backend = "cuda" is refused then, and for a device index beyond the count).
  int32_t cuda_devices = -1;
  /// Whether a worker here copies its low-bit matmul weights into the packed layout
  /// (kernels/cpu/quant_packed.h: AVX-512 VNNI, and TANDEM_PACK is not 0) on the avx512 and
  /// amx paths; the RAM check then counts the copy.
  bool packs_low_bit = false;
  /// Whether a CPU worker here copies the matmul weights it reads unpacked out of the file's
  /// mapping into memory (kernels/cpu/weight_copy.h: TANDEM_COPY_WEIGHTS is not 0); the RAM
  /// check then counts the copy.
  bool copies_weights = false;

  /// The node that runs on this machine (`check-config --node`, `serve --node`; "" = unknown):
  /// its model file must be readable here, whatever its host says.
  std::string node;

  /// Reads /proc/meminfo and /sys/devices/system/node/node*/meminfo; `node` as above.
  static machine_info probe(const std::string& node = "");
};

/// The roles a node may have.
const std::vector<std::string>& node_roles();

/// Levenshtein distance; for did-you-mean suggestions.
size_t edit_distance(const std::string& a, const std::string& b);
/// The candidate closest to `word` if it is close enough to be a likely typo, else "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

/// What one node allocates for its KV cache: the sizing `tandem serve` runs (size_kv_pools)
/// over the model's layout set, pool by pool, and its host and disk tiers.
struct node_kv_plan {
  std::string node;
  int32_t numa_node = -1;
  struct pool {
    std::string name;            ///< "full", "window"
    int32_t window_tokens = 0;   ///< 0 = full context
    int64_t pages = 0;
    uint64_t bytes = 0;
    int64_t host_pages = 0;      ///< the pool's own host (L2) pages; 0 = no host tier
    uint64_t host_bytes = 0;
    uint64_t disk_bytes = 0;     ///< the pool's files of the disk tier (one per block)
  };
  std::vector<pool> pools;       ///< device pools, pool 0 first
  uint64_t host_bytes = 0;       ///< every pool's host pages
  int64_t disk_blocks = 0;       ///< a file per pool each
  uint64_t disk_bytes = 0;
};

struct config_check {
  cluster_config cfg;
  /// Per node with a cache, when the model's layout is known here.
  std::vector<node_kv_plan> plans;
  /// One entry per problem: "<file>:<line>:<col>: <key> = <value>: <why>; <fix>".
  std::vector<std::string> errors;
  /// Checks that could not run here (e.g. the model file is on another machine).
  std::vector<std::string> notes;
  bool ok() const { return errors.empty(); }
};

/// Parses and checks a config text. Never throws for a bad config: syntax errors are one
/// entry of `errors` (parsing stops there), every other problem is its own entry.
config_check check_cluster_config(const std::string& text, const std::string& source_name, const machine_info& m);

/// Reads `path` and checks it; throws tandem::error (kind failed) only if the file cannot be read.
config_check check_cluster_config_file(const std::string& path, const machine_info& m);

}  // namespace tandem
