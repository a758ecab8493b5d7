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

}  // namespace tandem
