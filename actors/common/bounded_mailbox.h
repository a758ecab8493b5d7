#pragma once
/// Bounded mailboxes. CAF mailboxes grow without bound, so every actor handle carries an
/// admission gate: a sender must pass the gate before it enqueues a message; the receiving
/// actor leaves the gate when it dequeues. A sender that would exceed the bound gets an
/// explicit `overloaded` error instead of silent growth.
///
/// Work-creating messages (submissions, handoffs, forward batches, allocations) use
/// `try_enter` and can be rejected. Messages that release resources (free pages, aborts,
/// events of already accepted requests) use `enter_control`: rejecting them would leak
/// pages or lose a finished event, and they are bounded by the number of live requests.
#include <atomic>
#include <caf/actor.hpp>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/base/error.h"

namespace tandem {

/// Fault injection at the gates (the deterministic simulation, tests/sim): consulted by
/// `try_enter` before the bound, so a sender sees a full mailbox it would not see otherwise.
/// Off (null) by default; set before any traffic.
class gate_fault {
 public:
  virtual ~gate_fault() = default;
  /// True: refuse this work-creating message as if the mailbox of `actor_name` were full.
  virtual bool reject(const std::string& actor_name) = 0;
};

class mailbox_gate {
 public:
  mailbox_gate(std::string actor_name, int32_t bound);

  /// Counts the message in if the bound allows; false (and a counted rejection) otherwise.
  bool try_enter();
  /// Counts a control message in unconditionally (see the file comment).
  void enter_control();
  /// Called by the receiving actor when it dequeues a gated message.
  void leave();

  int32_t depth() const { return depth_.load(std::memory_order_relaxed); }
  int32_t bound() const { return bound_; }
  int32_t high_water() const { return high_water_.load(std::memory_order_relaxed); }
  int64_t rejected() const { return rejected_.load(std::memory_order_relaxed); }
  int64_t accepted() const { return accepted_.load(std::memory_order_relaxed); }
  const std::string& actor_name() const { return name_; }
  /// Installs (or, with null, removes) the fault injector; call before any traffic.
  void set_fault(std::shared_ptr<gate_fault> f) { fault_ = std::move(f); }
  /// The error a rejected sender reports.
  tandem::error overloaded_error() const;

 private:
  void note_depth(int32_t d);
  std::string name_;
  int32_t bound_;
  std::shared_ptr<gate_fault> fault_;
  std::atomic<int32_t> depth_{0};
  std::atomic<int32_t> high_water_{0};
  std::atomic<int64_t> rejected_{0};
  std::atomic<int64_t> accepted_{0};
};

/// An actor handle together with the gate of its mailbox.
struct bounded_actor {
  caf::actor handle;
  std::shared_ptr<mailbox_gate> gate;

  explicit operator bool() const { return static_cast<bool>(handle) && gate != nullptr; }
};

}  // namespace tandem
