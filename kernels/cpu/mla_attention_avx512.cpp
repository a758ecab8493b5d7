// The avx512 path of mla_attention (mla_attention.h) for G tokens of one head at once: each
// cached latent row is loaded once and feeds every token of the group. Per (token, position)
// it is exactly what dot() + dot() + softmax() + axpy() compute on the avx512 path (the same
// bits): each dot's two accumulators over 16-float chunks (chunk c to s[c % 2]), s0 + s1 and
// the hsum16 tree (run for 16 positions at once, hsum16_x16), plus dot's empty tail (+0.0f);
// each output element's fma chain over the positions in ascending order from zero.
#include "kernels/cpu/mla_attention_avx512.h"

#include <algorithm>

#include "kernels/cpu/avx512_sum.h"
#include "kernels/cpu/ops.h"

namespace tandem::cpu::mla_detail {

namespace {

// s0 + s1 of dot_avx512(q, row, n) for queries g0 <= g < g1 of G (n a multiple of 16), into
// A[g] (the others are zero: a decode token's group of one costs one query's work).
template <int G>
TANDEM_AVX512 __attribute__((always_inline)) inline void dot_pairs(const float* const* q, const float* row, int64_t n,
                                                                   int g0, int g1, __m512* A) {
  __m512 s0[G], s1[G];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512 b0 = _mm512_loadu_ps(row + k), b1 = _mm512_loadu_ps(row + k + 16);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      if (g < g0 || g >= g1) continue;
      s0[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q[g] + k), b0, s0[g]);
      s1[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q[g] + k + 16), b1, s1[g]);
    }
  }
  if (k < n) {  // one more 16-float chunk: dot_avx512's second loop, into s0
    const __m512 b0 = _mm512_loadu_ps(row + k);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      if (g >= g0 && g < g1) s0[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q[g] + k), b0, s0[g]);
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) A[g] = _mm512_add_ps(s0[g], s1[g]);
}

}  // namespace

TANDEM_AVX512 void group_scores(const float* const* ql, const float* const* qp, int gn, int64_t len0,
                                const float* const* rows, int32_t kv_lora_rank, int32_t rope_dims, float scale,
                                float* att, int64_t att_stride) {
  const int64_t end = len0 + gn - 1;  // token g attends to [0, len0 + g)
  alignas(64) __m512 lat[kGroup][16], pe[kGroup][16];
  alignas(64) float rl[16], rp[16];
  for (int64_t p0 = 0; p0 < end; p0 += 16) {
    const int64_t m = std::min<int64_t>(16, end - p0);
    for (int64_t j = 0; j < 16; ++j) {
      __m512 a[kGroup], b[kGroup];
      if (j < m) {
        const int g0 = int(std::max<int64_t>(0, p0 + j - len0 + 1));
        dot_pairs<kGroup>(ql, rows[p0 + j], kv_lora_rank, g0, gn, a);
        dot_pairs<kGroup>(qp, rows[p0 + j] + kv_lora_rank, rope_dims, g0, gn, b);
      } else {
        for (int g = 0; g < kGroup; ++g) a[g] = b[g] = _mm512_setzero_ps();
      }
      for (int g = 0; g < kGroup; ++g) lat[g][j] = a[g], pe[g][j] = b[g];
    }
    for (int g = 0; g < gn; ++g) {
      hsum16_x16(lat[g], rl);
      hsum16_x16(pe[g], rp);
      const int64_t stop = std::min<int64_t>(m, len0 + g - p0);
      for (int64_t j = 0; j < stop; ++j) att[g * att_stride + p0 + j] = ((rl[j] + 0.0f) + (rp[j] + 0.0f)) * scale;
    }
  }
}

TANDEM_AVX512 void group_values(const float* att, int64_t att_stride, int gn, int64_t len0, const float* const* rows,
                                int32_t kv_lora_rank, float* const* out) {
  constexpr int V = 2;  // 16-float chunks of the output per pass: kGroup x V accumulators
  const int64_t end = len0 + gn - 1;
  for (int64_t c = 0; c < kv_lora_rank; c += 16 * V) {
    const int nv = int(std::min<int64_t>(V, (kv_lora_rank - c) / 16));
    __m512 y[kGroup][V];
    for (int g = 0; g < kGroup; ++g)
      for (int v = 0; v < V; ++v) y[g][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < end; ++p) {
      const float* r = rows[p] + c;
      const __m512 x0 = _mm512_loadu_ps(r), x1 = nv > 1 ? _mm512_loadu_ps(r + 16) : _mm512_setzero_ps();
      const int g0 = int(std::max<int64_t>(0, p - len0 + 1));
#pragma GCC unroll 8
      for (int g = 0; g < kGroup; ++g) {
        if (g < g0 || g >= gn) continue;
        const __m512 a = _mm512_set1_ps(att[g * att_stride + p]);
        y[g][0] = _mm512_fmadd_ps(a, x0, y[g][0]);
        y[g][1] = _mm512_fmadd_ps(a, x1, y[g][1]);
      }
    }
    for (int g = 0; g < gn; ++g)
      for (int v = 0; v < nv; ++v) _mm512_storeu_ps(out[g] + c + 16 * v, y[g][v]);
  }
}

}  // namespace tandem::cpu::mla_detail
