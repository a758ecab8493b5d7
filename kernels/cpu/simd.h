#pragma once
/// <immintrin.h> for the CPU kernels. GCC 12's AVX-512 headers self-initialise their
/// "undefined" vectors (GCC bug 105593), which -Wuninitialized flags once inlined; the
/// suppression applies to the header's own lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace tandem::cpu {

/// _mm_prefetch(p, _MM_HINT_T0 / _MM_HINT_T1) as asm statements with a side effect. GCC
/// treats the builtin as having none, so an inline function or lambda whose work is a loop of
/// them counts as "const" to its interprocedural passes and a call of it is deleted whole:
/// GCC 12 dropped every request of the attention kernel's row prefetch (its lambda computed
/// the addresses and issued nothing) and of a page-start prefetch with an early exit.
inline void prefetch_t0(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}
inline void prefetch_t1(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}

}  // namespace tandem::cpu
