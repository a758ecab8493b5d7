#include "kernels/backend/cuda/device_memory.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/base/error.h"

namespace tandem::backend::cuda_detail {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  throw tandem::error(fmt::format("cuda backend: {}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

void refuse_in_capture(cudaStream_t s, const char* what) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone)
    throw tandem::error(fmt::format("cuda backend: {} while recording a decode step's graph", what));
}

host_staging::host_staging(cudaStream_t s, size_t bytes) : stream_(s) {
  // Without pinned memory (a restricted host) every copy takes the pageable path instead.
  if (cudaMallocHost(reinterpret_cast<void**>(&ring_), bytes) == cudaSuccess) {
    cap_ = bytes;
  } else {
    cudaGetLastError();
    ring_ = nullptr;
  }
}

host_staging::~host_staging() {
  if (ring_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaFreeHost(ring_);
  }
}

void host_staging::copy(void* dst, const void* host, size_t bytes) {
  if (bytes == 0) return;
  if (bytes > cap_) {  // larger than the ring: CUDA stages it (and waits for the stream)
    refuse_in_capture(stream_, "a copy from pageable memory");
    check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_), "copying to the device");
    return;
  }
  if (pos_ + bytes > cap_) {
    refuse_in_capture(stream_, "wrapping the staging ring");
    check(cudaStreamSynchronize(stream_), "waiting for the staged copies");
    pos_ = 0;
  }
  std::memcpy(ring_ + pos_, host, bytes);
  check(cudaMemcpyAsync(dst, ring_ + pos_, bytes, cudaMemcpyHostToDevice, stream_), "copying to the device");
  pos_ += (bytes + 255) / 256 * 256;
}

device_bytes::~device_bytes() {
  if (p_ != nullptr) cudaFreeAsync(p_, stream_);
}

void* device_bytes::get(size_t bytes) {
  if (bytes <= cap_ && p_ != nullptr) return p_;
  refuse_in_capture(stream_, "growing a scratch area");
  if (p_ != nullptr) check(cudaFreeAsync(p_, stream_), "freeing a scratch area");
  p_ = nullptr;
  cap_ = 0;
  // Grow by half again so a slowly growing size does not reallocate every call.
  const size_t want = bytes + bytes / 2 + 256;
  check(cudaMallocAsync(&p_, want, stream_), fmt::format("allocating {} bytes of scratch", want).c_str());
  cap_ = want;
  return p_;
}

void* device_bytes::upload(const void* host, size_t bytes) {
  void* d = get(bytes);
  staging_->copy(d, host, bytes);
  return d;
}

bool device_readable(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ||
         (a.type == cudaMemoryTypeHost && a.devicePointer == p);
}

host_vectors::~host_vectors() { clear(); }

void host_vectors::clear() {
  for (auto& [p, e] : map_) cudaFreeAsync(e.device, stream_);
  map_.clear();
}

const float* host_vectors::get(const float* p, size_t n) {
  if (p == nullptr || device_readable(p)) return p;
  auto it = map_.find(p);
  if (it != map_.end() && it->second.host.size() == n &&
      std::memcmp(it->second.host.data(), p, n * sizeof(float)) == 0)
    return it->second.device;
  refuse_in_capture(stream_, "uploading a changed vector weight");
  if (it == map_.end() && map_.size() >= max_entries) clear();
  entry& e = map_[p];
  if (e.host.size() != n) {
    if (e.device != nullptr) check(cudaFreeAsync(e.device, stream_), "freeing a vector weight");
    e.device = nullptr;
    check(cudaMallocAsync(reinterpret_cast<void**>(&e.device), n * sizeof(float) + 4, stream_),
          "allocating a vector weight");
  }
  e.host.assign(p, p + n);
  // From the cache's own copy: it lives on until the next change, so the copy may run late.
  check(cudaMemcpyAsync(e.device, e.host.data(), n * sizeof(float), cudaMemcpyHostToDevice, stream_),
        "copying a vector weight");
  return e.device;
}

}  // namespace tandem::backend::cuda_detail
