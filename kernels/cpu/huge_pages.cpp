#include "kernels/cpu/huge_pages.h"

#include <sys/mman.h>

#include <algorithm>

namespace tandem::cpu {

void* huge_alloc(size_t bytes, size_t& allocated) {
  constexpr size_t huge = size_t(2) << 20;
  const bool huge_pages = bytes >= huge;
  const size_t align = huge_pages ? huge : 64;
  allocated = (std::max<size_t>(bytes, 64) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, allocated);
  if (p != nullptr && huge_pages) madvise(p, allocated, MADV_HUGEPAGE);
  return p;
}

}  // namespace tandem::cpu
