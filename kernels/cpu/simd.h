#pragma once
/// <immintrin.h> for the CPU kernels. GCC 12's AVX-512 headers self-initialise their
/// "undefined" vectors (GCC bug 105593), which -Wuninitialized flags once inlined; the
/// suppression applies to the header's own lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
