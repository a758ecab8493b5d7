#pragma once
/// The cluster clock, injected so tests can drive time (deadlines) without sleeping.
#include <atomic>
#include <chrono>
#include <cstdint>

namespace tandem {

class cluster_clock {
 public:
  virtual ~cluster_clock() = default;
  /// Milliseconds since an arbitrary epoch; never decreases.
  virtual int64_t now_ms() const = 0;
};

/// steady_clock.
class steady_cluster_clock final : public cluster_clock {
 public:
  int64_t now_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
};

/// A clock that moves only when told (tests).
class manual_clock final : public cluster_clock {
 public:
  explicit manual_clock(int64_t start_ms = 1000) : t_(start_ms) {}
  int64_t now_ms() const override { return t_.load(std::memory_order_acquire); }
  void advance_ms(int64_t d) { t_.fetch_add(d, std::memory_order_acq_rel); }

 private:
  std::atomic<int64_t> t_;
};

}  // namespace tandem
