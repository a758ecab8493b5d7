// quantize_acts on AVX-512 (quant_matmul.h): the scalar code's arithmetic 16 values at a time,
// so the same bits. A prefill's activations are quantized before every low-bit matmul; the
// scalar loop (about 3 ns a value) was 15-20% of a q8_0 prefill matmul's time.
#include <cmath>

#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_QA512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

// Codes of 16 values: round to nearest even by adding and subtracting 1.5 * 2^23, clamped to
// [-127, 127], NaN to 0. The multiply and the add are rounded one after the other, as the
// scalar code does: the explicit-rounding forms, because GCC contracts a plain
// _mm512_add_ps(_mm512_mul_ps(..)) into one fma (-ffp-contract=fast), which rounds a product
// just off a tie the other way (test_quant catches it).
TANDEM_QA512 inline __m512i codes16(const float* v, __m512 id) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_mul_round_ps(_mm512_loadu_ps(v), id, nearest);
  const __m512 r = _mm512_sub_round_ps(_mm512_add_round_ps(t, magic, nearest), magic, nearest);
  const __mmask16 ordered = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
  const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  return _mm512_maskz_cvttps_epi32(ordered, c);
}

}  // namespace

TANDEM_QA512 void quantize_acts_avx512(const float* x, int64_t batch, int64_t k, int group, quant_acts& a) {
  const int64_t lanes = a.pair_lanes();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < k / group; ++g) {
      const float* v = x + b * k + g * group;
      // max(|v|, m) keeps m when v is NaN, as std::max(m, fabs(v)) does.
      __m512 m = _mm512_setzero_ps();
      for (int i = 0; i < group; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + i)), m);
      const float amax = _mm512_reduce_max_ps(m);
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      a.d[size_t(b * (k / group) + g)] = amax / 127.0f;
      int8_t* q = a.qs.data() + b * k + g * group;
      const __m512 idv = _mm512_set1_ps(id);
      for (int s = 0; s < group / 32; ++s) {
        const __m512i c0 = codes16(v + 32 * s, idv), c1 = codes16(v + 32 * s + 16, idv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * s), _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * s + 16), _mm512_cvtepi32_epi8(c1));
        a.sums[size_t(b * (k / 32) + (g * group) / 32 + s)] = int16_t(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
        if (group != 32) continue;
        // Each 4 codes' sum: (c0 lanes 4l..4l+3) as the adjacent pairs' sums, twice.
        const __m256i p0 = _mm512_cvtepi32_epi16(c0), p1 = _mm512_cvtepi32_epi16(c1);
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i s2_0 = _mm256_madd_epi16(p0, ones), s2_1 = _mm256_madd_epi16(p1, ones);  // pairs
        // hadd within 128-bit lanes: [a0+a1, a2+a3, b0+b1, b2+b3 | ...]; then fix the order.
        const __m256i s4 = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s2_0, s2_1), _MM_SHUFFLE(3, 1, 2, 0));
        const int64_t base = b * lanes + g / 2 * 16 + 8 * (g % 2);
        _mm256_store_si256(reinterpret_cast<__m256i*>(a.off128.data() + base), _mm256_mullo_epi32(s4, _mm256_set1_epi32(-128)));
        _mm256_store_ps(a.d16.data() + base, _mm256_set1_ps(a.d[size_t(b * (k / 32) + g)]));
      }
    }
}

}  // namespace tandem::cpu::quant_detail
