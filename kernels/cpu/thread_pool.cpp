#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace tandem::cpu {

namespace {
void chunk(int64_t n, int64_t parts, int64_t i, int64_t& b, int64_t& e) {
  b = n * i / parts;
  e = n * (i + 1) / parts;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until pred() or `us` microseconds pass; true if pred() held.
template <class Pred>
bool spin_for(int32_t us, Pred pred) {
  if (pred()) return true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= until) return pred();
    // On an oversubscribed machine the thread we wait for may be queued behind us on this
    // core: give it the core (a cheap no-op when nothing else is runnable).
    std::this_thread::yield();
  }
}
}  // namespace

thread_pool::thread_pool(int32_t n_threads, int32_t spin_us)
    : spin_us_(spin_us < 0 ? 0 : spin_us),
      shares_(std::make_unique<share[]>(size_t(std::max(1, n_threads)))) {
  for (int32_t i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard lk(mu_);
    stop_.store(true);
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  run(n, size(), split::fixed, fn);
}

void parallel_for_if(thread_pool* pool, int64_t n, int64_t work, const std::function<void(int64_t, int64_t)>& fn,
                     int64_t min_work) {
  if (pool == nullptr || pool->size() == 1 || work < min_work) return fn(0, n);
  pool->parallel_for(n, fn);
}

void thread_pool::parallel_for_dynamic(int64_t n, int32_t chunks_per_thread,
                                       const std::function<void(int64_t, int64_t)>& fn) {
  run(n, std::min<int64_t>(n, int64_t(size()) * std::max(1, chunks_per_thread)), split::dynamic, fn);
}

void thread_pool::parallel_for_steal(int64_t n, int64_t grain,
                                     const std::function<void(int64_t, int64_t)>& fn) {
  // Shares pack their bounds in 32 bits each; a longer range (none in a forward pass) is dealt
  // out dynamically instead.
  if (n > int64_t(UINT32_MAX)) return parallel_for_dynamic(n, 4, fn);
  run(n, std::max<int64_t>(1, grain), split::steal, fn);
}

namespace {
constexpr uint64_t pack_range(uint64_t lo, uint64_t hi) { return lo << 32 | hi; }
constexpr int64_t range_lo(uint64_t r) { return int64_t(r >> 32); }
constexpr int64_t range_hi(uint64_t r) { return int64_t(r & 0xFFFFFFFFu); }
}  // namespace

void thread_pool::run_steal(int32_t index, const std::function<void(int64_t, int64_t)>& fn, int64_t grain) {
  std::atomic<uint64_t>& mine = shares_[size_t(index)].range;
  for (;;) {
    // The own share, a piece at a time from the front (thieves take from the back).
    uint64_t r = mine.load(std::memory_order_acquire);
    while (range_lo(r) < range_hi(r)) {
      const int64_t lo = range_lo(r), e = std::min(lo + grain, range_hi(r));
      if (!mine.compare_exchange_weak(r, pack_range(uint64_t(e), uint64_t(range_hi(r))),
                                      std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      fn(lo, e);
      r = mine.load(std::memory_order_acquire);
    }
    // Then the back half of the largest share left, while one holds more than a piece. Bounds
    // only move inwards and every index is claimed once, so a share never shows the same
    // bounds twice and a compare-exchange cannot succeed on a stale reading.
    for (;;) {
      int32_t victim = -1;
      uint64_t seen = 0;
      for (int32_t t = 0; t < size(); ++t) {
        const uint64_t v = shares_[size_t(t)].range.load(std::memory_order_acquire);
        if (range_hi(v) - range_lo(v) > grain &&
            (victim < 0 || range_hi(v) - range_lo(v) > range_hi(seen) - range_lo(seen))) {
          victim = t;
          seen = v;
        }
      }
      if (victim < 0) return;
      const int64_t mid = range_hi(seen) - (range_hi(seen) - range_lo(seen)) / 2;
      if (shares_[size_t(victim)].range.compare_exchange_strong(
              seen, pack_range(uint64_t(range_lo(seen)), uint64_t(mid)), std::memory_order_acq_rel)) {
        mine.store(pack_range(uint64_t(mid), uint64_t(range_hi(seen))), std::memory_order_release);
        break;
      }
    }
  }
}

void thread_pool::run_share(int32_t index, const std::function<void(int64_t, int64_t)>& fn, int64_t n,
                            int64_t chunks, split mode) {
  if (mode == split::steal) return run_steal(index, fn, chunks);
  int64_t b, e;
  if (mode == split::fixed) {
    chunk(n, chunks, index, b, e);
    if (b < e) fn(b, e);
    return;
  }
  for (int64_t i = next_chunk_.fetch_add(1, std::memory_order_relaxed); i < chunks;
       i = next_chunk_.fetch_add(1, std::memory_order_relaxed)) {
    chunk(n, chunks, i, b, e);
    if (b < e) fn(b, e);
  }
}

void thread_pool::run(int64_t n, int64_t chunks, split mode,
                      const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  bool wake;
  {
    std::lock_guard lk(mu_);
    fn_ = &fn;
    n_ = n;
    chunks_ = chunks;
    mode_ = mode;
    next_chunk_.store(0, std::memory_order_relaxed);
    if (mode == split::steal)
      for (int32_t t = 0; t < size(); ++t) {
        int64_t b, e;
        chunk(n, size(), t, b, e);
        shares_[size_t(t)].range.store(pack_range(uint64_t(b), uint64_t(e)), std::memory_order_relaxed);
      }
    error_ = nullptr;
    pending_.store(int32_t(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    wake = sleepers_ > 0;
  }
  if (wake) start_cv_.notify_all();
  std::exception_ptr mine;
  try {
    run_share(0, fn, n, chunks, mode);
  } catch (...) {
    mine = std::current_exception();
  }
  auto done = [this] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!spin_for(spin_us_, done)) {
    std::unique_lock lk(mu_);
    done_cv_.wait(lk, done);
  }
  std::lock_guard lk(mu_);
  fn_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void thread_pool::worker(int32_t index) {
  uint64_t seen = 0;
  for (;;) {
    auto ready = [&] { return stop_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen; };
    if (!spin_for(spin_us_, ready)) {
      std::unique_lock lk(mu_);
      ++sleepers_;
      start_cv_.wait(lk, ready);
      --sleepers_;
    }
    if (stop_.load(std::memory_order_acquire)) return;
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n, chunks;
    split mode;
    {
      // fn_/n_/chunks_/mode_ (and the shares) were written under mu_ before the generation moved.
      std::lock_guard lk(mu_);
      seen = generation_.load(std::memory_order_acquire);
      fn = fn_;
      n = n_;
      chunks = chunks_;
      mode = mode_;
    }
    std::exception_ptr err;
    try {
      run_share(index, *fn, n, chunks, mode);
    } catch (...) {
      err = std::current_exception();
    }
    if (err) {
      std::lock_guard lk(mu_);
      if (!error_) error_ = err;
    }
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      { std::lock_guard lk(mu_); }  // the caller is either spinning or waiting under mu_
      done_cv_.notify_one();
    }
  }
}

}  // namespace tandem::cpu
