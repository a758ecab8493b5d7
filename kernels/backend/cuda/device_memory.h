#pragma once
/// Device memory for the CUDA backend: error checks, grow-only stream-ordered arrays, and the
/// cache of vector weights that arrive as host pointers.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace tandem::backend::cuda_detail {

/// Throws tandem::error "cuda backend: <what>: <CUDA's message>" unless e is cudaSuccess.
void check(cudaError_t e, const char* what);
/// Throws tandem::error naming `what` when `s` is capturing a graph (cuda_graphs.h): for the
/// steps a capture must not take (allocating, waiting, copying from pageable memory).
void refuse_in_capture(cudaStream_t s, const char* what);

/// A ring of pinned host memory that host-to-device copies go through: a copy from pageable
/// memory waits for the stream (CUDA stages it synchronously), one from pinned memory does not,
/// so the per-op descriptors (page tables, slots, rope angles) do not stall the queue. When the
/// ring wraps it waits for the stream, so no queued copy still reads the part reused.
class host_staging {
 public:
  host_staging(cudaStream_t s, size_t bytes);
  ~host_staging();
  host_staging(const host_staging&) = delete;
  host_staging& operator=(const host_staging&) = delete;
  /// Enqueues dst <- host (bytes) on the stream; `host` may be reused once this returns.
  void copy(void* dst, const void* host, size_t bytes);
  /// Restarts at the ring's beginning; only when the stream has finished every queued copy.
  void rewind() { pos_ = 0; }

 private:
  cudaStream_t stream_;
  uint8_t* ring_ = nullptr;
  size_t cap_ = 0, pos_ = 0;
};

/// Device memory grown on demand on a stream (stream-ordered allocation, so a growth never
/// frees memory a queued kernel still reads); contents survive only when no growth was needed.
class device_bytes {
 public:
  device_bytes(cudaStream_t s, host_staging* staging) : stream_(s), staging_(staging) {}
  ~device_bytes();
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
  void* get(size_t bytes);
  /// get(bytes) filled with `bytes` from host memory (copied before this returns).
  void* upload(const void* host, size_t bytes);

 private:
  cudaStream_t stream_;
  host_staging* staging_;
  void* p_ = nullptr;
  size_t cap_ = 0;
};

/// True when `p` is memory the device can read (device, managed or mapped host memory).
bool device_readable(const void* p);

/// Device copies of vector weights given as host pointers (norms, biases): uploaded on first
/// use, compared with their host copy on each use and re-sent if changed. At most max_entries
/// vectors (a model has a few per layer); past that the cache starts over.
class host_vectors {
 public:
  explicit host_vectors(cudaStream_t s) : stream_(s) {}
  ~host_vectors();
  host_vectors(const host_vectors&) = delete;
  host_vectors& operator=(const host_vectors&) = delete;
  /// `p` itself when the device can read it, else its device copy of n floats.
  const float* get(const float* p, size_t n);
  size_t size() const { return map_.size(); }
  static constexpr size_t max_entries = 1 << 16;

 private:
  struct entry {
    std::vector<float> host;
    float* device = nullptr;
  };
  void clear();
  cudaStream_t stream_;
  std::unordered_map<const float*, entry> map_;
};

}  // namespace tandem::backend::cuda_detail
