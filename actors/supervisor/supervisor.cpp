#include "actors/supervisor/supervisor.h"

#include <fmt/format.h>

#include <deque>
#include <map>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

namespace {

struct failure_record {
  int64_t restarts = 0;
  int64_t failures = 0;
  int64_t last_failure_unix_ms = 0;
  std::string last_cause;
};

struct supervisor_state {
  supervisor_options opt;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::vector<supervised_child> children;
  std::map<std::string, failure_record> records;  ///< by role; bounded by the node's roles
  std::deque<int64_t> recent_ms;                  ///< restart times within the period; at most max_restarts + 1
  bool watching = true;
  bool escalated = false;
  std::string escalated_why;
  static inline const char* name = "supervisor";
};

using supervisor_actor_t = caf::stateful_actor<supervisor_state>;

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void watch(supervisor_actor_t* self) {
  for (const auto& c : self->state.children) self->monitor(c.handle);
}

void unwatch(supervisor_actor_t* self) {
  for (const auto& c : self->state.children) self->demonitor(c.handle);
}

void on_down(supervisor_actor_t* self, const caf::down_msg& dm) {
  auto& s = self->state;
  if (!s.watching || s.escalated) return;
  auto it = std::find_if(s.children.begin(), s.children.end(),
                         [&](const supervised_child& c) { return c.handle.address() == dm.source; });
  if (it == s.children.end()) return;  // an actor of a set already replaced
  std::string who = it->name;
  std::string cause = dm.reason ? self->system().render(dm.reason) : std::string("exited without an error");
  auto& rec = s.records[who];
  rec.failures += 1;
  rec.last_failure_unix_ms = unix_ms();
  rec.last_cause = cause;
  int64_t now = s.clk->now_ms();
  while (!s.recent_ms.empty() && now - s.recent_ms.front() >= s.opt.period_ms) s.recent_ms.pop_front();
  if (static_cast<int32_t>(s.recent_ms.size()) >= s.opt.max_restarts) {
    s.escalated = true;
    s.escalated_why = fmt::format(
        "node {} is unhealthy: actor {} failed ({}) after {} restart(s) within {} ms (limits.supervisor_max_restarts = "
        "{}); fix the cause in the log and restart the process",
        s.opt.node_name, who, cause, s.recent_ms.size(), s.opt.period_ms, s.opt.max_restarts);
    s.log->error("{}", s.escalated_why);
    unwatch(self);
    if (s.opt.escalate) s.opt.escalate(s.escalated_why);
    return;
  }
  s.log->warn("actor {} failed ({}); restarting the node's actors ({} of {} restarts in {} ms)", who, cause,
              s.recent_ms.size() + 1, s.opt.max_restarts, s.opt.period_ms);
  unwatch(self);
  try {
    s.children = s.opt.restart_all();
  } catch (const std::exception& e) {
    s.escalated = true;
    s.escalated_why = fmt::format("node {} is unhealthy: restarting after actor {} failed ({}) did not work: {}",
                                  s.opt.node_name, who, cause, e.what());
    s.log->error("{}", s.escalated_why);
    if (s.opt.escalate) s.opt.escalate(s.escalated_why);
    return;
  }
  s.recent_ms.push_back(now);
  rec.restarts += 1;
  watch(self);
}

caf::behavior supervisor_actor(supervisor_actor_t* self, supervisor_options opt, std::vector<supervised_child> children,
                               std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& s = self->state;
  s.opt = std::move(opt);
  s.clk = std::move(clk);
  s.log = std::move(log);
  s.children = std::move(children);
  for (const auto& c : s.children) s.records[c.name];  // every role is reported, from 0
  watch(self);
  self->set_down_handler([self](caf::down_msg& dm) { on_down(self, dm); });
  return {
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m;
        for (const auto& [name, r] : s.records) {
          auto lbl = fmt::format("node=\"{}\",actor=\"{}\"", s.opt.node_name, name);
          m.push_back({"actor_restarts_total", lbl, double(r.restarts), "counter",
                       "Restarts of the node's actors after this actor failed"});
          m.push_back({"actor_failures_total", lbl, double(r.failures), "counter", "Failures of the actor"});
          m.push_back({"actor_last_failure_timestamp_seconds", lbl, double(r.last_failure_unix_ms) / 1000.0, "gauge",
                       "When the actor last failed (Unix time; 0 = never)"});
          if (r.failures > 0) {
            std::string cause;
            for (char c : r.last_cause.substr(0, 200)) {
              if (c == '"' || c == '\\') cause += '\\';
              cause += c == '\n' ? ' ' : c;
            }
            m.push_back({"actor_last_failure_info", fmt::format("{},cause=\"{}\"", lbl, cause), 1.0, "gauge",
                         "The cause of the actor's last failure, as a label"});
          }
        }
        m.push_back({"node_escalated", fmt::format("node=\"{}\"", s.opt.node_name), s.escalated ? 1.0 : 0.0, "gauge",
                     "1 once the restart intensity was exceeded (the node stays unhealthy)"});
        return make_stats_wire("supervisor", m, {});
      },
      [self](stop_atom) -> bool {
        self->state.watching = false;
        unwatch(self);
        return true;
      },
  };
}

}  // namespace

caf::actor spawn_supervisor(caf::actor_system& sys, supervisor_options opt, std::vector<supervised_child> children,
                            std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  return sys.spawn(supervisor_actor, std::move(opt), std::move(children), std::move(clk), std::move(log));
}

}  // namespace tandem
