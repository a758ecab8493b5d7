// thread_pool::parallel_for_steal: every index once, in pieces, each thread's share front to
// back, and the back of a held-up thread's share taken by the others.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/cpu/thread_pool.h"

using namespace tandem;

namespace {

/// The pieces one parallel_for_steal call handed out, per thread in the order it ran them.
struct pieces {
  std::mutex mu;
  std::map<std::thread::id, std::vector<std::pair<int64_t, int64_t>>> by_thread;
  void add(int64_t b, int64_t e) {
    std::lock_guard lk(mu);
    by_thread[std::this_thread::get_id()].emplace_back(b, e);
  }
};

}  // namespace

TEST_CASE("thread_pool: parallel_for_steal covers the range once, in pieces of at most the grain") {
  for (int32_t threads : {1, 2, 3, 4}) {
    cpu::thread_pool pool(threads);
    for (int64_t n : {1, 2, 7, 64, 1000}) {
      for (int64_t grain : {1, 3, 16, 5000}) {
        CAPTURE(threads);
        CAPTURE(n);
        CAPTURE(grain);
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        pieces p;
        pool.parallel_for_steal(n, grain, [&](int64_t b, int64_t e) {
          p.add(b, e);
          for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
        });
        for (auto& h : hits) CHECK(h.load() == 1);
        for (const auto& [id, v] : p.by_thread)
          for (const auto& [b, e] : v) {
            CHECK(b < e);
            // One thread, or a single index: one call for the whole range.
            if (threads > 1 && n > 1) CHECK(e - b <= grain);
          }
      }
    }
  }
}

TEST_CASE("thread_pool: parallel_for_steal walks a share front to back, each piece where the last ended") {
  // Each thread runs its own share as consecutive pieces (the stream a memory-bound kernel
  // needs), then what it steals.
  cpu::thread_pool pool(2);
  pieces p;
  std::atomic<int64_t> done{0};
  pool.parallel_for_steal(400, 10, [&](int64_t b, int64_t e) {
    p.add(b, e);
    done += e - b;
  });
  CHECK(done.load() == 400);
  for (const auto& [id, v] : p.by_thread) {
    // Runs of consecutive pieces: a new run starts only where the thread took a stolen range,
    // and each steal halves what is left (dynamic chunks taken in turn would make ~20 runs).
    int64_t runs = 1;
    for (size_t i = 1; i < v.size(); ++i) runs += v[i].first != v[i - 1].second;
    CHECK(runs <= 8);
  }
}

TEST_CASE("thread_pool: a held-up thread's share is taken by the others, a piece at a time from its back") {
  for (int32_t threads : {2, 3}) {
    CAPTURE(threads);
    cpu::thread_pool pool(threads);
    const int64_t n = 600, grain = 4;
    const std::thread::id caller = std::this_thread::get_id();
    std::atomic<int64_t> by_others{0};
    pieces p;
    // The caller's first piece waits until the other threads have done everything but that
    // piece and at most one more of the caller's share: they get there only by stealing. (The
    // deadline only turns a pool that never steals into a failure instead of a hang.)
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    pool.parallel_for_steal(n, grain, [&](int64_t b, int64_t e) {
      p.add(b, e);
      if (std::this_thread::get_id() == caller) {
        if (b == 0)
          while (by_others.load() < n - 2 * grain && std::chrono::steady_clock::now() < deadline)
            std::this_thread::yield();
      } else {
        by_others += e - b;
      }
    });
    CHECK(by_others.load() >= n - 2 * grain);
    // The caller ran its first piece and at most one more.
    const auto& mine = p.by_thread[caller];
    CHECK(mine.front() == std::pair<int64_t, int64_t>(0, grain));
    CHECK(mine.size() <= 2);
  }
}

TEST_CASE("thread_pool: parallel_for_steal rethrows a piece's exception and the pool works after it") {
  cpu::thread_pool pool(3);
  CHECK_THROWS_WITH(pool.parallel_for_steal(100, 5,
                                            [](int64_t b, int64_t) {
                                              if (b >= 50) throw std::runtime_error("piece failed");
                                            }),
                    "piece failed");
  std::atomic<int64_t> sum{0};
  pool.parallel_for_steal(1000, 7, [&](int64_t b, int64_t e) { sum += e - b; });
  CHECK(sum.load() == 1000);
  // The other kinds of job still split as they did.
  sum = 0;
  pool.parallel_for_dynamic(100, 4, [&](int64_t b, int64_t e) { sum += e - b; });
  pool.parallel_for(100, [&](int64_t b, int64_t e) { sum += e - b; });
  CHECK(sum.load() == 200);
}
