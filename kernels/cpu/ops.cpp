#include "kernels/cpu/ops.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "actors/common/error.h"

namespace tandem::cpu {

namespace {

// Checked once per process; a const after initialisation, not mutable state.
bool has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
bool has_f16c() {
  static const bool ok = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return ok;
}
bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && has_avx2_fma() && has_f16c();
  return ok;
}

#define TANDEM_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

TANDEM_AVX512 float hsum16(__m512 s) {
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

TANDEM_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), s1);
  }
  for (; k + 16 <= n; k += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
  float r = hsum16(_mm512_add_ps(s0, s1));
  float tail = 0.0f;
  for (; k < n; ++k) tail = std::fma(a[k], b[k], tail);
  return r + tail;
}

TANDEM_AVX512 void axpy_avx512(float a, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

__attribute__((target("avx2,fma"))) void axpy_avx2(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}

float dot_generic(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[k + j] * b[k + j];
  float tail = 0.0f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(),
         s3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
  }
  for (; k + 8 <= n; k += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
  __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  float tail = 0.0f;
  for (; k < n; ++k) tail += a[k] * b[k];
  return r + tail;
}

__attribute__((target("avx,f16c"))) void f16_row_f16c(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = fp16_to_fp32(in[i]);
}

// Widening by a shift is exact; returns how many elements it converted.
__attribute__((target("avx2"))) int64_t bf16_row_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  return i;
}

// Same values as the scalar path (d * float(q) is exact-rounded either way).
__attribute__((target("avx2,f16c"))) void q8_0_row_avx2(const block_q8_0* blocks, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(blocks[b].d));
    for (int j = 0; j < q8_0_block; j += 8) {
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blocks[b].qs + j));
      _mm256_storeu_ps(out + b * q8_0_block + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    }
  }
}

}  // namespace

// amx is never picked here: its batch-1 decode is slower (see amx.h); it is chosen by name.
cpu_isa detected_isa() {
  if (has_avx512()) return cpu_isa::avx512;
  if (has_avx2_fma() && has_f16c()) return cpu_isa::avx2;
  return cpu_isa::scalar;
}

bool isa_supported(cpu_isa i) {
  switch (i) {
    case cpu_isa::best:
    case cpu_isa::scalar: return true;
    case cpu_isa::avx2: return has_avx2_fma() && has_f16c();
    case cpu_isa::avx512: return has_avx512();
    case cpu_isa::amx: return has_avx512() && amx_usable();
  }
  return false;
}

cpu_isa resolve_isa(cpu_isa i) {
  if (i == cpu_isa::best) return detected_isa();
  if (!isa_supported(i))
    throw tandem::error(fmt::format("this CPU cannot run the {} kernels; use best or one of scalar{}{}{}",
                                    to_string(i), isa_supported(cpu_isa::avx2) ? ", avx2" : "",
                                    isa_supported(cpu_isa::avx512) ? ", avx512" : "",
                                    isa_supported(cpu_isa::amx) ? ", amx" : ""));
  return i;
}

std::string_view to_string(cpu_isa i) {
  switch (i) {
    case cpu_isa::best: return "best";
    case cpu_isa::scalar: return "scalar";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::avx512: return "avx512";
    case cpu_isa::amx: return "amx";
  }
  return "?";
}

cpu_isa parse_isa(std::string_view s) {
  for (cpu_isa i : all_isas)
    if (s == to_string(i)) return i;
  throw tandem::error(fmt::format("unknown kernel path '{}'; use best, scalar, avx2, avx512 or amx", s));
}

float fp16_to_fp32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        mant <<= 1;
        ++e;
      } while (!(mant & 0x400));
      u = sign | uint32_t(127 - 15 - e) << 23 | (mant & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | mant << 13;
  } else {
    u = sign | (exp + 112) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t fp32_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000);
  uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 | ((abs >> 13) & 0x3ff) : 0);
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: overflow
  if (abs < 0x38800000u) {                       // below the smallest normal half
    if (abs < 0x33000000u) return sign;          // < half of the smallest subnormal
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // half subnormal = m * 2^(e - 150 + 24)
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1))) ++r;
    return sign | uint16_t(r);
  }
  uint32_t r = ((abs - 0x38000000u) >> 13);
  uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) ++r;
  return sign | uint16_t(r);
}

namespace {
constexpr float fp16_max = 65504.0f;  // the largest finite half

// fp32_to_fp16_row's bits: VCVTPS2PH rounds to nearest even and makes half subnormals as
// fp32_to_fp16 does (MXCSR's flush-to-zero does not apply); finite values beyond the half
// range are clamped to +-65504 first (max(-c, x) and min(c, .) return x when it is NaN).
__attribute__((target("avx,f16c"))) int64_t fp16_row_f16c(const float* in, uint16_t* out, int64_t n) {
  const __m256 c = _mm256_set1_ps(fp16_max), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    const __m256 clamped = _mm256_min_ps(c, _mm256_max_ps(_mm256_set1_ps(-fp16_max), x));
    const __m256 is_inf = _mm256_cmp_ps(_mm256_and_ps(x, abs_mask), inf, _CMP_EQ_OQ);
    const __m256 v = _mm256_blendv_ps(clamped, x, is_inf);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  return i;
}
}  // namespace

void fp32_to_fp16_row(const float* in, uint16_t* out, int64_t n) {
  int64_t i = has_f16c() ? fp16_row_f16c(in, out, n) : 0;
  for (; i < n; ++i)
    out[i] = fp32_to_fp16(std::isfinite(in[i]) ? std::clamp(in[i], -fp16_max, fp16_max) : in[i]);
}

uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

void dequantize_row(ggml_type t, const void* row, float* out, int64_t n) {
  switch (t) {
    case ggml_type::f32: std::memcpy(out, row, size_t(n) * 4); return;
    case ggml_type::f16: {
      auto in = static_cast<const uint16_t*>(row);
      if (has_f16c()) {
        f16_row_f16c(in, out, n);
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(in[i]);
      }
      return;
    }
    case ggml_type::bf16: {
      auto in = static_cast<const uint16_t*>(row);
      int64_t i = has_avx2_fma() ? bf16_row_avx2(in, out, n) : 0;
      for (; i < n; ++i) out[i] = bf16_to_fp32(in[i]);
      return;
    }
    case ggml_type::q8_0: {
      if (n % q8_0_block != 0)
        throw tandem::error(fmt::format("q8_0 row of {} elements is not a multiple of {}", n, q8_0_block));
      auto blocks = static_cast<const block_q8_0*>(row);
      if (has_avx2_fma() && has_f16c()) {
        q8_0_row_avx2(blocks, out, n / q8_0_block);
        return;
      }
      for (int64_t b = 0; b < n / q8_0_block; ++b) {
        float d = fp16_to_fp32(blocks[b].d);
        for (int j = 0; j < q8_0_block; ++j) out[b * q8_0_block + j] = d * float(blocks[b].qs[j]);
      }
      return;
    }
    default:
      throw tandem::error(fmt::format("tensor type {} is not supported for compute; use f32, f16, bf16 or q8_0",
                                      to_string(t)));
  }
}

void get_rows(const tensor_view& table, std::span<const int32_t> ids, float* out) {
  const int64_t n = table.cols();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows())
      throw tandem::error(fmt::format("token id {} is out of range [0, {})", ids[i], table.rows()));
    dequantize_row(table.type, table.row(ids[i]), out + i * n, n);
  }
}

float dot(const float* a, const float* b, int64_t n) { return dot(a, b, n, cpu_isa::best); }

float dot(const float* a, const float* b, int64_t n, cpu_isa isa) {
  switch (vector_isa(resolve_isa(isa))) {
    case cpu_isa::avx512: return dot_avx512(a, b, n);
    case cpu_isa::avx2: return dot_avx2(a, b, n);
    default: return dot_generic(a, b, n);
  }
}

namespace {

// The largest value, NaNs skipped (vmaxps returns its second operand when either is a NaN,
// so a NaN lane in x is replaced by the running maximum m); -inf when every value is NaN.
TANDEM_AVX512 float max_skip_nan_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
  float r = _mm512_reduce_max_ps(m);
  for (; i < n; ++i)
    if (x[i] > r) r = x[i];
  return r;
}

// The first i with x[i] == v (v is one of the values), 16 at a time.
TANDEM_AVX512 int64_t find_first_avx512(const float* x, int64_t n, float v) {
  const __m512 vv = _mm512_set1_ps(v);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    if (const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vv, _CMP_EQ_OQ); k != 0)
      return i + __builtin_ctz(unsigned(k));
  for (; i < n; ++i)
    if (x[i] == v) return i;
  return 0;
}

}  // namespace

int64_t argmax(const float* x, int64_t n) {
  if (n <= 0) return -1;
  // std::max_element's answer: it keeps x[0] and moves only to a strictly larger value, so
  // it returns the first position of the largest non-NaN value, or 0 when x[0] is a NaN
  // (nothing compares larger than it). Here: that value by a vector max, then its first
  // position (-0 and +0 compare equal, as they do there).
  if (std::isnan(x[0])) return 0;
  if (!has_avx512()) return std::max_element(x, x + n) - x;
  return find_first_avx512(x, n, max_skip_nan_avx512(x, n));
}

void axpy(float a, const float* x, float* y, int64_t n, cpu_isa isa) {
  switch (vector_isa(resolve_isa(isa))) {
    case cpu_isa::avx512: return axpy_avx512(a, x, y, n);
    case cpu_isa::avx2: return axpy_avx2(a, x, y, n);
    default:
      for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
  }
}

namespace {

// Portable path: dequantize one weight row, then one dot per activation row.
void matmul_rows_generic(const tensor_view& w, const float* x, int64_t batch, float* y, float* buf, int64_t r0,
                         int64_t r1) {
  const int64_t k = w.cols(), n = w.rows();
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr;
    if (w.type == ggml_type::f32) {
      wr = reinterpret_cast<const float*>(w.row(r));
    } else {
      dequantize_row(w.type, w.row(r), buf, k);
      wr = buf;
    }
    for (int64_t b = 0; b < batch; ++b) y[b * n + r] = dot_generic(wr, x + b * k, k);
  }
}

// AVX2 path. Every output element y[b][r] is computed the same way whatever tile it falls
// in: one 8-lane FMA accumulator over k in steps of 8 (weights decoded in registers, exact),
// a fixed horizontal reduction, then an FMA chain over the k % 8 tail. The tile shape only
// decides how many accumulators run side by side (R weight rows x B activation rows), so
// batch size, row split across threads and tile choice never change the bits.
template <ggml_type T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w8(const uint8_t* row, int64_t i) {
  if constexpr (T == ggml_type::f32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == ggml_type::f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
  } else if constexpr (T == ggml_type::bf16) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  } else {
    const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + i / q8_0_block;
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b->qs + i % q8_0_block));
    // d * q is exact in f32 (11-bit by 8-bit mantissas), so this equals dequantize_row.
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(b->d)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
}

template <ggml_type T>
inline float load_w1(const uint8_t* row, int64_t i) {
  if constexpr (T == ggml_type::f32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (T == ggml_type::f16) {
    return fp16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
  } else if constexpr (T == ggml_type::bf16) {
    return bf16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
  } else {
    const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + i / q8_0_block;
    return fp16_to_fp32(b->d) * float(b->qs[i % q8_0_block]);
  }
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// acc[r][b] += w[r] * x[b][i .. i+8) for every pair: one FMA per element per 8-wide step.
template <int R, int B>
__attribute__((target("avx2,fma"), always_inline)) inline void fma_step(__m256 (&acc)[R][B], const __m256* wv,
                                                                      const float* const* xs, int64_t i) {
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) {
    const __m256 xv = _mm256_loadu_ps(xs[b] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
  }
}

template <ggml_type T, int R, int B>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* const* rows, int64_t k, const float* x,
                                                        float* y, int64_t n, int64_t r0, int64_t b0) {
  const int64_t k8 = k & ~int64_t(7);
  const float* xs[B];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) xs[b] = x + (b0 + b) * k;
  __m256 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = _mm256_setzero_ps();
  if constexpr (T == ggml_type::q8_0) {
    // Same per-element FMA sequence as below; the block scale is just decoded once per block.
    for (int64_t i = 0; i < k8; i += q8_0_block) {
      __m256 d[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        d[r] = _mm256_set1_ps(_cvtsh_ss((reinterpret_cast<const block_q8_0*>(rows[r]) + i / q8_0_block)->d));
#pragma GCC unroll 4
      for (int j = 0; j < q8_0_block; j += 8) {
        __m256 wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const auto* blk = reinterpret_cast<const block_q8_0*>(rows[r]) + i / q8_0_block;
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk->qs + j));
          wv[r] = _mm256_mul_ps(d[r], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        fma_step<R, B>(acc, wv, xs, i + j);
      }
    }
  } else {
    for (int64_t i = 0; i < k8; i += 8) {
      __m256 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = load_w8<T>(rows[r], i);
      fma_step<R, B>(acc, wv, xs, i);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float tail = 0.0f;
      for (int64_t i = k8; i < k; ++i) tail = std::fma(load_w1<T>(rows[r], i), xs[b][i], tail);
      y[(b0 + b) * n + r0 + r] = hsum8(acc[r][b]) + tail;
    }
}

// The loop order of a blocked GEMM over weight rows [r0, r1) and `batch` activation rows:
// for each block of weight rows that fits in L2 (`w_block_bytes` of stored weights), each
// tile of up to B activation rows (sized by the caller to stay in L1) meets every group of
// R rows of the block: tile(rows, r, b, count). Activations are then read from L1 and the
// weights from L2 (each load feeds up to B FMAs), and the weights come from memory once
// per call. Returns the first row not covered (the r1 - r0 % R rows left for the caller).
template <int R, int B, class Tile>
int64_t gemm_blocks(const tensor_view& w, int64_t batch, int64_t r0, int64_t r1, size_t w_block_bytes,
                    Tile&& tile) {
  const int64_t rR = r0 + (r1 - r0) / R * R;
  // Blocks of nearly equal size: a small last block would re-read every activation tile
  // for only a few row groups.
  const int64_t groups = (rR - r0) / R;
  const int64_t max_groups = std::max<int64_t>(1, int64_t(w_block_bytes / row_bytes(w.type, w.cols())) / R);
  const int64_t n_blocks = std::max<int64_t>(1, (groups + max_groups - 1) / max_groups);
  const int64_t block = (groups + n_blocks - 1) / n_blocks * R;
  // Tiles of nearly equal width (8 = 4 + 4, 32 = 6 + 6 + 5 + 5 + 5 + 5): a narrow
  // remainder tile would reload its weight rows for only a few FMAs.
  const int64_t tiles = (batch + B - 1) / B, width = batch / tiles, extra = batch % tiles;
  auto start_of = [&](int64_t t) { return t * width + std::min(t, extra); };  // the first `extra` are one wider
  auto run = [&](int64_t r, int64_t t) {
    const uint8_t* rows[R];
    for (int i = 0; i < R; ++i) rows[i] = w.row(r + i);
    tile(rows, r, start_of(t), start_of(t + 1) - start_of(t));
  };
  // Where both fit in L1 with room to spare, the first two activation tiles meet each row
  // group back to back: the first reads the group's weights from memory, the second finds
  // them in L1, so the pass that streams the block from memory does twice the arithmetic
  // per byte (alone, a first tile took twice as long as each later one: bound by memory
  // while the rest are not). Measured at batch 8 (f16, k = 768: 24 KiB of activations),
  // +3-12%; at batch 32 (36 KiB) it was slower.
  const bool pair = tiles >= 2 && start_of(2) * w.cols() * int64_t(sizeof(float)) <= (24 << 10);
  const int64_t first = pair ? 2 : 1;
  for (int64_t rb0 = r0; rb0 < rR; rb0 += block) {
    const int64_t rb1 = std::min(rR, rb0 + block);
    for (int64_t r = rb0; r < rb1; r += R)
      for (int64_t t = 0; t < first; ++t) run(r, t);
    for (int64_t t = first; t < tiles; ++t)
      for (int64_t r = rb0; r < rb1; r += R) run(r, t);
  }
  return rR;
}

// Weight rows x `count` (< C) activation rows.
template <ggml_type T, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_rest(const uint8_t* const* rows, int64_t k,
                                                             const float* x, float* y, int64_t n, int64_t r0,
                                                             int64_t b0, int64_t count) {
  if constexpr (C > 1) {
    if (count == C - 1) return tile_avx2<T, R, C - 1>(rows, k, x, y, n, r0, b0);
    return tile_avx2_rest<T, R, C - 1>(rows, k, x, y, n, r0, b0, count);
  }
}

// Rows [r0, r1). Batch 1 decodes the weights in registers, 8 rows side by side. A larger
// batch runs tiles of 3 weight rows x up to 4 activation rows (12 accumulators, all 16
// registers in use) in gemm_blocks' order, also decoding the weights in registers.
template <ggml_type T>
void rows_avx2(const tensor_view& w, const float* x, int64_t batch, float* y, int64_t r0, int64_t r1) {
  const int64_t k = w.cols(), n = w.rows();
  int64_t r = r0;
  if (batch == 1) {
    for (; r + 8 <= r1; r += 8) {
      const uint8_t* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = w.row(r + i);
      tile_avx2<T, 8, 1>(rows, k, x, y, n, r, 0);
    }
  } else {
    auto tile = [&](const uint8_t* const* rows, int64_t rr, int64_t b, int64_t cnt) {
      if (cnt == 4)
        tile_avx2<T, 3, 4>(rows, k, x, y, n, rr, b);
      else
        tile_avx2_rest<T, 3, 4>(rows, k, x, y, n, rr, b, cnt);
    };
    r = gemm_blocks<3, 4>(w, batch, r0, r1, 512 << 10, tile);
  }
  for (; r < r1; ++r) {
    const uint8_t* row = w.row(r);
    for (int64_t b = 0; b < batch; ++b) tile_avx2<T, 1, 1>(&row, k, x, y, n, r, b);
  }
}

// AVX-512 path: the AVX2 scheme with 16 lanes. Every y[b][r] is one 16-lane FMA accumulator
// over k in steps of 16, hsum16, then an FMA chain over the k % 16 tail, whatever the tile.
template <ggml_type T>
TANDEM_AVX512 inline __m512 load_w16(const uint8_t* row, int64_t i) {
  if constexpr (T == ggml_type::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else if constexpr (T == ggml_type::f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
  } else if constexpr (T == ggml_type::bf16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  } else {
    const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + i / q8_0_block;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs + i % q8_0_block));
    // d * q is exact in f32, so this equals dequantize_row.
    return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b->d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
}

template <int R, int B>
TANDEM_AVX512 __attribute__((always_inline)) inline void fma_step16(__m512 (&acc)[R][B], const __m512* wv,
                                                                    const float* const* xs, int64_t i) {
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) {
    const __m512 xv = _mm512_loadu_ps(xs[b] + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
  }
}

template <ggml_type T, int R, int B, bool Fetch = true>
TANDEM_AVX512 void tile_avx512(const uint8_t* const* rows, int64_t k, const float* x, float* y, int64_t n,
                               int64_t r0, int64_t b0) {
  const int64_t k16 = k & ~int64_t(15);
  const float* xs[B];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) xs[b] = x + (b0 + b) * k;
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  if constexpr (T == ggml_type::q8_0) {
    // Batch 1: fetch the next tile's rows one tile ahead (see the f16/bf16/f32 branch below).
    const int64_t ahead = B == 1 && R > 1 ? (rows[1] - rows[0]) * R : 0;
    for (int64_t i = 0; i < k16; i += q8_0_block) {
      __m512 d[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const auto* blk = reinterpret_cast<const block_q8_0*>(rows[r]) + i / q8_0_block;
        if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(blk) + ahead, _MM_HINT_T0);
        d[r] = _mm512_set1_ps(_cvtsh_ss(blk->d));
      }
#pragma GCC unroll 2
      for (int j = 0; j < q8_0_block; j += 16) {
        __m512 wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const auto* blk = reinterpret_cast<const block_q8_0*>(rows[r]) + i / q8_0_block;
          const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk->qs + j));
          wv[r] = _mm512_mul_ps(d[r], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
        }
        fma_step16<R, B>(acc, wv, xs, i + j);
      }
    }
  } else if constexpr (R > 1 && Fetch && (B == 1 || R <= 4)) {
    // The tile's rows are consecutive and the next tile takes the next R rows, which start
    // `R * row bytes` further on; fetch them one tile ahead, one 64-byte line per row per
    // step (a 16-wide step reads at most 64 bytes of a row). Only where they come from
    // memory: at batch 1, and in the first activation tile of each gemm_blocks block (the
    // later ones find the block in L2). Measured on f16, side by side: at batch 32 (6 tiles
    // a block) dropping it cost 14%; at batch 480 fetching in every tile cost 2-5% at k = 768
    // (10% at k = 2048 with activations not cache-line aligned).
    const int64_t ahead = (rows[1] - rows[0]) * R;
    constexpr int64_t elem = T == ggml_type::f32 ? 4 : 2;
    for (int64_t i = 0; i < k16; i += 16) {
      __m512 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + ahead + elem * i), _MM_HINT_T0);
        wv[r] = load_w16<T>(rows[r], i);
      }
      fma_step16<R, B>(acc, wv, xs, i);
    }
  } else {
    for (int64_t i = 0; i < k16; i += 16) {
      __m512 wv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wv[r] = load_w16<T>(rows[r], i);
      fma_step16<R, B>(acc, wv, xs, i);
    }
  }
  // hsum16 of every accumulator, 16 at a time through the transpose network (same bits),
  // in output order: sums[b * R + r] is y[b0 + b][r0 + r].
  constexpr int chunks = (R * B + 15) / 16;
  alignas(64) float sums[chunks * 16];
  if constexpr (R * B >= 8) {
#pragma GCC unroll 4
    for (int c = 0; c < chunks; ++c) {
      __m512 A[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j)
        A[j] = c * 16 + j < R * B ? acc[(c * 16 + j) % R][(c * 16 + j) / R] : _mm512_setzero_ps();
      hsum16_x16(A, sums + c * 16);
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) sums[b * R + r] = hsum16(acc[r][b]);
  }
  if (k16 == k) {
    // No tail: each activation row's R outputs are contiguous (+ 0.0f as the tail sum adds
    // below, so -0 sums give +0 on both paths). A scalar loop with an empty tail loop per
    // output took a tenth of a 4 x 6 tile's time at k = 768.
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) y[(b0 + b) * n + r0 + r] = sums[b * R + r] + 0.0f;
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float tail = 0.0f;
      for (int64_t i = k16; i < k; ++i) tail = std::fma(load_w1<T>(rows[r], i), xs[b][i], tail);
      y[(b0 + b) * n + r0 + r] = sums[b * R + r] + tail;
    }
}

// Weight rows x `count` (< C) activation rows.
template <ggml_type T, int R, int C, bool Fetch>
TANDEM_AVX512 void tile_avx512_rest(const uint8_t* const* rows, int64_t k, const float* x, float* y, int64_t n,
                                    int64_t r0, int64_t b0, int64_t count) {
  if constexpr (C > 1) {
    if (count == C - 1) return tile_avx512<T, R, C - 1, Fetch>(rows, k, x, y, n, r0, b0);
    return tile_avx512_rest<T, R, C - 1, Fetch>(rows, k, x, y, n, r0, b0, count);
  }
}

// Rows [r0, r1). Batch 1 runs tiles of 8 weight rows side by side (enough loads in flight
// to stream at memory speed). A larger batch runs tiles of 4 weight rows x up to 6
// activation rows (24 accumulators) in gemm_blocks' order at every k. Measured on f16,
// batch 256-512, one thread, side by side: 4 x 6 beats 6 x 4 by 8% at k = 2048 and
// 0-6% at 3072 to 11008 (6 x 4 was taken above k = 1280 on the idea that 6 activation rows
// must stay in L1; they need not), and 3 x 8 is 3-7% slower at 768. Weights are decoded in
// registers on every path: measured against decoding each block once into an f32 buffer,
// that is as fast at 512 activation rows and faster at 8 to 32.
template <ggml_type T>
void rows_avx512(const tensor_view& w, const float* x, int64_t batch, float* y, int64_t r0, int64_t r1) {
  const int64_t k = w.cols(), n = w.rows();
  int64_t r = r0;
  if (batch == 1) {
    for (; r + 8 <= r1; r += 8) {
      const uint8_t* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = w.row(r + i);
      tile_avx512<T, 8, 1>(rows, k, x, y, n, r, 0);
    }
  } else {
    auto tile = [&](const uint8_t* const* rows, int64_t rr, int64_t b, int64_t cnt) {
      // b == 0: the block's first activation tile, which reads the weights from memory.
      if (cnt == 6 && b == 0)
        tile_avx512<T, 4, 6, true>(rows, k, x, y, n, rr, b);
      else if (cnt == 6)
        tile_avx512<T, 4, 6, false>(rows, k, x, y, n, rr, b);
      else if (b == 0)
        tile_avx512_rest<T, 4, 6, true>(rows, k, x, y, n, rr, b, cnt);
      else
        tile_avx512_rest<T, 4, 6, false>(rows, k, x, y, n, rr, b, cnt);
    };
    r = gemm_blocks<4, 6>(w, batch, r0, r1, 512 << 10, tile);
  }
  for (; r < r1; ++r) {
    const uint8_t* row = w.row(r);
    for (int64_t b = 0; b < batch; ++b) tile_avx512<T, 1, 1>(&row, k, x, y, n, r, b);
  }
}

void matmul_rows(const tensor_view& w, const float* x, int64_t batch, float* y, std::vector<float>& buf,
                 int64_t r0, int64_t r1, cpu_isa isa) {
  if (isa == cpu_isa::avx512) {
    switch (w.type) {
      case ggml_type::f32: return rows_avx512<ggml_type::f32>(w, x, batch, y, r0, r1);
      case ggml_type::f16: return rows_avx512<ggml_type::f16>(w, x, batch, y, r0, r1);
      case ggml_type::bf16: return rows_avx512<ggml_type::bf16>(w, x, batch, y, r0, r1);
      case ggml_type::q8_0: return rows_avx512<ggml_type::q8_0>(w, x, batch, y, r0, r1);
      default: break;
    }
  }
  if (isa == cpu_isa::avx2) {
    switch (w.type) {
      case ggml_type::f32: return rows_avx2<ggml_type::f32>(w, x, batch, y, r0, r1);
      case ggml_type::f16: return rows_avx2<ggml_type::f16>(w, x, batch, y, r0, r1);
      case ggml_type::bf16: return rows_avx2<ggml_type::bf16>(w, x, batch, y, r0, r1);
      case ggml_type::q8_0: return rows_avx2<ggml_type::q8_0>(w, x, batch, y, r0, r1);
      default: break;
    }
  }
  if (buf.size() < size_t(w.cols())) buf.resize(size_t(w.cols()));
  matmul_rows_generic(w, x, batch, y, buf.data(), r0, r1);
}

}  // namespace

packed_weight pack_weight(const tensor_view& w, cpu_isa isa, thread_pool* pool) {
  return pack_weights(std::span<const tensor_view>(&w, 1), isa, pool).front();
}

std::vector<packed_weight> pack_weights(std::span<const tensor_view> ws, cpu_isa isa, thread_pool* pool) {
  isa = resolve_isa(isa);
  std::vector<packed_weight> out;
  out.reserve(ws.size());
  size_t total = 0;
  if (isa == cpu_isa::amx)
    for (const tensor_view& w : ws)
      if (amx_handles(w.type)) total += amx_packed_bytes(w);
  std::shared_ptr<uint16_t> arena = total > 0 ? amx_arena(total) : nullptr;
  size_t offset = 0;  // in values
  for (const tensor_view& w : ws) {
    packed_weight p;
    p.view = w;
    p.isa = isa;
    if (arena && amx_handles(w.type)) {
      p.amx = std::make_shared<const amx_matrix>(amx_pack(w, pool, arena, offset));
      offset += amx_packed_bytes(w) / 2;
    }
    out.push_back(std::move(p));
  }
  return out;
}

void matmul(const packed_weight& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool) {
  if (w.amx) return amx_matmul(*w.amx, x, batch, y, scratch, pool);
  matmul(w.view, x, batch, y, scratch, pool, w.isa);
}

namespace {

// Threaded matmuls run chunks of whole 24-row groups so every chunk runs whole tiles (8, 4, 6
// or 3 rows; the bits do not depend on the split either way).
constexpr int64_t matmul_group_rows = 24;

// The weight types and shapes the vector kernels take (tandem::error otherwise).
void check_matmul_weight(const tensor_view& w) {
  if (!is_supported(w.type))
    throw tandem::error(fmt::format("matmul: weight type {} is not supported; use f32, f16, bf16 or q8_0",
                                    to_string(w.type)));
  if (w.type == ggml_type::q8_0 && w.cols() % q8_0_block != 0)
    throw tandem::error(
        fmt::format("matmul: q8_0 weight with {} columns is not a multiple of {}", w.cols(), q8_0_block));
}

}  // namespace

void matmul_many(std::span<const packed_weight* const> ws, const float* x, int64_t batch, std::span<float* const> ys,
                 std::vector<float>& scratch, thread_pool* pool) {
  if (ws.size() != ys.size()) throw tandem::error("matmul_many: one output per weight");
  if (ws.empty()) return;
  const int64_t k = ws[0]->view.cols();
  bool all_amx = true, same_path = true;
  int64_t work = 0;
  for (const packed_weight* w : ws) {
    if (w->view.cols() != k)
      throw tandem::error(fmt::format("matmul_many: weights of {} and {} columns cannot share one input", k,
                                      w->view.cols()));
    all_amx = all_amx && w->amx != nullptr;
    same_path = same_path && w->amx == nullptr && w->isa == ws[0]->isa;
    work += w->view.rows() * k * batch;
  }
  if (all_amx) {
    std::vector<const amx_matrix*> ms;
    for (const packed_weight* w : ws) ms.push_back(w->amx.get());
    return amx_matmul_many(ms, x, batch, ys, scratch, pool);
  }
  // One fork-join over the 24-row groups of every weight (see matmul below), unless the
  // weights take different paths or the work is too small to wake the workers.
  if (!same_path || batch <= 0 || pool == nullptr || pool->size() == 1 || work < matmul_min_parallel_work) {
    for (size_t i = 0; i < ws.size(); ++i) matmul(*ws[i], x, batch, ys[i], scratch, pool);
    return;
  }
  const cpu_isa isa = vector_isa(resolve_isa(ws[0]->isa));
  std::vector<int64_t> off(1, 0);
  for (const packed_weight* w : ws) {
    check_matmul_weight(w->view);
    off.push_back(off.back() + (w->view.rows() + matmul_group_rows - 1) / matmul_group_rows);
  }
  pool->parallel_for_dynamic(off.back(), 4, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf;  // per chunk: the decoded weight rows of the generic path
    for_parts(off, g0, g1, [&](size_t i, int64_t lo, int64_t hi) {
      matmul_rows(ws[i]->view, x, batch, ys[i], buf, lo * matmul_group_rows,
                  std::min(ws[i]->view.rows(), hi * matmul_group_rows), isa);
    });
  });
}

void matmul(const tensor_view& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool, cpu_isa isa) {
  const int64_t k = w.cols(), n = w.rows();
  isa = resolve_isa(isa);
  if (isa == cpu_isa::amx && amx_handles(w.type)) {
    // A view meets the tile layout only here: copied per call (packed_weight keeps it).
    if (batch > 0) amx_matmul(amx_pack(w, pool), x, batch, y, scratch, pool);
    return;
  }
  isa = vector_isa(isa);
  check_matmul_weight(w);
  if (batch <= 0) return;
  if (pool == nullptr || pool->size() == 1 || n * k * batch < matmul_min_parallel_work) {
    matmul_rows(w, x, batch, y, scratch, 0, n, isa);
    return;
  }
  const int64_t groups = (n + matmul_group_rows - 1) / matmul_group_rows;
  // 4 chunks per thread taken as threads free up: on a shared machine one core often runs
  // slower for a while, and a fixed half each made the other wait (measured: prefill 0.29
  // of peak FMA with fixed halves, 0.36 with 4 chunks per thread, in a noisy period; the
  // same within noise in a quiet one). Each chunk re-reads the activations once, so not more.
  pool->parallel_for_dynamic(groups, 4, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf;  // per chunk: the decoded weight rows of the generic path
    matmul_rows(w, x, batch, y, buf, g0 * matmul_group_rows, std::min(n, g1 * matmul_group_rows), isa);
  });
}

namespace {

// Rows [r, r + G) of rms_norm: each row's sum of squares is its own double chain in index
// order, as for one row alone; G chains side by side keep the adder busy where one chain
// waits on each add's latency (one row of 768 took ~3,000 cycles). double(x) * x is exact,
// so a contracted multiply-add would give the same bits too.
template <int G>
void rms_norm_rows(const float* x, const float* w, float* y, int64_t r, int64_t n, float eps) {
  double ss[G] = {};
  for (int64_t i = 0; i < n; ++i)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const double v = x[(r + g) * n + i];
      ss[g] += v * v;
    }
  for (int g = 0; g < G; ++g) {
    const float scale = float(1.0 / std::sqrt(ss[g] / double(n) + double(eps)));
    const float* xr = x + (r + g) * n;
    float* yr = y + (r + g) * n;
    const __m128 sc = _mm_set1_ps(scale);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)  // (x * scale) * w, 4 lanes (SSE: no fused multiply-add here)
      _mm_storeu_ps(yr + i, _mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(xr + i), sc), _mm_loadu_ps(w + i)));
    for (; i < n; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps, thread_pool* pool) {
  auto run = [&](int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) rms_norm_rows<8>(x, w, y, r, n, eps);
    for (; r < r1; ++r) rms_norm_rows<1>(x, w, y, r, n, eps);
  };
  parallel_for_if(pool, rows, rows * n, run);  // rows are independent: any split, the same bits
}

void add_inplace(float* y, const float* x, int64_t n, thread_pool* pool) {
  auto run = [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + 4 <= e; i += 4) _mm_storeu_ps(y + i, _mm_add_ps(_mm_loadu_ps(y + i), _mm_loadu_ps(x + i)));
    for (; i < e; ++i) y[i] += x[i];
  };
  parallel_for_if(pool, n, n, run);
}

void rope_table::build(const int32_t* pos, int64_t n_rows, int head_dim_, float freq_base) {
  rows = n_rows;
  head_dim = head_dim_;
  // The frequencies once per table, not once per row (the same doubles either way).
  const int half = head_dim / 2;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) freq[size_t(i)] = std::pow(double(freq_base), -2.0 * i / double(head_dim));
  cos_sin.resize(size_t(rows) * size_t(half) * 2);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < half; ++i) {
      const double theta = double(pos[r]) * freq[size_t(i)];
      cos_sin[size_t((r * half + i) * 2)] = float(std::cos(theta));
      cos_sin[size_t((r * half + i) * 2 + 1)] = float(std::sin(theta));
    }
}

void rope(float* x, const rope_table& t, int n_heads, thread_pool* pool) {
  const int half = t.head_dim / 2;
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int h = 0; h < n_heads; ++h) {
        float* p = x + (r * n_heads + h) * t.head_dim;
        const float* cs = t.cos_sin.data() + size_t(r * half) * 2;
        for (int i = 0; i < half; ++i) {
          const float c = cs[2 * i], s = cs[2 * i + 1];
          const float a = p[2 * i], b = p[2 * i + 1];
          p[2 * i] = a * c - b * s;
          p[2 * i + 1] = a * s + b * c;
        }
      }
  };
  parallel_for_if(pool, t.rows, t.rows * n_heads * t.head_dim, run);  // any split, the same bits
}

void rope(float* x, const int32_t* pos, int64_t rows, int n_heads, int head_dim, float freq_base) {
  rope_table t;
  t.build(pos, rows, head_dim, freq_base);
  rope(x, t, n_heads);
}


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

namespace {

// 16 dot products at once with, for each, exactly dot_avx512's arithmetic: the same two
// accumulators over k, then the hsum16 tree (lanes i+8, then i+4, then i+2, then i+1) run
// as a transpose network over the 16 accumulators instead of 16 separate reductions.
// n must be a multiple of 16 (dot_avx512's tail is then empty and adds +0.0f).
// KV rows are f32 (float) or f16 (uint16_t); an f16 row is widened exactly on load, so every
// kernel below computes on the f16 cache exactly what it computes on an f32 cache holding the
// same values.
TANDEM_AVX512 __attribute__((always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TANDEM_AVX512 __attribute__((always_inline)) inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <class T>
TANDEM_AVX512 void dot16_avx512(const float* a, const T* const* rows, int64_t n, float* out) {
  __m512 A[16];
  for (int j = 0; j < 16; ++j) {
    const T* b = rows[j];
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), load16(b + k), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), load16(b + k + 16), s1);
    }
    for (; k + 16 <= n; k += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), load16(b + k), s0);
    A[j] = _mm512_add_ps(s0, s1);
  }
  alignas(64) float t[16];
  hsum16_x16(A, t);
  for (int j = 0; j < 16; ++j) out[j] = t[j] + 0.0f;
}

// dot16_avx512 for G query rows against the same 16 rows at once: each row's 16-float
// chunks are loaded once and feed all G queries, whose NV chunks (n = 16 NV) stay in
// registers (dot16_avx512 loads both operands for every FMA, so a prefill chunk's scores
// were bound by loads). Per (query, row) it is exactly dot_avx512's arithmetic: chunk c of a
// pair-step goes to s[c % 2] in ascending order, an odd last chunk to s0, then s0 + s1 and
// the hsum16 network.
template <int G, int NV, class T>
TANDEM_AVX512 void dot16_rows_avx512(const float* const* q, const T* const* rows, float* const* out) {
  __m512 qv[G][NV];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) qv[g][c] = _mm512_loadu_ps(q[g] + 16 * c);
  alignas(64) __m512 A[G][16];
  for (int j = 0; j < 16; ++j) {
    const T* b = rows[j];
    __m512 s0[G], s1[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      const __m512 bv = load16(b + 16 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        // Pairs of chunks alternate s0, s1; an odd last chunk (NV odd) goes to s0.
        if (c % 2 == 0) s0[g] = _mm512_fmadd_ps(qv[g][c], bv, s0[g]);
        else s1[g] = _mm512_fmadd_ps(qv[g][c], bv, s1[g]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) A[g][j] = _mm512_add_ps(s0[g], s1[g]);
  }
  alignas(64) float t[16];
  for (int g = 0; g < G; ++g) {
    hsum16_x16(A[g], t);
    for (int j = 0; j < 16; ++j) out[g][j] = t[j] + 0.0f;
  }
}

// dot16_rows_avx512 for the group size and head size at run time; false if n is not 16 to 64.
template <int G, class T>
TANDEM_AVX512 bool dot16_rows(const float* const* q, const T* const* rows, int64_t n, float* const* out) {
  switch (n) {
    case 16: dot16_rows_avx512<G, 1>(q, rows, out); return true;
    case 32: dot16_rows_avx512<G, 2>(q, rows, out); return true;
    case 48: dot16_rows_avx512<G, 3>(q, rows, out); return true;
    case 64: dot16_rows_avx512<G, 4>(q, rows, out); return true;
    default: return false;
  }
}

// Output columns [c, c + 16 V) of G rows of attention at once: for each position p below
// `common` (where all G rows attend), V[p]'s vectors are loaded once and feed every row;
// then each row runs on alone over its own further positions. Per element this is the FMA
// chain of repeated axpy_avx512 calls (p ascending, from zero), so the bits do not depend
// on the group.
template <int G, int V, class T>
TANDEM_AVX512 void weighted_sum_group_cols(const float* const* att, const T* const* rows, int64_t common,
                                           const int64_t* len, int64_t c, float* const* out) {
  __m512 y[G][V];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) y[g][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < common; ++p) {
    const T* vp = rows[p] + c;
    __m512 vv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) vv[v] = load16(vp + 16 * v);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 a = _mm512_set1_ps(att[g][p]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) y[g][v] = _mm512_fmadd_ps(a, vv[v], y[g][v]);
    }
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    for (int64_t p = common; p < len[g]; ++p) {
      const __m512 a = _mm512_set1_ps(att[g][p]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) y[g][v] = _mm512_fmadd_ps(a, load16(rows[p] + c + 16 * v), y[g][v]);
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out[g] + c + 16 * v, y[g][v]);
  }
}

template <int G, class T>
TANDEM_AVX512 void weighted_sum_group(const float* const* att, const T* const* rows, int64_t common,
                                      const int64_t* len, int64_t n, float* const* out) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) weighted_sum_group_cols<G, 4>(att, rows, common, len, c, out);
  for (; c < n; c += 16) weighted_sum_group_cols<G, 1>(att, rows, common, len, c, out);
}

// rows[p] = K row of KV head `kvh` at position p for p < len, page by page instead of a
// division by the page size per position (attention's own share of a batch-16 decode at
// context 256 fell from 6.8% to 5.8% of the samples).
template <class T>
const T* k_base(const kv_pool& pool, int32_t page, int32_t layer) {
  if constexpr (std::is_same_v<T, float>) return pool.k(page, layer);
  else return pool.k16(page, layer);
}

template <class T>
void k_rows(const kv_pool& pool, int32_t layer, std::span<const int32_t> pages, int kvh, int64_t len,
            std::vector<const T*>& rows) {
  const kv_layout& L = pool.layout();
  const size_t stride = size_t(L.n_kv_heads) * L.head_dim;
  rows.resize(size_t(len));
  for (int64_t p0 = 0, pg = 0; p0 < len; p0 += L.page_size, ++pg) {
    const T* base = k_base<T>(pool, pages[size_t(pg)], layer) + size_t(kvh) * L.head_dim;
    const int64_t end = std::min<int64_t>(L.page_size, len - p0);
    for (int64_t j = 0; j < end; ++j) rows[size_t(p0 + j)] = base + size_t(j) * stride;
  }
}

// Up to 4 consecutive query tokens of one head (row g attends to positions [0, len0 + g)),
// each computed as dot() + softmax() + axpy() of the avx512 path compute it alone (same
// bits): the scores (16 positions at a time) and softmax per row, then one weighted sum for
// the group that reads each V row once.
template <class T>
TANDEM_AVX512 void attention_group_avx512(const float* const* qh, int g_count, int64_t len0, int kvh,
                                          const kv_pool& pool, int32_t layer, std::span<const int32_t> pages,
                                          float* const* oh, float* att, int64_t att_stride,
                                          std::vector<const T*>& rows) {
  const kv_layout& L = pool.layout();
  const int hd = L.head_dim;
  const float scale = 1.0f / std::sqrt(float(hd));
  const int64_t max_len = len0 + g_count - 1;
  k_rows(pool, layer, pages, kvh, max_len, rows);
  const float* atts[4];
  int64_t lens[4];
  // Blocks of 16 positions every row of the group attends to: all rows at once (head sizes
  // 16 to 64, which dot16_rows takes; others, and the rest of each row, one row at a time).
  int64_t common16 = 0;
  if (g_count > 1) {
    float* outs[4];
    for (; common16 + 16 <= len0; common16 += 16) {
      for (int g = 0; g < g_count; ++g) outs[g] = att + g * att_stride + common16;
      const T* const* kr = rows.data() + common16;
      const bool done = g_count == 4   ? dot16_rows<4>(qh, kr, hd, outs)
                        : g_count == 3 ? dot16_rows<3>(qh, kr, hd, outs)
                                       : dot16_rows<2>(qh, kr, hd, outs);
      if (!done) break;
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int g = 0; g < g_count; ++g) {
    float* a = att + g * att_stride;
    const int64_t len = len0 + g;
    int64_t p = common16;
    for (; p + 16 <= len; p += 16) dot16_avx512(qh[g], rows.data() + p, hd, a + p);
    if (p < len) {
      // The last len % 16 positions as one more 16-row call, padded with position 0 (each
      // output is its own dot_avx512, so the padding changes nothing and is dropped).
      const T* tail_rows[16];
      for (int j = 0; j < 16; ++j) tail_rows[j] = rows[size_t(p + j < len ? p + j : 0)];
      alignas(64) float t[16];
      dot16_avx512(qh[g], tail_rows, hd, t);
      for (int64_t j = 0; p + j < len; ++j) a[p + j] = t[j];
    }
    p = 0;
    for (; p + 16 <= len; p += 16) _mm512_storeu_ps(a + p, _mm512_mul_ps(_mm512_loadu_ps(a + p), sv));
    for (; p < len; ++p) a[p] *= scale;
    softmax(a, size_t(len), cpu_isa::avx512);
    atts[g] = a;
    lens[g] = len;
  }
  for (int64_t p = 0; p < max_len; ++p) rows[size_t(p)] += L.layer_elems();  // V sits right after K
  switch (g_count) {
    case 4: return weighted_sum_group<4>(atts, rows.data(), len0, lens, hd, oh);
    case 3: return weighted_sum_group<3>(atts, rows.data(), len0, lens, hd, oh);
    case 2: return weighted_sum_group<2>(atts, rows.data(), len0, lens, hd, oh);
    default: return weighted_sum_group<1>(atts, rows.data(), len0, lens, hd, oh);
  }
}

// Heads of one head block of attention_heads_avx512: at most 24 of their 16-float chunks (the
// queries, or the accumulators, in registers) and at most 8 heads.
constexpr int heads_per_block(int nv) { return std::min(8, std::max(1, 24 / nv)); }

// Calls f(std::integral_constant<int, N>) for the run-time head count n in [1, max]: the
// head loops below must have a count known at compile time, or the compiler keeps the
// queries and accumulators in memory (a store and a load per FMA, chained through the
// store forwarding) and divides by the group size per head and position. Measured (batch 32,
// context 80, 12 layers, 2 threads, interleaved): a step's attention 5.98-6.35 -> 4.93-5.35 ms
// on an f32 cache, 4.57-4.85 -> 3.86-4.17 ms on f16.
template <int Max, int N = 1, class F>
TANDEM_AVX512 inline void with_head_count(int n, F&& f) {
  if constexpr (N < Max) {
    if (n != N) return with_head_count<Max, N + 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, N>{});
}

// N heads' 16-float chunks from src (head i at src + i * hd) into registers, and each head's
// offset in a K or V row: query head h + i reads KV head (h + i) / group.
template <int NV, int N>
TANDEM_AVX512 __attribute__((always_inline)) inline void load_heads(const float* src, __m512 (&r)[N][NV],
                                                                    int h, int group, size_t (&off)[N]) {
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
    off[i] = size_t((h + i) / group) * NV * 16;
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) r[i][c] = _mm512_loadu_ps(src + size_t(i) * NV * 16 + 16 * c);
  }
}

// Scores of N heads for positions [j0, j0 + m) of one page (m <= 16) into A[i][j - j0]:
// chunk c of each dot product goes to s[c % 2], then s0 + s1 (dot_avx512's order before its
// hsum16). Head i is query head h + i (see load_heads); `prefetch(j)` is called before row j.
template <int NV, int N, class T, class Prefetch>
TANDEM_AVX512 __attribute__((always_inline)) inline void head_scores(const float* q, const T* page,
                                                                     size_t stride, int h, int group,
                                                                     int64_t j0, int m,
                                                                     const Prefetch& prefetch,
                                                                     __m512 (*A)[16]) {
  __m512 qv[N][NV];
  size_t off[N];
  load_heads<NV, N>(q, qv, h, group, off);
  for (int j = 0; j < m; ++j) {
    const T* row = page + size_t(j0 + j) * stride;
    prefetch(j0 + j);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const T* k = row + off[i];
      __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) {
        if (c % 2 == 0) s0 = _mm512_fmadd_ps(qv[i][c], load16(k + 16 * c), s0);
        else s1 = _mm512_fmadd_ps(qv[i][c], load16(k + 16 * c), s1);
      }
      A[i][j] = _mm512_add_ps(s0, s1);
    }
  }
}

// The weighted sum of V rows [0, end) of one page for N heads, accumulated into acc (head i
// at acc + i * hd; query head h + i) in position order: w[i][j] is head i's weight of row j,
// at w + i * w_stride.
template <int NV, int N, class T, class Prefetch>
TANDEM_AVX512 __attribute__((always_inline)) inline void head_values(const float* w, int64_t w_stride,
                                                                     const T* page, size_t stride, int h,
                                                                     int group, int64_t end,
                                                                     const Prefetch& prefetch, float* acc) {
  __m512 y[N][NV];
  size_t off[N];
  load_heads<NV, N>(acc, y, h, group, off);
  for (int64_t j = 0; j < end; ++j) {
    const T* row = page + size_t(j) * stride;
    prefetch(j);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
      const __m512 wv = _mm512_set1_ps(w[i * w_stride + j]);
      const T* v = row + off[i];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) y[i][c] = _mm512_fmadd_ps(wv, load16(v + 16 * c), y[i][c]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + size_t(i) * NV * 16 + 16 * c, y[i][c]);
}

// Query heads [h0, h1) of one decode token (attending to positions [0, len)), page by page:
// a page's K (then V) rows of every KV head are one contiguous block of memory, read once
// for all the heads, instead of once per head as a 256-byte piece every few KiB (one head at
// a time, a batch-32 decode's attention took as long on an f16 cache as on an f32 one: bound
// by scattered pieces, not bytes). Within a page, heads go HB at a time with their queries
// (scores) or output accumulators (weighted sum) in registers. Per head this is exactly what
// attention_group_avx512 computes for one token: chunk c of a dot product goes to s[c % 2],
// then s0 + s1 and the hsum16 network (dot_avx512's bits); the same scaling and softmax; the
// FMA chain over positions (p ascending, from zero) for the weighted sum.
template <int NV, class T>
TANDEM_AVX512 void attention_heads_avx512(const float* q, int64_t len, int h0, int h1, int group, const kv_pool& pool,
                                          int32_t layer, std::span<const int32_t> pages, float* out, float* att,
                                          int64_t att_stride, std::vector<float>& acc) {
  constexpr int HB = heads_per_block(NV);
  constexpr int hd = NV * 16;
  const kv_layout& L = pool.layout();
  const int ps = L.page_size, nh = h1 - h0;
  const size_t stride = size_t(L.n_kv_heads) * hd;
  const float scale = 1.0f / std::sqrt(float(hd));
  alignas(64) __m512 A[HB][16];
  alignas(64) float t[16];
  // The row `ahead` positions after position j of the page at p0 (the K pass's last
  // positions request V's first), the part these heads read, requested before its use. It
  // mattered while the head loops ran from memory (batch 32, context 80, f16 cache, 12 layers:
  // 11.1-11.5 ms for a step's attention on one thread without, 8.1-8.4 with); with the queries
  // and accumulators in registers it is worth ~3% on two threads and nothing on one.
  constexpr int64_t ahead = 2;
  const size_t lo = size_t(h0 / group) * hd * sizeof(T), hi = size_t((h1 - 1) / group + 1) * hd * sizeof(T);
  const T* const v_first = k_base<T>(pool, pages[0], layer) + L.layer_elems();
  auto prefetch = [&](const T* page, int64_t p0, int64_t pg, int64_t j, bool v) TANDEM_AVX512 {
    int64_t at = j + ahead;
    const T* r;
    if (p0 + at < std::min<int64_t>(len, p0 + ps)) {
      r = page + size_t(at) * stride;
    } else if (p0 + ps < len) {
      at -= ps;
      if (p0 + ps + at >= len) return;
      r = k_base<T>(pool, pages[size_t(pg + 1)], layer) + (v ? L.layer_elems() : 0) + size_t(at) * stride;
    } else {
      if (v) return;
      at = p0 + at - len;
      if (at >= std::min<int64_t>(len, ps)) return;
      r = v_first + size_t(at) * stride;
    }
    const char* c = reinterpret_cast<const char*>(r);
    for (size_t b = lo; b < hi; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
  };
  for (int64_t p0 = 0, pg = 0; p0 < len; p0 += ps, ++pg) {
    const T* page = k_base<T>(pool, pages[size_t(pg)], layer);
    const int64_t end = std::min<int64_t>(ps, len - p0);
    for (int hb0 = 0; hb0 < nh; hb0 += HB) {
      const int n = std::min(HB, nh - hb0);
      const float* qb = q + size_t(h0 + hb0) * hd;
      // The first head block requests the rows for all of them.
      auto fetch = [&](int64_t j) TANDEM_AVX512 { if (hb0 == 0) prefetch(page, p0, pg, j, false); };
      // Blocks of 16 positions (a page may hold more or fewer).
      for (int64_t j0 = 0; j0 < end; j0 += 16) {
        const int m = int(std::min<int64_t>(16, end - j0));
        with_head_count<HB>(n, [&](auto count) TANDEM_AVX512 {
          head_scores<NV, decltype(count)::value>(qb, page, stride, h0 + hb0, group, j0, m, fetch, A);
        });
        for (int i = 0; i < n; ++i) {
          for (int j = m; j < 16; ++j) A[i][j] = _mm512_setzero_ps();  // dropped below
          hsum16_x16(A[i], t);
          float* a = att + (hb0 + i) * att_stride + p0 + j0;
          for (int j = 0; j < m; ++j) a[j] = t[j] + 0.0f;
        }
      }
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int h = 0; h < nh; ++h) {
    float* a = att + h * att_stride;
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) _mm512_storeu_ps(a + p, _mm512_mul_ps(_mm512_loadu_ps(a + p), sv));
    for (; p < len; ++p) a[p] *= scale;
    softmax(a, size_t(len), cpu_isa::avx512);
  }
  // Weighted sum of V: each page's rows once, HB heads' accumulators in registers between
  // trips to memory (acc, in L1) once per page.
  acc.assign(size_t(nh) * hd, 0.0f);
  for (int64_t p0 = 0, pg = 0; p0 < len; p0 += ps, ++pg) {
    const T* page = k_base<T>(pool, pages[size_t(pg)], layer) + L.layer_elems();  // V sits right after K
    const int64_t end = std::min<int64_t>(ps, len - p0);
    for (int hb0 = 0; hb0 < nh; hb0 += HB) {
      const int n = std::min(HB, nh - hb0);
      const float* w = att + hb0 * att_stride + p0;
      float* y = acc.data() + size_t(hb0) * hd;
      auto fetch = [&](int64_t j) TANDEM_AVX512 { if (hb0 == 0) prefetch(page, p0, pg, j, true); };
      with_head_count<HB>(n, [&](auto count) TANDEM_AVX512 {
        head_values<NV, decltype(count)::value>(w, att_stride, page, stride, h0 + hb0, group, end, fetch, y);
      });
    }
  }
  std::memcpy(out + size_t(h0) * hd, acc.data(), size_t(nh) * hd * sizeof(float));
}

// attention_heads_avx512 for the head size at run time: 16 to 128 (multiples of 16); false
// for others (they take the per-head path).
template <class T>
TANDEM_AVX512 bool attention_heads(int hd, const float* q, int64_t len, int h0, int h1, int group,
                                   const kv_pool& pool, int32_t layer, std::span<const int32_t> pages, float* out,
                                   float* att, int64_t att_stride, std::vector<float>& acc) {
  switch (hd) {
#define TANDEM_HEADS(nv) \
  case 16 * nv: attention_heads_avx512<nv, T>(q, len, h0, h1, group, pool, layer, pages, out, att, att_stride, acc); return true;
    TANDEM_HEADS(1)
    TANDEM_HEADS(2)
    TANDEM_HEADS(3)
    TANDEM_HEADS(4)
    TANDEM_HEADS(5)
    TANDEM_HEADS(6)
    TANDEM_HEADS(7)
    TANDEM_HEADS(8)
#undef TANDEM_HEADS
    default: return false;
  }
}

// One (token, head) row of attention on the scalar and avx2 paths: scores over positions
// [0, len), softmax, weighted sum of V. Its arithmetic depends only on its own inputs, so
// any split of rows gives the same bits.
// An f16 cache's rows are widened (exactly) into `wide` first, so the f16 cache gives what an
// f32 cache holding the same values gives.
template <class T>
void attention_row(const float* qh, int64_t len, int kvh, const kv_pool& pool, int32_t layer,
                   std::span<const int32_t> pages, float* oh, float* att, cpu_isa isa,
                   std::vector<const T*>& rows, std::vector<float>& wide) {
  const int hd = pool.layout().head_dim;
  const float scale = 1.0f / std::sqrt(float(hd));
  auto row = [&](const T* r) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return r;
    } else {
      wide.resize(size_t(hd));
      dequantize_row(ggml_type::f16, r, wide.data(), hd);
      return wide.data();
    }
  };
  k_rows(pool, layer, pages, kvh, len, rows);
  for (int64_t p = 0; p < len; ++p) att[p] = dot(qh, row(rows[size_t(p)]), hd, isa) * scale;
  softmax(att, size_t(len), isa);
  std::fill(oh, oh + hd, 0.0f);
  const size_t v_offset = pool.layout().layer_elems();  // V sits right after K
  for (int64_t p = 0; p < len; ++p) axpy(att[p], row(rows[size_t(p)] + v_offset), oh, hd, isa);
}

void check_attention(const attention_seq& s, int n_heads, const kv_pool& pool) {
  const kv_layout& L = pool.layout();
  if (!L.is_standard())
    throw tandem::error(fmt::format("attention: the KV pool ({}) is not a standard K/V layout", L.describe()));
  if (L.n_kv_heads <= 0 || n_heads % L.n_kv_heads != 0)
    throw tandem::error(
        fmt::format("attention: {} query heads do not group over {} KV heads", n_heads, L.n_kv_heads));
  const int64_t n_ctx = int64_t(s.pos0) + s.n_tokens;
  if (int64_t(s.pages.size()) * L.page_size < n_ctx)
    throw tandem::error(fmt::format("attention: {} pages of {} tokens cannot hold {} positions", s.pages.size(),
                                    L.page_size, n_ctx));
}

}  // namespace

void paged_attention_batch(std::span<const attention_seq> seqs, int n_heads, const kv_pool& pool, int32_t layer,
                           thread_pool* tp, cpu_isa isa) {
  isa = vector_isa(resolve_isa(isa));
  const kv_layout& L = pool.layout();
  const int hd = L.head_dim;
  // The avx512 path takes up to 4 consecutive tokens of one head at a time (same bits as
  // one at a time); the others one token at a time.
  const bool grouped = isa == cpu_isa::avx512 && hd % 16 == 0;
  const int64_t gsz = grouped ? 4 : 1;
  const bool by_heads = grouped && hd <= 128;  // attention_heads' sizes
  // A decode token (one new token) on the avx512 path is a unit of `hb` heads read position
  // by position (attention_heads_avx512); heads are split into enough blocks that the
  // threads share even a batch of one.
  int64_t decode_seqs = 0;
  for (const attention_seq& s : seqs) decode_seqs += by_heads && s.n_tokens == 1 ? 1 : 0;
  const int64_t threads = tp == nullptr ? 1 : tp->size();
  const int64_t blocks = decode_seqs == 0 ? 1 : std::clamp<int64_t>((4 * threads + decode_seqs - 1) / decode_seqs, 1, n_heads);
  const int hb = int((n_heads + blocks - 1) / blocks);
  int64_t units = 0, max_ctx = 0, work = 0;
  std::vector<int64_t> first;  // first unit (token group of one head, or head block) of each sequence
  first.reserve(seqs.size() + 1);
  for (const attention_seq& s : seqs) {
    check_attention(s, n_heads, pool);
    first.push_back(units);
    units += by_heads && s.n_tokens == 1 ? (n_heads + hb - 1) / hb : (s.n_tokens + gsz - 1) / gsz * n_heads;
    max_ctx = std::max(max_ctx, int64_t(s.pos0) + s.n_tokens);
    work += s.n_tokens * (int64_t(s.pos0) + s.n_tokens) * n_heads;
  }
  first.push_back(units);
  if (units == 0) return;
  const int group = n_heads / L.n_kv_heads;
  // Index i runs unit i/2 from the front (even i) or from the back (odd i): causal rows grow
  // in length, so contiguous chunks of indices get about the same work.
  auto run_typed = [&]<class T>(T*, int64_t i0, int64_t i1) {
    std::vector<float> att(static_cast<size_t>(max_ctx * std::max<int64_t>(gsz, hb))), wide;
    std::vector<const T*> kv_rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = i % 2 == 0 ? i / 2 : units - 1 - i / 2;
      const size_t s = size_t(std::upper_bound(first.begin(), first.end(), u) - first.begin()) - 1;
      const attention_seq& q = seqs[s];
      if (by_heads && q.n_tokens == 1) {
        const int h0 = int(u - first[s]) * hb;
        attention_heads<T>(hd, q.q, int64_t(q.pos0) + 1, h0, std::min(n_heads, h0 + hb), group, pool, layer, q.pages,
                           q.out, att.data(), max_ctx, wide);
        continue;
      }
      // Head-major within a sequence: consecutive units share one head's K/V, which then
      // stays in L2 across a prefill chunk's queries instead of cycling through all heads.
      const int64_t per_head = (q.n_tokens + gsz - 1) / gsz;
      const int64_t t0 = (u - first[s]) % per_head * gsz;
      const int h = int((u - first[s]) / per_head);
      const int count = int(std::min(gsz, q.n_tokens - t0));
      if (grouped) {
        const float* qs[4];
        float* outs[4];
        for (int g = 0; g < count; ++g) {
          qs[g] = q.q + ((t0 + g) * n_heads + h) * hd;
          outs[g] = q.out + ((t0 + g) * n_heads + h) * hd;
        }
        attention_group_avx512(qs, count, int64_t(q.pos0) + t0 + 1, h / group, pool, layer, q.pages, outs,
                               att.data(), max_ctx, kv_rows);
      } else {
        attention_row(q.q + (t0 * n_heads + h) * hd, int64_t(q.pos0) + t0 + 1, h / group, pool, layer, q.pages,
                      q.out + (t0 * n_heads + h) * hd, att.data(), isa, kv_rows, wide);
      }
    }
  };
  const bool f16 = L.dtype == kv_dtype::f16;
  auto run = [&](int64_t i0, int64_t i1) {
    if (f16) run_typed(static_cast<uint16_t*>(nullptr), i0, i1);
    else run_typed(static_cast<float*>(nullptr), i0, i1);
  };
  // A handful of short rows is cheaper than waking the workers.
  if (tp == nullptr || tp->size() == 1 || work * hd < (int64_t(1) << 15)) return run(0, units);
  tp->parallel_for_dynamic(units, 8, run);  // as matmul: a slower core takes fewer chunks
}

void paged_attention(const float* q, int64_t n_tokens, int32_t pos0, int n_heads, const kv_pool& pool,
                     int32_t layer, std::span<const int32_t> pages, float* out, std::vector<float>& scratch,
                     thread_pool* tp, cpu_isa isa) {
  (void)scratch;  // kept for callers; each thread now holds its own score buffer
  const attention_seq s{.q = q, .n_tokens = n_tokens, .pos0 = pos0, .pages = pages, .out = out};
  paged_attention_batch(std::span<const attention_seq>(&s, 1), n_heads, pool, layer, tp, isa);
}

}  // namespace tandem::cpu
