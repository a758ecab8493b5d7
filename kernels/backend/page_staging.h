#pragma once
/// The staging path between a device-resident KV pool and host memory (a GPU's pool; Debian's
/// UCX has no CUDA transport and the host tier is plain host memory): pages cross through
/// pinned host buffers on the device's own copy stream (device.h's staging_ops).
///
/// - `staging_slots`: a fixed number of page slots (never grows). A transfer leases all the
///   slots it needs or none; a refusal is counted, and the caller waits or fails.
/// - `page_stager`: batches of page copies (the host tier's) pipelined through a ring of
///   pinned buffers: a device-to-host copy of page i+1 runs while page i leaves its buffer.
///   Every call returns with every buffer free again and every copy done.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "kernels/backend/device.h"

namespace tandem::backend {

/// A bounded set of slot indices 0..capacity-1.
class staging_slots {
 public:
  explicit staging_slots(int32_t capacity);
  /// `n` free slots (lowest first), or nullopt when fewer are free (counted in refused()).
  std::optional<std::vector<int32_t>> acquire(int32_t n);
  /// Returns slots; throws tandem::error on a slot that is not held (a double release).
  void release(std::span<const int32_t> slots);
  int32_t capacity() const { return int32_t(held_.size()); }
  int32_t in_use() const { return capacity() - int32_t(free_.size()); }
  /// The most slots ever held at once (<= capacity).
  int32_t high_water() const { return high_water_; }
  /// acquire() calls that found too few free slots.
  int64_t refused() const { return refused_; }

 private:
  std::vector<int32_t> free_;  ///< free slots, highest first (so back() is the lowest)
  std::vector<bool> held_;
  int32_t high_water_ = 0;
  int64_t refused_ = 0;
};

/// One page (or any span of bytes) to copy: `dst` <- `src`, `bytes` long.
struct page_copy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

/// Host <-> device copies through `n_buffers` pinned buffers of `buffer_bytes` each (allocated
/// once here, freed by the destructor). A copy larger than a buffer goes in buffer-sized parts.
class page_stager {
 public:
  page_stager(staging_ops ops, int32_t n_buffers, size_t buffer_bytes);
  ~page_stager();
  page_stager(const page_stager&) = delete;
  page_stager& operator=(const page_stager&) = delete;

  /// Device -> host: each `src` is device memory, each `dst` host memory. Returns when every
  /// byte is in host memory. Copies to the same host bytes land in list order.
  void to_host(std::span<const page_copy> copies);
  /// Host -> device: each `src` is host memory, each `dst` device memory. Returns when every
  /// byte is in device memory.
  void to_device(std::span<const page_copy> copies);

  int32_t buffers() const { return int32_t(buffers_.size()); }
  size_t buffer_bytes() const { return buffer_bytes_; }
  /// Buffers holding a copy in flight: 0 whenever no call is running.
  int32_t busy() const;
  int64_t copies() const { return copies_; }  ///< copies queued on the copy stream
  int64_t bytes() const { return bytes_; }
  /// Times a copy waited for a buffer still in flight (the ring was full).
  int64_t buffer_waits() const { return buffer_waits_; }

 private:
  struct buffer {
    void* host = nullptr;  ///< pinned
    bool busy = false;
    uint64_t fence = 0;
    void* drain_to = nullptr;  ///< to_host: where the bytes go once the copy is done
    size_t bytes = 0;
  };
  /// Waits for buffer `b`'s copy; a device-to-host one then leaves the buffer.
  void finish(buffer& b);
  /// Finishes every busy buffer in the order they were filled.
  void finish_all();
  buffer& next();

  staging_ops ops_;
  size_t buffer_bytes_ = 0;
  std::vector<buffer> buffers_;
  size_t next_ = 0;
  int64_t copies_ = 0, bytes_ = 0, buffer_waits_ = 0;
};

}  // namespace tandem::backend
