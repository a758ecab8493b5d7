#include "actors/runtime/readiness.h"

#include <fmt/format.h>

namespace tandem {

readiness node_readiness(bool alive, const std::string& status, const stats_snapshot* router) {
  if (!alive) return {false, status.empty() ? std::string("the node's actors do not answer") : status};
  std::string why;
  if (router) {
    for (const char* role : {"prefill", "decode"}) {
      const auto label = fmt::format("role=\"{}\"", role);
      const double targets = router->value("router_targets", label);
      const double live = router->value("router_live_targets", label);
      if (targets > 0 && live < 1) {
        if (!why.empty()) why += "; ";
        why += fmt::format("no live {0} target ({1} configured, none connected with fresh credits): completions "
                           "fail until a {0} node is back; start or reconnect one",
                           role, static_cast<int64_t>(targets));
      }
    }
  }
  if (!why.empty()) return {false, why};
  return {true, "ready"};
}

readiness handoff_readiness(const stats_snapshot* prefill, int decode_nodes) {
  if (!prefill || decode_nodes <= 0) return {true, "ready"};
  const double unreachable = prefill->value("prefill_unreachable_decode_targets");
  if (unreachable < decode_nodes) return {true, "ready"};
  return {false, fmt::format("this prefill node reaches none of its {} decode node(s) (its links are down or being "
                             "redialed): its prefills have nowhere to hand off until one is back; start or reconnect one",
                             decode_nodes)};
}

}  // namespace tandem
