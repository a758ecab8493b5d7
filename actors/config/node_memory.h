#pragma once
/// The per-node part of `tandem check-config`: each cache node's KV pools and tiers planned by the
/// code `tandem serve` runs (plan_node over spec_of the node), the plan it prints, and whether
/// the nodes that run on this machine fit its RAM, its NUMA nodes and their disk directories.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "actors/config/cluster_config.h"
#include "actors/config/toml.h"
#include "actors/runtime/node_plan.h"
#include "kernels/model/kv_pools.h"

namespace tandem::config_detail {

/// What the checks need from the config check around them.
struct node_memory_inputs {
  std::string source_name;
  toml::position lim_pos, cache_pos;
  /// Per node of the config: where its cache problems are reported (its [node.cache] table, or
  /// the cluster's [cache]).
  std::vector<toml::position> node_cache_pos;
  /// The model's KV shape for the node plans (plan_node, what serve runs); its layout functions
  /// are empty when the model is not readable here (the checks then use what the settings alone say).
  model_shape model;
  /// Bytes of the weight copy each worker makes with kernels = "amx"; 0 = none.
  uint64_t amx_copy_bytes = 0;
  /// Bytes of the packed low-bit weight copy each worker makes (machine_info::packs_low_bit).
  uint64_t packed_copy_bytes = 0;
  /// Bytes of the in-memory copy each worker makes of the weights it reads unpacked
  /// (machine_info::copies_weights).
  uint64_t weight_copy_bytes = 0;
  std::function<bool(const node_config&)> on_this_machine;
};

/// Appends each cache node's plan to out.plans and every problem to out.errors.
void check_node_memory(const node_memory_inputs& in, const machine_info& m, config_check& out);

}  // namespace tandem::config_detail
