// Elementwise activations: softmax (with its fixed-sequence exp), the SiLU-gated and
// GELU-gated FFN activations, and logit soft-capping. Each gives the same bits on every ISA
// path and for any split across threads.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cpu/avx512_sum.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {

// exp(x) for softmax inputs (x <= 0 after subtracting the maximum) as one fixed sequence of
// IEEE single operations, written twice (16 lanes and scalar) with the same bits: Cody-Waite
// reduction x = n ln2 + r, Cephes' degree-5 polynomial for e^r (a few ulp), times 2^n.
// Below -87 (e^x under 2^-125) the result is 0, which a softmax weight cannot tell apart.
constexpr float exp_lo = -87.0f, log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
constexpr float exp_p[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

float exp_fixed(float x) {
  if (!(x >= exp_lo)) return std::isnan(x) ? x : 0.0f;
  const float n = std::nearbyint(x * log2e);
  float r = std::fma(n, -ln2_hi, x);
  r = std::fma(n, -ln2_lo, r);
  const float z = r * r;
  float p = std::fma(exp_p[0], r, exp_p[1]);
  for (int i = 2; i < 6; ++i) p = std::fma(p, r, exp_p[i]);
  const float y = std::fma(p, z, r) + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

TANDEM_AVX512 __m512 exp_fixed16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(exp_lo), _CMP_GE_OQ);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-ln2_hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-ln2_lo), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(exp_p[0]), r, _mm512_set1_ps(exp_p[1]));
  for (int i = 2; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(exp_p[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, z, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 v = _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(e));
  return _mm512_mask_mov_ps(v, nan, x);
}

__attribute__((target("avx2,fma"))) __m256 exp_fixed8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(exp_lo), _CMP_GE_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(log2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-ln2_hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-ln2_lo), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(exp_p[0]), r, _mm256_set1_ps(exp_p[1]));
  for (int i = 2; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_p[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, z, r), _mm256_set1_ps(1.0f));
  // Dead lanes may hold any exponent here; the mask below zeroes them before use.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 v = _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), live);
  return _mm256_blendv_ps(v, x, nan);
}

// The softmax sum: 8 double lanes, lane j adding elements j, j+8, j+16, ... in order, then
// ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), then the n % 8 tail in order (both paths).
double sum_tail(const float* x, size_t n8, size_t n, const double (&l)[8]) {
  double s = ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
  for (size_t i = n8; i < n; ++i) s += double(x[i]);
  return s;
}

TANDEM_AVX512 void softmax_avx512(float* x, size_t n) {
  const size_t n16 = n & ~size_t(15);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < n16; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  float mx = _mm512_reduce_max_ps(m);
  for (size_t i = n16; i < n; ++i) mx = std::max(mx, x[i]);
  const __m512 mv = _mm512_set1_ps(mx);
  __m512d acc = _mm512_setzero_pd();
  for (size_t i = 0; i < n16; i += 16) {
    const __m512 e = exp_fixed16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  // The tail's exps in one masked vector: exp_fixed16 is exp_fixed lane by lane (the scalar
  // calls, with fmaf from libm, took a tenth of a prefill's attention).
  const __mmask16 tail = __mmask16((1u << (n - n16)) - 1u);
  if (tail != 0)
    _mm512_mask_storeu_ps(x + n16, tail, exp_fixed16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + n16), mv)));
  alignas(64) double l[8];
  _mm512_store_pd(l, acc);
  // Elements n16 .. n8 belong to the lanes too (n8 = n rounded down to 8).
  const size_t n8 = n & ~size_t(7);
  for (size_t i = n16; i < n8; ++i) l[i % 8] += double(x[i]);
  const float inv = float(1.0 / sum_tail(x, n8, n, l));
  const __m512 iv = _mm512_set1_ps(inv);
  for (size_t i = 0; i < n16; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), iv));
  if (tail != 0) _mm512_mask_storeu_ps(x + n16, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + n16), iv));
}

__attribute__((target("avx2,fma"))) void softmax_avx2(float* x, size_t n) {
  const size_t n8 = n & ~size_t(7);
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < n8; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float mt[8];
  _mm256_store_ps(mt, m);
  float mx = mt[0];
  for (int j = 1; j < 8; ++j) mx = std::max(mx, mt[j]);
  for (size_t i = n8; i < n; ++i) mx = std::max(mx, x[i]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();  // lanes 0-3 and 4-7
  for (size_t i = 0; i < n8; i += 8) {
    const __m256 e = exp_fixed8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  for (size_t i = n8; i < n; ++i) x[i] = exp_fixed(x[i] - mx);
  alignas(32) double l[8];
  _mm256_store_pd(l, lo);
  _mm256_store_pd(l + 4, hi);
  const float inv = float(1.0 / sum_tail(x, n8, n, l));
  const __m256 iv = _mm256_set1_ps(inv);
  for (size_t i = 0; i < n8; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), iv));
  for (size_t i = n8; i < n; ++i) x[i] *= inv;
}

void softmax_scalar(float* x, size_t n) {
  const float mx = *std::max_element(x, x + n);
  double l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const size_t n8 = n & ~size_t(7);
  for (size_t i = 0; i < n; ++i) {
    x[i] = exp_fixed(x[i] - mx);
    if (i < n8) l[i % 8] += double(x[i]);
  }
  const float inv = float(1.0 / sum_tail(x, n8, n, l));
  for (size_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

void softmax(float* x, size_t n, cpu_isa isa) {
  if (n == 0) return;
  switch (vector_isa(resolve_isa(isa))) {
    case cpu_isa::avx512: return softmax_avx512(x, n);
    case cpu_isa::avx2: return softmax_avx2(x, n);
    default: return softmax_scalar(x, n);
  }
}

namespace {

// silu(g) * u = g * sigmoid(g) * u with sigmoid from e = exp(-|g|) (in (0, 1], so exp_fixed
// applies): 1 / (1 + e) for g >= 0, e / (1 + e) below. The same operations in 16 lanes and
// in scalar code, so the bits do not depend on the path or on how the range is split.
float swiglu_one(float g, float u) {
  const float e = exp_fixed(-std::abs(g));
  const float s = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
  return g * s * u;
}

TANDEM_AVX512 void swiglu_avx512(const float* gate, const float* up, float* out, int64_t b, int64_t e) {
  const __m512 one = _mm512_set1_ps(1.0f);
  int64_t i = b;
  for (; i + 16 <= e; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    // -|g|: the sign bit set, as the scalar negation does.
    const __m512 neg_abs = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(_mm512_abs_ps(g)), _mm512_set1_epi32(int32_t(0x80000000u))));
    const __m512 ex = exp_fixed16(neg_abs);
    const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 s = _mm512_div_ps(_mm512_mask_mov_ps(ex, pos, one), _mm512_add_ps(one, ex));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, s), _mm512_loadu_ps(up + i)));
  }
  for (; i < e; ++i) out[i] = swiglu_one(gate[i], up[i]);
}

__attribute__((target("avx2,fma"))) void swiglu_avx2(const float* gate, const float* up, float* out, int64_t b,
                                                     int64_t e) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)));
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 ex = exp_fixed8(_mm256_or_ps(g, sign));  // -|g|: the sign bit set
    const __m256 pos = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
    const __m256 s = _mm256_div_ps(_mm256_blendv_ps(ex, one, pos), _mm256_add_ps(one, ex));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + i)));
  }
  for (; i < e; ++i) out[i] = swiglu_one(gate[i], up[i]);
}

}  // namespace

void swiglu(const float* gate, const float* up, float* out, size_t n, thread_pool* pool, cpu_isa isa) {
  isa = vector_isa(resolve_isa(isa));
  auto run = [&](int64_t b, int64_t e) {
    if (isa == cpu_isa::avx512) return swiglu_avx512(gate, up, out, b, e);
    if (isa == cpu_isa::avx2) return swiglu_avx2(gate, up, out, b, e);
    for (int64_t i = b; i < e; ++i) out[i] = swiglu_one(gate[i], up[i]);
  };
  parallel_for_if(pool, int64_t(n), int64_t(n), run, int64_t(1) << 14);
}

// GELU-gated FFN activation and logit soft-capping (Gemma 2): scalar, once per FFN / once per
// logits row, far from the matmuls' cost.
void geglu(const float* gate, const float* up, float* out, size_t n, thread_pool* pool) {
  constexpr float k_sqrt_2_over_pi = 0.7978845608028654f;
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float x = gate[i];
      const float g = 0.5f * x * (1.0f + std::tanh(k_sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
      out[i] = g * up[i];
    }
  };
  parallel_for_if(pool, int64_t(n), int64_t(n), run, int64_t(1) << 14);
}

void softcap(float* x, size_t n, float cap) {
  const float inv = 1.0f / cap;
  for (size_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] * inv) * cap;
}

}  // namespace tandem::cpu
