#include "actors/common/receive.h"

namespace tandem {

std::vector<metric_sample> inbox::metrics() const {
  const std::string lbl = fmt::format("actor=\"{}\"", actor);
  return {
      {"actor_unexpected_messages_total", lbl, double(unexpected), "counter",
       "Messages of another role or of a kind the actor does not take, dropped (a peer of another build?)"},
      {"actor_malformed_messages_total", lbl, double(malformed), "counter",
       "Messages whose bytes did not parse within the wire limits, dropped"},
      {"actor_failed_messages_total", lbl, double(failed), "counter",
       "Messages whose handler failed (logged; a call answered with the error)"},
  };
}

void inbox::count_unexpected(const char* why) {
  ++unexpected;
  log->error("{}: unexpected message dropped ({})", actor, why);
}

}  // namespace tandem
