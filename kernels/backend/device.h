#pragma once
/// A backend other than the CPU's, as the serving path sees it: how the model runs (`make_ops`,
/// the op table the forward pass is built on), where the KV pools live (`make_pools`: device
/// memory, one pool per spec of the layout set) and how a page crosses between that memory and
/// host memory (`copy`: the host tier's copies; UCX stages pages through host memory the same
/// way). Empty = the CPU backend over host memory. `kernels/backend/cuda` makes the CUDA one.
///
/// `staging` is what the staging path (kernels/backend/page_staging.h) needs: pinned host
/// memory and a copy stream of its own, so the host tier's copies and UCX transfers of a
/// device-resident pool go through a bounded set of pinned buffers. A test fakes it over host
/// memory (tests/fake_device.h).
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "kernels/backend/backend.h"
#include "kernels/model/kv_pools.h"

namespace tandem::backend {

/// Copies between device and pinned host memory on a stream of their own (not the compute
/// stream). All empty = no staging: copies go through `device::copy`.
struct staging_ops {
  /// Page-locked host memory of `bytes` (DMA reaches it without a bounce); throws when none.
  std::function<void*(size_t bytes)> alloc_pinned;
  std::function<void(void* p)> free_pinned;
  /// Page-locks memory allocated elsewhere (a transport's registered region); false = left
  /// pageable (the copies still work, slower). `unpin` undoes it.
  std::function<bool(void* p, size_t bytes)> pin;
  std::function<void(void* p)> unpin;
  /// Queues dst <- src (one side device memory, the other pinned host memory) on the copy
  /// stream; returns its fence. Copies complete in the order they were queued.
  std::function<uint64_t(void* dst, const void* src, size_t bytes)> copy_async;
  /// Returns once the copy of `fence` (and every earlier one) is done.
  std::function<void(uint64_t fence)> wait;
  /// Returns once every kernel queued before the call is done: run before staging pages out,
  /// so a copy never reads a page a queued KV write has not written yet.
  std::function<void()> quiesce;
  bool active() const { return static_cast<bool>(copy_async); }
};

struct device {
  std::string name;  ///< "cuda:0"; empty = the CPU backend
  std::function<std::unique_ptr<ops>()> make_ops;
  /// Pools of `n_pages[p]` pages per spec, in the device's memory (the returned set owns them).
  std::function<std::shared_ptr<kv_pools>(const kv_pools_layout& set, std::span<const int32_t> n_pages)> make_pools;
  /// Copies `n` bytes between device and host memory, either way; returns when done.
  std::function<void(void* dst, const void* src, size_t n)> copy;
  staging_ops staging;
  bool active() const { return static_cast<bool>(make_ops); }
};

}  // namespace tandem::backend
