#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {
void chunk(int64_t n, int32_t parts, int32_t i, int64_t& b, int64_t& e) {
  b = n * i / parts;
  e = n * (i + 1) / parts;
}
}  // namespace

thread_pool::thread_pool(int32_t n_threads) {
  for (int32_t i = 1; i < n_threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard lk(mu_);
    fn_ = &fn;
    n_ = n;
    pending_ = int32_t(workers_.size());
    error_ = nullptr;
    ++generation_;
  }
  start_cv_.notify_all();
  std::exception_ptr mine;
  try {
    int64_t b, e;
    chunk(n, size(), 0, b, e);
    if (b < e) fn(b, e);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock lk(mu_);
  done_cv_.wait(lk, [this] { return pending_ == 0; });
  fn_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void thread_pool::worker(int32_t index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n;
    {
      std::unique_lock lk(mu_);
      start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
    }
    std::exception_ptr err;
    try {
      int64_t b, e;
      chunk(n, size(), index, b, e);
      if (b < e) (*fn)(b, e);
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard lk(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace tandem::cpu
