#pragma once
/// A node's drain (`tandem inspect --drain`) as its actors' stats show it: "draining" while its
/// router or schedulers still hold work (or the router may still send some), "drained" once
/// nothing is left and no router routes here, so stopping it loses nothing.
#include <string>
#include <vector>

#include "actors/common/metrics.h"

namespace tandem {

enum class drain_phase : uint8_t { serving = 0, draining = 1, drained = 2 };

/// "" (serving), "draining" or "drained".
std::string to_string(drain_phase p);

/// The phase of a node that is `draining` and runs the roles named (`router`, `prefill`,
/// `decode`), from its actors' stats snapshots. A role whose snapshot is missing holds work
/// as far as anyone knows: the node is still draining.
drain_phase node_drain_phase(bool draining, bool router, bool prefill, bool decode,
                             const std::vector<stats_snapshot>& snaps);

/// Readiness text of a draining node: what it waits for, or that it may be stopped.
std::string drain_status(drain_phase p, const std::string& node);

}  // namespace tandem
