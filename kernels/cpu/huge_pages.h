#pragma once
/// Large buffers on 2 MiB pages: the model's weight copies (amx) and KV pools are streamed or
/// read all over, and on 4 KiB pages the hardware prefetcher stops at every page boundary and
/// scattered reads miss the TLB.
#include <cstddef>
#include <cstdlib>
#include <new>

namespace tandem::cpu {

/// Frees what huge_alloc returned.
struct huge_free {
  void operator()(void* p) const { std::free(p); }
};

/// At least `bytes` (64 if fewer), 64-byte aligned; from 2 MiB up, rounded to whole 2 MiB
/// pages, 2 MiB aligned and advised onto huge pages (advice only: 4 KiB pages if the kernel
/// refuses), so a buffer wastes at most one page. `allocated` gets the rounded size. Not
/// zeroed. Null if the allocation fails.
void* huge_alloc(size_t bytes, size_t& allocated);

/// A std::vector allocator on huge_alloc: a large vector (a packed weight copy) lands on 2 MiB
/// pages. Throws std::bad_alloc when the memory is not there.
template <class T>
struct huge_page_allocator {
  using value_type = T;
  huge_page_allocator() = default;
  template <class U>
  huge_page_allocator(const huge_page_allocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    size_t allocated = 0;
    void* p = huge_alloc(n * sizeof(T), allocated);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) noexcept { std::free(p); }
  template <class U>
  bool operator==(const huge_page_allocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace tandem::cpu
