#include "actors/common/bounded_mailbox.h"

#include <fmt/format.h>

namespace tandem {

mailbox_gate::mailbox_gate(std::string actor_name, int32_t bound)
    : name_(std::move(actor_name)), bound_(bound) {
  if (bound <= 0)
    throw tandem::error(
        error_kind::failed,
        fmt::format("mailbox bound of {} is {}; it must be > 0 (see limits.*_mailbox)", name_, bound));
}

bool mailbox_gate::try_enter() {
  if (fault_ && fault_->reject(name_)) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  int32_t d = depth_.load(std::memory_order_relaxed);
  while (true) {
    if (d >= bound_) {
      rejected_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    if (depth_.compare_exchange_weak(d, d + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) break;
  }
  accepted_.fetch_add(1, std::memory_order_relaxed);
  note_depth(d + 1);
  return true;
}

void mailbox_gate::enter_control() {
  int32_t d = depth_.fetch_add(1, std::memory_order_acq_rel) + 1;
  accepted_.fetch_add(1, std::memory_order_relaxed);
  note_depth(d);
}

void mailbox_gate::leave() { depth_.fetch_sub(1, std::memory_order_acq_rel); }

void mailbox_gate::note_depth(int32_t d) {
  int32_t hw = high_water_.load(std::memory_order_relaxed);
  while (d > hw && !high_water_.compare_exchange_weak(hw, d, std::memory_order_relaxed)) {
  }
}

tandem::error mailbox_gate::overloaded_error() const {
  return tandem::error(
      error_kind::overloaded,
      fmt::format("mailbox of the {} actor is full ({} messages waiting, bound {}); retry later "
                  "or raise limits.{}_mailbox",
                  name_, depth(), bound_, name_));
}

}  // namespace tandem
