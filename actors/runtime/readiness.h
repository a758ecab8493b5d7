#pragma once
/// Readiness: whether a node can serve, as opposed to whether its process is alive.
///
/// A router node whose only decode (or prefill) node is down is alive (`/health` 200) but every
/// completion would fail: it is not ready (`/health/ready` 503, `tandem inspect` "degraded",
/// `tandem_node_ready` 0) until a target of that role is live again.
#include <string>

#include "actors/common/metrics.h"

namespace tandem {

struct readiness {
  bool ready = false;
  std::string reason;  ///< "ready", or why not and what to do
};

/// `alive` / `status`: the node's own health (every actor answers, not escalated) and its
/// reason when not. `router`: the router's stats (router_targets / router_live_targets by
/// role), null when the node runs no router. A role with targets and none live makes the node
/// not ready; so does a node that is not alive.
readiness node_readiness(bool alive, const std::string& status, const stats_snapshot* router);

/// A node with the prefill role whose KV handoffs can reach none of its `decode_nodes` decode
/// nodes (its prefill scheduler's `prefill_unreachable_decode_targets`, from its decode proxy):
/// not ready, naming why. `prefill` null (no prefill role here) or `decode_nodes` 0: ready.
readiness handoff_readiness(const stats_snapshot* prefill, int decode_nodes);

}  // namespace tandem
