#pragma once
/// The `[cache]` table of a cluster config, and the `[node.cache]` table that overrides it for
/// one node (docs/config.md, "[cache]"): both are read and checked by the same code, so a
/// node's effective cache settings obey exactly the cluster-level rules.
#include <string>

#include "actors/common/cache_config.h"
#include "actors/config/config_checker.h"
#include "actors/config/toml.h"

namespace tandem::config_detail {

/// Reads the keys present in `t` (the table named `table`: "cache" or "node[i].cache") onto
/// `c`, which holds the defaults (the built-in ones, or the cluster's [cache] for a node), then
/// checks the result (exclusive keys, the disk tier's pair, enabled vs tiers). The host tier's
/// size is one setting: a table that gives host_ratio or host_size_gb replaces both (the other
/// becomes 0); likewise disk_dir and disk_size_gb for the disk tier.
void read_cache_table(checker& ck, const toml::value& t, const std::string& table, cache_config& c);

/// "host_ratio 2, write_through_selective (2 hits), disk none, ..." for check-config's report.
std::string describe_cache(const cache_config& c);

}  // namespace tandem::config_detail
