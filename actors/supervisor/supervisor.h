#pragma once
/// The supervisor of one node: monitors the node's actors and, when one fails, restarts the
/// node's actor set (one-for-all: the roles share page ownership and in-flight state, so a
/// lone restarted actor would disagree with the others). At most `max_restarts` restarts in
/// any `period_ms`; one more failure escalates: no further restart, the node is unhealthy.
/// Messages: (stats_atom) -> wire (restarts and last failure per actor), (stop_atom) -> bool
/// (stop watching before an orderly shutdown, so its exits are not failures).
#include <caf/all.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "kernels/base/clock.h"

namespace tandem {

/// One supervised actor and the role name it is reported under.
struct supervised_child {
  std::string name;
  caf::actor handle;
};

struct supervisor_options {
  std::string node_name = "local";
  int32_t max_restarts = 3;   ///< limits.supervisor_max_restarts
  int32_t period_ms = 60000;  ///< limits.supervisor_period_ms
  /// Replaces the whole actor set (stopping what is left of the old one) and returns the new
  /// children, same names. Runs on the supervisor's thread; throws tandem::error on failure.
  std::function<std::vector<supervised_child>()> restart_all;
  /// Called once, when the restart intensity is exceeded (or a restart fails).
  std::function<void(const std::string& why)> escalate;
};

caf::actor spawn_supervisor(caf::actor_system& sys, supervisor_options opt, std::vector<supervised_child> children,
                            std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
