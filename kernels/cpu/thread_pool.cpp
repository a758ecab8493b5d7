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

thread_pool::thread_pool(int32_t n_threads, int32_t spin_us) : spin_us_(spin_us < 0 ? 0 : spin_us) {
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
  run(n, size(), false, fn);
}

void parallel_for_if(thread_pool* pool, int64_t n, int64_t work, const std::function<void(int64_t, int64_t)>& fn,
                     int64_t min_work) {
  if (pool == nullptr || pool->size() == 1 || work < min_work) return fn(0, n);
  pool->parallel_for(n, fn);
}

void thread_pool::parallel_for_dynamic(int64_t n, int32_t chunks_per_thread,
                                       const std::function<void(int64_t, int64_t)>& fn) {
  run(n, std::min<int64_t>(n, int64_t(size()) * std::max(1, chunks_per_thread)), true, fn);
}

void thread_pool::run_share(int32_t index, const std::function<void(int64_t, int64_t)>& fn, int64_t n,
                            int64_t chunks, bool dynamic) {
  int64_t b, e;
  if (!dynamic) {
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

void thread_pool::run(int64_t n, int64_t chunks, bool dynamic, const std::function<void(int64_t, int64_t)>& fn) {
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
    dynamic_ = dynamic;
    next_chunk_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    pending_.store(int32_t(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
    wake = sleepers_ > 0;
  }
  if (wake) start_cv_.notify_all();
  std::exception_ptr mine;
  try {
    run_share(0, fn, n, chunks, dynamic);
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
    bool dynamic;
    {
      // fn_/n_/chunks_/dynamic_ were written under mu_ before the generation moved.
      std::lock_guard lk(mu_);
      seen = generation_.load(std::memory_order_acquire);
      fn = fn_;
      n = n_;
      chunks = chunks_;
      dynamic = dynamic_;
    }
    std::exception_ptr err;
    try {
      run_share(index, *fn, n, chunks, dynamic);
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
