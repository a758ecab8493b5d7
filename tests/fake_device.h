#pragma once
/// A device for tests without a GPU: host memory pretending to be another memory domain.
/// Its KV pools and its pinned buffers are heap memory it keeps track of; its staging copies
/// (backend::staging_ops) are queued and run only when waited for, so a reader that does not
/// wait sees stale bytes; a staging copy whose sides are not one device range and one pinned
/// range throws (the staging path must not bypass its buffers). Everything is counted.
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <stdexcept>
#include <vector>

#include "kernels/backend/device.h"
#include "kernels/model/kv_pools.h"

namespace tandem::test {

struct fake_device_state {
  /// [begin, end) of device memory and of pinned host memory.
  std::map<const uint8_t*, const uint8_t*> device_ranges, pinned_ranges;
  struct queued {
    uint64_t fence;
    void* dst;
    const void* src;
    size_t bytes;
  };
  std::deque<queued> queue;
  uint64_t next_fence = 1;
  int64_t staged_copies = 0, staged_bytes = 0, plain_copies = 0, quiesces = 0;
  int64_t pinned_allocs = 0, pinned_frees = 0, pins = 0, unpins = 0;

  static bool in(const std::map<const uint8_t*, const uint8_t*>& r, const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    auto it = r.upper_bound(b);
    if (it == r.begin()) return false;
    --it;
    return b >= it->first && b + n <= it->second;
  }
  void run_until(uint64_t fence) {
    while (!queue.empty() && queue.front().fence <= fence) {
      std::memcpy(queue.front().dst, queue.front().src, queue.front().bytes);
      queue.pop_front();
    }
  }
};

/// The fake device; `state` is shared with the caller for its counters.
inline backend::device make_fake_device(std::shared_ptr<fake_device_state> st) {
  backend::device d;
  d.name = "fake:0";
  d.make_pools = [st](const kv_pools_layout& set,
                      std::span<const int32_t> n_pages) -> std::shared_ptr<kv_pools> {
    auto mem = std::make_shared<std::vector<std::vector<float>>>();
    auto owned = std::make_shared<std::vector<std::unique_ptr<kv_pool>>>();
    std::vector<kv_pool*> ptrs;
    for (size_t p = 0; p < set.pools.size(); ++p) {
      const size_t bytes = kv_pool::bytes_for(set.pools[p].page, n_pages[p]);
      mem->emplace_back(bytes / sizeof(float) + 1, 0.0f);
      auto* base = reinterpret_cast<uint8_t*>(mem->back().data());
      st->device_ranges[base] = base + bytes;
      owned->push_back(std::make_unique<kv_pool>(set.pools[p].page, n_pages[p], base, bytes));
      ptrs.push_back(owned->back().get());
    }
    return std::shared_ptr<kv_pools>(new kv_pools(set, std::move(ptrs)), [st, mem, owned](kv_pools* k) {
      delete k;
      for (auto& m : *mem) st->device_ranges.erase(reinterpret_cast<const uint8_t*>(m.data()));
    });
  };
  d.copy = [st](void* dst, const void* src, size_t n) {
    ++st->plain_copies;
    std::memcpy(dst, src, n);
  };
  d.staging.alloc_pinned = [st](size_t n) -> void* {
    auto* p = new uint8_t[n];
    st->pinned_ranges[p] = p + n;
    ++st->pinned_allocs;
    return p;
  };
  d.staging.free_pinned = [st](void* p) {
    st->pinned_ranges.erase(static_cast<const uint8_t*>(p));
    ++st->pinned_frees;
    delete[] static_cast<uint8_t*>(p);
  };
  d.staging.pin = [st](void* p, size_t n) {
    st->pinned_ranges[static_cast<const uint8_t*>(p)] = static_cast<const uint8_t*>(p) + n;
    ++st->pins;
    return true;
  };
  d.staging.unpin = [st](void* p) {
    st->pinned_ranges.erase(static_cast<const uint8_t*>(p));
    ++st->unpins;
  };
  d.staging.copy_async = [st](void* dst, const void* src, size_t n) {
    const bool down =
        fake_device_state::in(st->device_ranges, src, n) && fake_device_state::in(st->pinned_ranges, dst, n);
    const bool up =
        fake_device_state::in(st->pinned_ranges, src, n) && fake_device_state::in(st->device_ranges, dst, n);
    if (!down && !up)
      throw std::runtime_error("fake device: a staging copy not between device and pinned memory");
    ++st->staged_copies;
    st->staged_bytes += int64_t(n);
    st->queue.push_back({st->next_fence, dst, src, n});
    return st->next_fence++;
  };
  d.staging.wait = [st](uint64_t fence) { st->run_until(fence); };
  d.staging.quiesce = [st] { ++st->quiesces; };
  return d;
}

}  // namespace tandem::test
