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
  /// the previous call. Tokens arrive in lumps (a batch's, when it completes), so they are
  /// spread over the time with work since the previous lump, each state getting its share of
  /// that time: a batch that ran 30 ms with nothing waiting and 5 ms with a queue drained at
  /// its own rate, not six times that (which crediting the lump to the state it ended in read).
  void observe(int64_t now_ms, state now_state, int64_t tokens) {
    if (last_ms_ >= 0 && now_ms >= last_ms_) {
      const int64_t dt = now_ms - last_ms_;
      if (last_ != state::idle) pend_work_ms_ += dt;
      if (last_ == state::queued) pend_queued_ms_ += dt;
      if (last_ == state::busy) work_unqueued_ms_ += dt;
      pend_tokens_ += std::max<int64_t>(tokens, 0);
      // Millisecond timestamps: a lump after less than a millisecond of work waits for more.
      if (pend_tokens_ > 0 && pend_work_ms_ > 0) {
        const double t = double(pend_tokens_);
        busy_.add(t, pend_work_ms_, window_ms_, weight_);
        if (pend_queued_ms_ > 0)
          queued_.add(t * double(pend_queued_ms_) / double(pend_work_ms_), pend_queued_ms_, window_ms_, weight_);
        pend_tokens_ = pend_work_ms_ = pend_queued_ms_ = 0;
      }
    }
    if (now_state == state::queued && last_ != state::queued) {
      // A queue forms again after a long stretch without one: start from the faster of the
      // old queued rate and the recent busy rate (see stale()).
      if (stale()) {
        queued_.rate = std::max(queued_.rate, busy_.rate);
        queued_.tokens = 0;  // the open window's part is from then too
        queued_.ms = 0;
      }
      work_unqueued_ms_ = 0;
    }
    last_ms_ = now_ms;
    last_ = now_state;
  }
  /// The rate to report: the queued rate; 0 = no queue seen yet (the router then does not
  /// refuse on the wait estimate; the request and token bounds still hold).
  /// A window still being summed already counts once it spans half a window and reads slower:
  /// in a burst the worker's share for prefill falls as the decode batch fills (the burst's
  /// first sample is taken with decode still idle), and an estimate that waits for the window
  /// to close admits a queue that waits several times the bound.
  /// A queued rate not refreshed for 10 windows of work without a queue (the load fell after a
  /// burst) is stale: the burst's rate, slowed by a full decode batch sharing the worker,
  /// then made the router refuse at normal load, which kept a queue (and a new sample) from
  /// forming: `tandem bench burst` refused 7-10% of its 0.8x load after the burst. A stale
  /// rate reads at least the busy rate, whose windows keep measuring the worker as it is now.
  double tokens_per_s() const {
    const double q = queued_.current(window_ms_ / 2);
    return q > 0 && stale() ? std::max(q, busy_.rate) : q;
  }
  double queued_tokens_per_s() const { return queued_.rate; }
  double busy_tokens_per_s() const { return busy_.rate; }

 private:
  struct ewma {
    double tokens = 0;
    int64_t ms = 0;
    double rate = 0;
    /// `rate`, or the open window's rate if it spans `min_ms` and is slower.
    double current(int64_t min_ms) const {
      if (rate <= 0 || ms < std::max<int64_t>(min_ms, 1)) return rate;
      return std::min(rate, tokens * 1000.0 / double(ms));
    }
    void add(double t, int64_t m, int64_t window_ms, double w) {
      tokens += t;
      ms += m;
      // The first sample comes sooner: until it, a queue grows unchecked by the wait bound.
      if (ms < (rate > 0 ? window_ms : std::max<int64_t>(window_ms / 5, 1))) return;
      // Millisecond timestamps: a sub-millisecond stretch reads 0 or 1 ms, right on average,
      // so the sum over a window is unbiased even when single stretches are not.
      const double sample = tokens * 1000.0 / double(ms);
      // (Taking a slower sample at once, a faster one smoothed, was tried: the minimum of
      // noisy windows reads low and refused at normal load in the simulated 0.8x run of
      // test_router_admission. The open window's reading, tokens_per_s(), reacts instead.)
      rate = rate <= 0 ? sample : (1.0 - w) * rate + w * sample;
      tokens = ms = 0;
    }
  };
  int64_t window_ms_;
  double weight_;
  int64_t last_ms_ = -1;
  state last_ = state::idle;
  int64_t pend_tokens_ = 0, pend_work_ms_ = 0, pend_queued_ms_ = 0;  ///< since the last lump
  int64_t work_unqueued_ms_ = 0;  ///< time with work and no queue since the queue last formed
  bool stale() const { return work_unqueued_ms_ >= 10 * window_ms_; }
  ewma busy_, queued_;
};

/// The meter's state for a prefill scheduler: queued while more prompt tokens wait (in its
/// queue, or admitted to the batch and not computed yet) than one forward step takes
/// (`step_tokens`), or while its queue holds a request; busy while it has work; else idle.
/// Requests admitted to the batch (up to max_prefill_batch_seqs) wait their turn in steps
/// just as queued ones do: counting only a non-empty queue left the meter without a sample in
/// a burst of short prompts (they all fit the batch), so the router admitted a whole burst on
/// no wait estimate (`tandem bench burst` read a drain rate of 0 after its 0.8x load).
inline drain_meter::state drain_state(bool queue_nonempty, int64_t backlog_tokens, bool working, int32_t step_tokens) {
  if (queue_nonempty || backlog_tokens > std::max<int32_t>(step_tokens, 1)) return drain_meter::state::queued;
  return working ? drain_meter::state::busy : drain_meter::state::idle;
}

}  // namespace tandem
