#pragma once
/// std::vector whose data starts on a cache line, for activation buffers the vector kernels
/// read 64 bytes at a time: a row that starts mid-line makes every 16-float load a split
/// load (two lines), measured 5-8% of a prefill matmul's time on avx512 (kernels/cpu/ops.cpp).
#include <cstddef>
#include <new>
#include <vector>

namespace tandem::cpu {

/// Allocates in 64-byte aligned blocks (operator new with align_val_t).
template <class T>
struct cache_line_allocator {
  using value_type = T;
  static constexpr std::align_val_t alignment{64};
  cache_line_allocator() = default;
  template <class U>
  cache_line_allocator(const cache_line_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), alignment)); }
  void deallocate(T* p, std::size_t n) noexcept { ::operator delete(p, n * sizeof(T), alignment); }
  template <class U>
  bool operator==(const cache_line_allocator<U>&) const noexcept {
    return true;
  }
};

/// A vector of T whose data() is 64-byte aligned.
template <class T>
using aligned_vector = std::vector<T, cache_line_allocator<T>>;

}  // namespace tandem::cpu
