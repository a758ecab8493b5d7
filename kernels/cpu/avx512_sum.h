#pragma once
/// AVX-512 horizontal sums shared by the matmul (ops.cpp) and attention (attention.cpp)
/// kernels: both must reduce in exactly the same tree, so prefill and decode (and every
/// batch size) give the same bits.
#include "kernels/cpu/simd.h"

/// The target attribute of every AVX-512 kernel function.
#define TANDEM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace tandem::cpu {

/// The sum of a vector's 16 lanes: lane i + lane i+8, then i+4, then i+2, then i+1.

TANDEM_AVX512 inline float hsum16(__m512 s) {
  const __m256 lo = _mm512_castps512_ps256(s);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
  const __m256 v = _mm256_add_ps(lo, hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// out[j] = hsum16(A[j]) for 16 vectors, bit for bit: the same tree (lane i + lane i+8, then
// i+4, then i+2, then i+1) run as a transpose network, 45 instructions instead of 16 x 8.
TANDEM_AVX512 __attribute__((always_inline)) inline void hsum16_x16(const __m512 (&A)[16], float* out) {
  __m512 B[8], C[4], D[2];
  for (int m = 0; m < 8; ++m)  // lane i + lane i+8: B[m] = [v(A[2m]) | v(A[2m+1])]
    B[m] = _mm512_add_ps(_mm512_shuffle_f32x4(A[2 * m], A[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(A[2 * m], A[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)  // + lane i+4: quarter q of C[m] is h of A[4m+q]
    C[m] = _mm512_add_ps(_mm512_shuffle_f32x4(B[2 * m], B[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(B[2 * m], B[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)  // + lane i+2: quarter q of D[m] = [g(A[8m+q]), g(A[8m+4+q])]
    D[m] = _mm512_add_ps(_mm512_shuffle_ps(C[2 * m], C[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(C[2 * m], C[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + lane i+1: lane 4q + j of E is the sum of A[4j + q].
  const __m512 E = _mm512_add_ps(_mm512_shuffle_ps(D[0], D[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(D[0], D[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4q + j holds A[4j + q]: a fixed permutation puts A[j] in lane j.
  const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(perm, E));
}

}  // namespace tandem::cpu
