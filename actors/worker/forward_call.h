#pragma once
/// How a scheduler runs one forward batch on its worker: the call, its two ways to fail, one
/// completion handler.
#include <fmt/format.h>

#include <caf/all.hpp>

#include "actors/common/protocol.h"

namespace tandem {

/// Sends the ForwardBatch `fill` builds to `worker`. `done(reply, error)` runs exactly once:
/// with the reply; with a `disconnected` error if the worker is gone; or at once with the
/// gate's `overloaded` error if the worker's mailbox refused the batch (then false returns).
template <class Self, class Fill, class Done>
bool send_forward(Self* self, const role_handle<worker_role>& worker, Fill&& fill, Done done) {
  const bool sent = worker.call<msg::forward>(
      self, std::forward<Fill>(fill), [done](const wire& r) { done(&r, nullptr); },
      [self, done](caf::error& e) {
        tandem::error te(error_kind::disconnected, fmt::format("worker unreachable: {}", self->system().render(e)));
        done(nullptr, &te);
      });
  if (!sent) {
    auto e = worker.gate->overloaded_error();
    done(nullptr, &e);
  }
  return sent;
}

}  // namespace tandem
