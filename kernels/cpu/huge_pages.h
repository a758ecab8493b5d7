#pragma once
/// Large buffers on 2 MiB pages: the model's weight copies (amx) and KV pools are streamed or
/// read all over, and on 4 KiB pages the hardware prefetcher stops at every page boundary and
/// scattered reads miss the TLB.
#include <cstddef>
#include <cstdlib>

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

}  // namespace tandem::cpu
