#pragma once
/// The [[node]] tables of the cluster config: each node's keys (name, host, roles, ports, NUMA
/// node, page size, [node.cache]) and the rules across nodes (one router, a prefill and a decode
/// node, a worker and cache tier beside every scheduler, the links between nodes, one page size).
/// Internal to actors/config: check_cluster_config (cluster_config.cpp) calls them in order.
#include <string>
#include <vector>

#include "actors/config/cluster_config.h"
#include "actors/config/config_checker.h"
#include "actors/config/toml.h"

namespace tandem::config_detail {

/// Addresses that reach this machine; the RAM and NUMA checks apply to nodes on them.
bool is_local_host(const std::string& h);

/// Reads every [[node]] of `root` into cfg.nodes (each node's cache over cfg.cache, which must be
/// read before) and returns their tables in order (empty when there is none: reported).
std::vector<const value*> read_nodes(checker& ck, const value& root, const std::string& source_name,
                                     const machine_info& m, cluster_config& cfg, std::vector<std::string>& errors);

/// The rules across the nodes read by read_nodes (`tables`, not empty; `first`: where [[node]]
/// starts): the roles, the links between nodes, and one page size on every scheduler node.
void check_node_roles(checker& ck, const cluster_config& cfg, const std::vector<const value*>& tables,
                      toml::position first);

}  // namespace tandem::config_detail
