#include "kernels/backend/cuda/device_memory.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/base/error.h"

namespace tandem::backend::cuda_detail {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  throw tandem::error(fmt::format("cuda backend: {}: {} ({})", what, cudaGetErrorString(e), cudaGetErrorName(e)));
}

device_bytes::~device_bytes() {
  if (p_ != nullptr) cudaFreeAsync(p_, stream_);
}

void* device_bytes::get(size_t bytes) {
  if (bytes <= cap_ && p_ != nullptr) return p_;
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
  // From pageable memory the copy is staged before this returns, so the caller may reuse it.
  if (bytes > 0) check(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, stream_), "copying to the device");
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
