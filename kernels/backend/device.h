#pragma once
/// A backend other than the CPU's, as the serving path sees it: how the model runs (`make_ops`,
/// the op table the forward pass is built on), where the KV pools live (`make_pools`: device
/// memory, one pool per spec of the layout set) and how a page crosses between that memory and
/// host memory (`copy`: the host tier's copies; UCX stages pages through host memory the same
/// way). Empty = the CPU backend over host memory. `kernels/backend/cuda` makes the CUDA one.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "kernels/backend/backend.h"
#include "kernels/model/kv_pools.h"

namespace tandem::backend {

struct device {
  std::string name;  ///< "cuda:0"; empty = the CPU backend
  std::function<std::unique_ptr<ops>()> make_ops;
  /// Pools of `n_pages[p]` pages per spec, in the device's memory (the returned set owns them).
  std::function<std::shared_ptr<kv_pools>(const kv_pools_layout& set, std::span<const int32_t> n_pages)> make_pools;
  /// Copies `n` bytes between device and host memory, either way; returns when done.
  std::function<void(void* dst, const void* src, size_t n)> copy;
  bool active() const { return static_cast<bool>(make_ops); }
};

}  // namespace tandem::backend
