#include "kernels/backend/cuda/cuda_staging.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/backend/cuda/device_memory.h"
#include "kernels/base/error.h"

namespace tandem::backend {

namespace {

using cuda_detail::check;

/// The copy stream and the events that fence its copies. One per device object; used from the
/// worker's thread, locked anyway (a device object may be shared).
class copy_stream {
 public:
  explicit copy_stream(int32_t device) : device_(device) {}
  ~copy_stream() {
    if (stream_ == nullptr) return;
    cudaStreamSynchronize(stream_);
    for (auto& [f, e] : events_) cudaEventDestroy(e);
    for (cudaEvent_t e : spare_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }
  copy_stream(const copy_stream&) = delete;
  copy_stream& operator=(const copy_stream&) = delete;

  uint64_t copy(void* dst, const void* src, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    check(cudaSetDevice(device_), "selecting the device for a staging copy");
    if (stream_ == nullptr)
      check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the copy stream");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "queueing a staging copy");
    if (events_.size() >= k_max_events) retire(events_[events_.size() / 2].first);  // bounded
    cudaEvent_t e = nullptr;
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    } else {
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating a copy fence");
    }
    check(cudaEventRecord(e, stream_), "recording a copy fence");
    events_.emplace_back(next_, e);
    return next_++;
  }

  void wait(uint64_t fence) {
    std::lock_guard<std::mutex> lock(mu_);
    retire(fence);
  }

 private:
  /// Waits for the newest event at or before `fence` (the stream runs in order) and recycles
  /// every event up to it.
  void retire(uint64_t fence) {
    cudaEvent_t last = nullptr;
    size_t n = 0;
    while (n < events_.size() && events_[n].first <= fence) last = events_[n++].second;
    if (last == nullptr) return;  // already retired: that copy is done
    check(cudaEventSynchronize(last), "waiting for a staging copy");
    for (size_t i = 0; i < n; ++i) spare_.push_back(events_[i].second);
    events_.erase(events_.begin(), events_.begin() + std::ptrdiff_t(n));
  }

  static constexpr size_t k_max_events = 1024;
  int32_t device_;
  std::mutex mu_;
  cudaStream_t stream_ = nullptr;
  std::deque<std::pair<uint64_t, cudaEvent_t>> events_;
  std::vector<cudaEvent_t> spare_;
  uint64_t next_ = 1;
};

}  // namespace

staging_ops make_cuda_staging(int32_t device) {
  auto cs = std::make_shared<copy_stream>(device);
  staging_ops s;
  s.alloc_pinned = [device](size_t bytes) -> void* {
    check(cudaSetDevice(device), "selecting the device for pinned memory");
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (e != cudaSuccess)
      throw tandem::error(
          fmt::format("cuda backend: no {} bytes of pinned host memory for staging ({}); raise the "
                      "locked-memory limit (ulimit -l) or lower the staging size",
                      bytes, cudaGetErrorString(e)));
    return p;
  };
  s.free_pinned = [](void* p) { cudaFreeHost(p); };
  s.pin = [device](void* p, size_t bytes) {
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
      cudaGetLastError();  // left pageable: the copies still work, through CUDA's own bounce
      return false;
    }
    return true;
  };
  s.unpin = [](void* p) { cudaHostUnregister(p); };
  s.copy_async = [cs](void* dst, const void* src, size_t bytes) { return cs->copy(dst, src, bytes); };
  s.wait = [cs](uint64_t fence) { cs->wait(fence); };
  // The compute stream is another non-blocking stream: wait for the whole device.
  s.quiesce = [device] {
    check(cudaSetDevice(device), "selecting the device");
    check(cudaDeviceSynchronize(), "waiting for the queued kernels before a staging copy");
  };
  return s;
}

}  // namespace tandem::backend
