#include "actors/runtime/node_drain.h"

#include <fmt/format.h>

namespace tandem {

std::string to_string(drain_phase p) {
  switch (p) {
    case drain_phase::serving: return "";
    case drain_phase::draining: return "draining";
    case drain_phase::drained: return "drained";
  }
  return "";
}

drain_phase node_drain_phase(bool draining, bool router, bool prefill, bool decode,
                             const std::vector<stats_snapshot>& snaps) {
  if (!draining) return drain_phase::serving;
  auto find = [&](const char* actor) -> const stats_snapshot* {
    for (const auto& s : snaps)
      if (s.actor == actor) return &s;
    return nullptr;
  };
  if (router) {
    const auto* r = find("router");
    if (!r || r->value("requests_inflight") != 0) return drain_phase::draining;
  }
  if (prefill) {
    // Its queue, the prompts being computed and the KV sends its worker writes to decode nodes.
    const auto* p = find("prefill");
    const auto* w = find("worker");
    if (!p || !w || p->value("prefill_queued_requests") + p->value("prefill_active_requests") +
                            w->value("worker_kv_sends_inflight") != 0 ||
        p->value("drain_router_clear", "actor=\"prefill\"") != 1)
      return drain_phase::draining;
  }
  if (decode) {
    const auto* d = find("decode");
    if (!d || d->value("decode_running_requests") + d->value("decode_waiting_requests") +
                      d->value("decode_kv_receiving_requests") + d->value("decode_kv_page_waiting_requests") != 0 ||
        d->value("drain_router_clear", "actor=\"decode\"") != 1)
      return drain_phase::draining;
  }
  return drain_phase::drained;
}

std::string drain_status(drain_phase p, const std::string& node) {
  if (p == drain_phase::drained)
    return fmt::format("drained: node {} holds no request and no router routes here; stop it, or take it back "
                       "with tandem inspect --undrain",
                       node);
  return fmt::format("draining: node {} takes no new requests and finishes the ones it holds (tandem inspect "
                     "--undrain takes it back)",
                     node);
}

}  // namespace tandem
