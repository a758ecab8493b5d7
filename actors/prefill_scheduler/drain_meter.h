#pragma once
/// The drain rate a prefill scheduler reports in its credits (prompt tokens per second), from
/// which the router estimates a new request's queue wait (actors/router/router_policy.h).
/// Kept free of actors so it can be tested on a made-up timeline.
///
/// What is measured: prompt tokens computed per wall second while requests wait in the queue
/// (behind the ones being prefilled). That is the state the wait estimate is about: a queue
/// drains by full batches, which compute more tokens per second than the lone prompts of a
/// quiet period (a forward step has a fixed cost), and wall time counts everything that slows
/// the drain (decode steps sharing the worker, page acquisition, a descheduled process).
/// Every stretch of queued time counts, short ones too: keeping only long busy periods (the
/// slow ones) biased the old estimate low. The rate over all time with work (`busy`) is kept
/// for the metrics only: reported as the drain rate it made the router refuse at normal load
/// (a lone prompt's fixed costs read as a slow queue), and the refusals kept a queue from
/// forming, so the true rate was never measured.
#include <algorithm>
#include <cstdint>

namespace tandem {

class drain_meter {
 public:
  enum class state : uint8_t { idle, busy, queued };

  /// `window_ms`: wall time summed before a sample is taken; `weight`: of a new sample in the
  /// moving average (lower = smoother).
  explicit drain_meter(int64_t window_ms = 100, double weight = 0.3)
      : window_ms_(std::max<int64_t>(1, window_ms)), weight_(std::clamp(weight, 0.01, 1.0)) {}

  /// At `now_ms` the scheduler is in `now_state`; `tokens` prompt tokens were computed since
  /// the previous call (they count towards the state it was in until now).
  void observe(int64_t now_ms, state now_state, int64_t tokens) {
    if (last_ms_ >= 0 && now_ms >= last_ms_) {
      const int64_t dt = now_ms - last_ms_;
      const int64_t t = std::max<int64_t>(tokens, 0);
      if (last_ != state::idle) busy_.add(t, dt, window_ms_, weight_);
      if (last_ == state::queued) queued_.add(t, dt, window_ms_, weight_);
    }
    last_ms_ = now_ms;
    last_ = now_state;
  }
  /// The rate to report: the queued rate; 0 = no queue seen yet (the router then does not
  /// refuse on the wait estimate; the request and token bounds still hold).
  double tokens_per_s() const { return queued_.rate; }
  double queued_tokens_per_s() const { return queued_.rate; }
  double busy_tokens_per_s() const { return busy_.rate; }

 private:
  struct ewma {
    int64_t tokens = 0, ms = 0;
    double rate = 0;
    void add(int64_t t, int64_t m, int64_t window_ms, double w) {
      tokens += t;
      ms += m;
      // The first sample comes sooner: until it, a queue grows unchecked by the wait bound.
      if (ms < (rate > 0 ? window_ms : std::max<int64_t>(window_ms / 5, 1))) return;
      // Millisecond timestamps: a sub-millisecond stretch reads 0 or 1 ms, right on average,
      // so the sum over a window is unbiased even when single stretches are not.
      const double sample = double(tokens) * 1000.0 / double(ms);
      rate = rate <= 0 ? sample : (1.0 - w) * rate + w * sample;
      tokens = ms = 0;
    }
  };
  int64_t window_ms_;
  double weight_;
  int64_t last_ms_ = -1;
  state last_ = state::idle;
  ewma busy_, queued_;
};

}  // namespace tandem
