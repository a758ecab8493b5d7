#pragma once
/// A small fork-join pool for the CPU kernels: parallel_for splits a range into one
/// contiguous chunk per thread; the calling thread runs the first chunk. Owned by a model
/// (no global pool). Not re-entrant: one parallel_for at a time.
///
/// A forward pass issues ~10 fork-joins per layer, each only tens of microseconds long, so
/// waking sleeping threads through the kernel would cost as much as the work: workers spin
/// on the generation counter for `spin_us` after each job before they sleep on a condition
/// variable, and the caller spins the same way for the workers to finish.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem::cpu {

class thread_pool {
 public:
  /// `n_threads` total including the caller; values < 1 mean 1 (no workers).
  explicit thread_pool(int32_t n_threads, int32_t spin_us = 200);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int32_t size() const { return int32_t(workers_.size()) + 1; }
  /// Calls fn(begin, end) over disjoint chunks covering [0, n) and returns when all are done.
  /// An exception thrown by a chunk is rethrown here (the first one).
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
  /// Like parallel_for, but [0, n) is cut into `chunks_per_thread` x size() contiguous chunks
  /// that the threads take in order as they become free, so a thread that runs slower (a
  /// busy core on a shared machine) takes fewer chunks instead of holding up the others.
  void parallel_for_dynamic(int64_t n, int32_t chunks_per_thread, const std::function<void(int64_t, int64_t)>& fn);
  /// Like parallel_for, but each thread walks its contiguous share front to back in pieces of
  /// `grain` (one fn call each), and a thread whose share is done takes the back half of the
  /// largest share left while more than `grain` is left of it. A memory-bound kernel keeps one
  /// sequential stream per thread (dynamic chunks taken in turn restart each thread's stream at
  /// every chunk), and the threads still end within about a piece of each other: a static split
  /// ends as far apart as the threads' speeds differ, dynamic chunks as far as a chunk lasts.
  void parallel_for_steal(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  /// How a job's range is dealt out (see the parallel_for variants).
  enum class split : uint8_t { fixed, dynamic, steal };
  /// A thread's share under split::steal: [lo, hi) as lo << 32 | hi, on a line of its own.
  struct alignas(64) share {
    std::atomic<uint64_t> range{0};
  };
  void worker(int32_t index);
  /// `chunks`: the number of chunks (fixed, dynamic) or the grain (steal).
  void run(int64_t n, int64_t chunks, split mode, const std::function<void(int64_t, int64_t)>& fn);
  /// Runs this thread's share of the current job: chunk `index` (fixed), chunks taken from
  /// next_chunk_ until none is left (dynamic), or its share then stolen ones (steal).
  void run_share(int32_t index, const std::function<void(int64_t, int64_t)>& fn, int64_t n, int64_t chunks,
                 split mode);
  void run_steal(int32_t index, const std::function<void(int64_t, int64_t)>& fn, int64_t grain);
  std::vector<std::thread> workers_;
  const int32_t spin_us_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunks_ = 0;
  split mode_ = split::fixed;
  std::atomic<int64_t> next_chunk_{0};
  std::unique_ptr<share[]> shares_;  ///< one per thread, the caller's first
  std::atomic<uint64_t> generation_{0};
  std::atomic<int32_t> pending_{0};
  std::atomic<bool> stop_{false};
  int32_t sleepers_ = 0;  // guarded by mu_
  std::exception_ptr error_;  // guarded by mu_
};

/// Elements an elementwise or row-wise kernel must touch before it wakes the workers:
/// below this, waking them costs more than the work. Within a forward pass the workers spin
/// between jobs, so a split costs about a microsecond: at batch 32 (32 x 768 values) the
/// norms, RoPE and the activation split ran on one thread at 1 << 15 while the other spun,
/// and batch-32 decode gained 5-10% at 1 << 13 (small-110m, amx).
constexpr int64_t min_parallel_work = int64_t(1) << 13;

/// fn over [0, n): split across `pool`'s threads (pool->parallel_for) when there is a pool
/// of more than one thread and `work` reaches `min_work`, else run on the caller.
void parallel_for_if(thread_pool* pool, int64_t n, int64_t work, const std::function<void(int64_t, int64_t)>& fn,
                     int64_t min_work = min_parallel_work);

/// Work units of several parts numbered one after another (part i has units [off[i],
/// off[i + 1])), so that one fork-join covers them all: runs fn(i, lo, hi) for each part that
/// meets [u0, u1), with lo and hi counted within that part.
template <class F>
void for_parts(const std::vector<int64_t>& off, int64_t u0, int64_t u1, F&& fn) {
  for (size_t i = 0; i + 1 < off.size(); ++i) {
    const int64_t lo = off[i] > u0 ? off[i] : u0, hi = off[i + 1] < u1 ? off[i + 1] : u1;
    if (lo < hi) fn(i, lo - off[i], hi - off[i]);
  }
}

/// for_parts over parts of whole groups that weigh differently: part i's group g stands for
/// the `per[i]` units [off[i] + g * per[i], off[i] + (g + 1) * per[i]) (e.g. a matmul's row
/// group weighs its batch), so that a split into equal unit ranges is a split by work. Each
/// group goes to the range that holds its first unit: fn(i, g0, g1) runs for the groups
/// [g0, g1) of part i whose first unit is in [u0, u1), so adjacent ranges never share one.
template <class F>
void for_weighted_parts(const std::vector<int64_t>& off, const std::vector<int64_t>& per, int64_t u0, int64_t u1,
                        F&& fn) {
  for (size_t i = 0; i + 1 < off.size(); ++i) {
    const int64_t lo = off[i] > u0 ? off[i] : u0, hi = off[i + 1] < u1 ? off[i + 1] : u1;
    if (lo >= hi) continue;
    const int64_t g0 = (lo - off[i] + per[i] - 1) / per[i], g1 = (hi - off[i] + per[i] - 1) / per[i];
    if (g0 < g1) fn(i, g0, g1);
  }
}

}  // namespace tandem::cpu
