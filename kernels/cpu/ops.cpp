#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"

#include <fmt/format.h>
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (GCC bug 105593), which
// -Wuninitialized flags once inlined; the state applies to the header's own lines.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <algorithm>
#include <cmath>
#include <cstring>

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
  }
  return false;
}

cpu_isa resolve_isa(cpu_isa i) {
  if (i == cpu_isa::best) return detected_isa();
  if (!isa_supported(i))
    throw tandem::error(fmt::format("this CPU cannot run the {} kernels; use best or one of scalar{}{}", to_string(i),
                                    isa_supported(cpu_isa::avx2) ? ", avx2" : "",
                                    isa_supported(cpu_isa::avx512) ? ", avx512" : ""));
  return i;
}

std::string_view to_string(cpu_isa i) {
  switch (i) {
    case cpu_isa::best: return "best";
    case cpu_isa::scalar: return "scalar";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::avx512: return "avx512";
  }
  return "?";
}

cpu_isa parse_isa(std::string_view s) {
  for (cpu_isa i : {cpu_isa::best, cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512})
    if (s == to_string(i)) return i;
  throw tandem::error(fmt::format("unknown kernel path '{}'; use best, scalar, avx2 or avx512", s));
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
  switch (resolve_isa(isa)) {
    case cpu_isa::avx512: return dot_avx512(a, b, n);
    case cpu_isa::avx2: return dot_avx2(a, b, n);
    default: return dot_generic(a, b, n);
  }
}

void axpy(float a, const float* x, float* y, int64_t n, cpu_isa isa) {
  switch (resolve_isa(isa)) {
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

// Rows [r0, r1). Batch 1 decodes the weights in registers (8 rows side by side). A larger
// batch decodes a group of 4 rows once into `buf` (exact, so the same values) and runs f32
// tiles of 4 rows x 2 activation rows over it while it sits in L1: the weights stream from
// memory once per call for the whole batch and are decoded once, not once per activation row.
template <ggml_type T>
void rows_avx2(const tensor_view& w, const float* x, int64_t batch, float* y, int64_t r0, int64_t r1,
               std::vector<float>& buf) {
  const int64_t k = w.cols(), n = w.rows();
  int64_t r = r0;
  if (batch == 1) {
    for (; r + 8 <= r1; r += 8) {
      const uint8_t* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = w.row(r + i);
      tile_avx2<T, 8, 1>(rows, k, x, y, n, r, 0);
    }
  } else {
    constexpr ggml_type D = ggml_type::f32;
    if (T != D && buf.size() < size_t(4 * k)) buf.resize(size_t(4 * k));
    for (; r + 4 <= r1; r += 4) {
      const uint8_t* rows[4];
      for (int i = 0; i < 4; ++i) {
        if constexpr (T == D) {
          rows[i] = w.row(r + i);
        } else {
          dequantize_row(T, w.row(r + i), buf.data() + i * k, k);
          rows[i] = reinterpret_cast<const uint8_t*>(buf.data() + i * k);
        }
      }
      int64_t b = 0;
      for (; b + 4 <= batch; b += 4) {
        tile_avx2<D, 2, 4>(rows, k, x, y, n, r, b);
        tile_avx2<D, 2, 4>(rows + 2, k, x, y, n, r + 2, b);
      }
      for (; b + 2 <= batch; b += 2) tile_avx2<D, 4, 2>(rows, k, x, y, n, r, b);
      if (b < batch) tile_avx2<D, 4, 1>(rows, k, x, y, n, r, b);
    }
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

template <ggml_type T, int R, int B>
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
  } else if constexpr (B == 1 && R > 1) {
    // Batch 1 streams weights from memory: the tile's rows are consecutive, so the next
    // tile's rows start `R * row bytes` further on; fetch them one tile ahead, one 64-byte
    // line per row per step (a 16-wide step reads at most 64 bytes of a row).
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
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float tail = 0.0f;
      for (int64_t i = k16; i < k; ++i) tail = std::fma(load_w1<T>(rows[r], i), xs[b][i], tail);
      y[(b0 + b) * n + r0 + r] = hsum16(acc[r][b]) + tail;
    }
}

// 4 decoded weight rows x `count` (< C) activation rows.
template <int C>
TANDEM_AVX512 void tile_avx512_rest(const uint8_t* const* rows, int64_t k, const float* x, float* y, int64_t n,
                                    int64_t r0, int64_t b0, int64_t count) {
  if constexpr (C > 1) {
    if (count == C - 1) return tile_avx512<ggml_type::f32, 4, C - 1>(rows, k, x, y, n, r0, b0);
    return tile_avx512_rest<C - 1>(rows, k, x, y, n, r0, b0, count);
  }
}

// One weight row to f32 with 16-lane conversions (exact, so the same values as
// dequantize_row).
template <ggml_type T>
TANDEM_AVX512 void decode_row_avx512(const uint8_t* row, float* out, int64_t k) {
  if constexpr (T == ggml_type::q8_0) {
    const auto* b = reinterpret_cast<const block_q8_0*>(row);
    for (int64_t i = 0; i < k / q8_0_block; ++i) {
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(b[i].d));
      for (int j = 0; j < q8_0_block; j += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[i].qs + j));
        _mm512_storeu_ps(out + i * q8_0_block + j, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
      }
    }
  } else {
    const int64_t k16 = k & ~int64_t(15);
    for (int64_t i = 0; i < k16; i += 16) _mm512_storeu_ps(out + i, load_w16<T>(row, i));
    for (int64_t i = k16; i < k; ++i) out[i] = load_w1<T>(row, i);
  }
}

// Rows [r0, r1). Batch 1 decodes the weights in registers, 8 rows side by side (enough
// loads in flight to stream at memory speed). A larger batch is cut into blocks of
// activation rows that stay in L2 (`x_block_bytes`); for each block, 4 weight rows are
// decoded once into `buf` (exact) and run as f32 tiles of 4 rows x up to 6 activation rows
// (24 accumulators, 10 loads per 24 FMAs) while they sit in L1. Weights are read from
// memory once per call for a decode batch (one block) and once per block for a prefill.
template <ggml_type T>
void rows_avx512(const tensor_view& w, const float* x, int64_t batch, float* y, int64_t r0, int64_t r1,
                 std::vector<float>& buf) {
  const int64_t k = w.cols(), n = w.rows();
  int64_t r = r0;
  if (batch == 1) {
    for (; r + 8 <= r1; r += 8) {
      const uint8_t* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = w.row(r + i);
      tile_avx512<T, 8, 1>(rows, k, x, y, n, r, 0);
    }
  } else {
    constexpr ggml_type D = ggml_type::f32;
    constexpr int64_t x_block_bytes = 384 << 10;
    const int64_t block = std::max<int64_t>(6, x_block_bytes / (k * int64_t(sizeof(float))) / 6 * 6);
    if (T != D && buf.size() < size_t(4 * k)) buf.resize(size_t(4 * k));
    const int64_t r4 = r0 + (r1 - r0) / 4 * 4;
    const size_t rb = row_bytes(T, k);
    for (int64_t bb = 0; bb < batch; bb += block) {
      const int64_t be = std::min(batch, bb + block);
      for (r = r0; r < r4; r += 4) {
        // The next group's weights into L2 while this group's tiles run (the decode
        // hides its memory reads behind the FMAs this way).
        if (r + 8 <= r4)
          for (int i = 4; i < 8; ++i)
            for (size_t off = 0; off < rb; off += 64)
              _mm_prefetch(reinterpret_cast<const char*>(w.row(r + i)) + off, _MM_HINT_T1);
        const uint8_t* rows[4];
        for (int i = 0; i < 4; ++i) {
          if constexpr (T == D) {
            rows[i] = w.row(r + i);
          } else {
            decode_row_avx512<T>(w.row(r + i), buf.data() + i * k, k);
            rows[i] = reinterpret_cast<const uint8_t*>(buf.data() + i * k);
          }
        }
        // Tiles of nearly equal width (8 = 4 + 4, 32 = 6 + 6 + 5 + 5 + 5 + 5): a narrow
        // remainder tile would reload its 4 weight rows for only a few FMAs.
        const int64_t tiles = (be - bb + 5) / 6, width = (be - bb) / tiles, wide = (be - bb) % tiles;
        int64_t b = bb;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t cnt = width + (t < wide ? 1 : 0);  // the first `wide` tiles are one wider
          if (cnt == 6)
            tile_avx512<D, 4, 6>(rows, k, x, y, n, r, b);
          else
            tile_avx512_rest<6>(rows, k, x, y, n, r, b, cnt);
          b += cnt;
        }
      }
    }
    r = r4;
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
      case ggml_type::f32: return rows_avx512<ggml_type::f32>(w, x, batch, y, r0, r1, buf);
      case ggml_type::f16: return rows_avx512<ggml_type::f16>(w, x, batch, y, r0, r1, buf);
      case ggml_type::bf16: return rows_avx512<ggml_type::bf16>(w, x, batch, y, r0, r1, buf);
      case ggml_type::q8_0: return rows_avx512<ggml_type::q8_0>(w, x, batch, y, r0, r1, buf);
      default: break;
    }
  }
  if (isa == cpu_isa::avx2) {
    switch (w.type) {
      case ggml_type::f32: return rows_avx2<ggml_type::f32>(w, x, batch, y, r0, r1, buf);
      case ggml_type::f16: return rows_avx2<ggml_type::f16>(w, x, batch, y, r0, r1, buf);
      case ggml_type::bf16: return rows_avx2<ggml_type::bf16>(w, x, batch, y, r0, r1, buf);
      case ggml_type::q8_0: return rows_avx2<ggml_type::q8_0>(w, x, batch, y, r0, r1, buf);
      default: break;
    }
  }
  if (buf.size() < size_t(w.cols())) buf.resize(size_t(w.cols()));
  matmul_rows_generic(w, x, batch, y, buf.data(), r0, r1);
}

}  // namespace

void matmul(const tensor_view& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool, cpu_isa isa) {
  const int64_t k = w.cols(), n = w.rows();
  isa = resolve_isa(isa);
  if (!is_supported(w.type))
    throw tandem::error(fmt::format("matmul: weight type {} is not supported; use f32, f16, bf16 or q8_0",
                                    to_string(w.type)));
  if (w.type == ggml_type::q8_0 && k % q8_0_block != 0)
    throw tandem::error(fmt::format("matmul: q8_0 weight with {} columns is not a multiple of {}", k, q8_0_block));
  if (batch <= 0) return;
  // Small products are not worth waking the workers.
  if (pool == nullptr || pool->size() == 1 || n * k * batch < (int64_t(1) << 16)) {
    matmul_rows(w, x, batch, y, scratch, 0, n, isa);
    return;
  }
  // Chunks of whole 8-row groups so every thread runs the wide tiles (the bits do not depend
  // on the split either way).
  const int64_t groups = (n + 7) / 8;
  pool->parallel_for(groups, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf;  // per chunk: the decoded weight rows of this thread
    matmul_rows(w, x, batch, y, buf, g0 * 8, std::min(n, g1 * 8), isa);
  });
}

void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
    float* yr = y + r * n;
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

void rope(float* x, const int32_t* pos, int64_t rows, int n_heads, int head_dim, float freq_base) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < head_dim / 2; ++i) {
      const double theta = double(pos[r]) * std::pow(double(freq_base), -2.0 * i / double(head_dim));
      const float c = float(std::cos(theta)), s = float(std::sin(theta));
      for (int h = 0; h < n_heads; ++h) {
        float* p = x + (r * n_heads + h) * head_dim + 2 * i;
        const float a = p[0], b = p[1];
        p[0] = a * c - b * s;
        p[1] = a * s + b * c;
      }
    }
  }
}

void swiglu(const float* gate, const float* up, float* out, size_t n, thread_pool* pool) {
  auto run = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float g = gate[i];
      out[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  };
  if (pool == nullptr || pool->size() == 1 || n < (size_t(1) << 14)) return run(0, int64_t(n));
  pool->parallel_for(int64_t(n), run);
}

void softmax(float* x, size_t n) {
  if (n == 0) return;
  const float mx = *std::max_element(x, x + n);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = float(1.0 / sum);
  for (size_t i = 0; i < n; ++i) x[i] *= inv;
}

namespace {

// One (token, head) row of attention: scores over positions [0, len), softmax, weighted sum
// of V. Its arithmetic depends only on its own inputs, so any split of rows gives the same bits.
// 16 dot products at once with, for each, exactly dot_avx512's arithmetic: the same two
// accumulators over k, then the hsum16 tree (lanes i+8, then i+4, then i+2, then i+1) run
// as a transpose network over the 16 accumulators instead of 16 separate reductions.
// n must be a multiple of 16 (dot_avx512's tail is then empty and adds +0.0f).
TANDEM_AVX512 void dot16_avx512(const float* a, const float* const* rows, int64_t n, float* out) {
  __m512 A[16];
  for (int j = 0; j < 16; ++j) {
    const float* b = rows[j];
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k + 16), _mm512_loadu_ps(b + k + 16), s1);
    }
    for (; k + 16 <= n; k += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), s0);
    A[j] = _mm512_add_ps(s0, s1);
  }
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
  alignas(64) float t[16];
  _mm512_store_ps(t, E);
  for (int q = 0; q < 4; ++q)
    for (int j = 0; j < 4; ++j) out[4 * j + q] = t[4 * q + j] + 0.0f;
}

// out[0, n) = sum_p att[p] * rows[p][0, n): per element the same FMA chain as repeated
// axpy_avx512 calls, with the running sums kept in registers (n a multiple of 16).
TANDEM_AVX512 void weighted_sum_avx512(const float* att, const float* const* rows, int64_t len, int64_t n,
                                       float* out) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64) {
    __m512 y0 = _mm512_setzero_ps(), y1 = y0, y2 = y0, y3 = y0;
    for (int64_t p = 0; p < len; ++p) {
      const __m512 a = _mm512_set1_ps(att[p]);
      const float* v = rows[p] + c;
      y0 = _mm512_fmadd_ps(a, _mm512_loadu_ps(v), y0);
      y1 = _mm512_fmadd_ps(a, _mm512_loadu_ps(v + 16), y1);
      y2 = _mm512_fmadd_ps(a, _mm512_loadu_ps(v + 32), y2);
      y3 = _mm512_fmadd_ps(a, _mm512_loadu_ps(v + 48), y3);
    }
    _mm512_storeu_ps(out + c, y0);
    _mm512_storeu_ps(out + c + 16, y1);
    _mm512_storeu_ps(out + c + 32, y2);
    _mm512_storeu_ps(out + c + 48, y3);
  }
  for (; c < n; c += 16) {
    __m512 y = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; ++p) y = _mm512_fmadd_ps(_mm512_set1_ps(att[p]), _mm512_loadu_ps(rows[p] + c), y);
    _mm512_storeu_ps(out + c, y);
  }
}

void attention_row(const float* qh, int64_t len, int kvh, const kv_pool& pool, int32_t layer,
                   std::span<const int32_t> pages, float* oh, float* att, cpu_isa isa,
                   std::vector<const float*>& rows) {
  const kv_layout& L = pool.layout();
  const int hd = L.head_dim, n_kv = L.n_kv_heads, ps = L.page_size;
  const float scale = 1.0f / std::sqrt(float(hd));
  if (isa == cpu_isa::avx512 && hd % 16 == 0) {
    // Same bits as the generic loop below with dot()/axpy() on this path.
    rows.resize(size_t(len));
    for (int64_t p = 0; p < len; ++p)
      rows[size_t(p)] = pool.k(pages[size_t(p / ps)], layer) + (size_t(p % ps) * n_kv + kvh) * hd;
    int64_t p = 0;
    for (; p + 16 <= len; p += 16) dot16_avx512(qh, rows.data() + p, hd, att + p);
    for (; p < len; ++p) att[p] = dot_avx512(qh, rows[size_t(p)], hd);
    for (p = 0; p < len; ++p) att[p] *= scale;
    softmax(att, size_t(len));
    for (p = 0; p < len; ++p) rows[size_t(p)] += L.layer_floats();  // V sits right after K
    weighted_sum_avx512(att, rows.data(), len, hd, oh);
    return;
  }
  for (int64_t p = 0; p < len; ++p) {
    const float* kp = pool.k(pages[size_t(p / ps)], layer) + (size_t(p % ps) * n_kv + kvh) * hd;
    att[p] = dot(qh, kp, hd, isa) * scale;
  }
  softmax(att, size_t(len));
  std::fill(oh, oh + hd, 0.0f);
  for (int64_t p = 0; p < len; ++p) {
    const float* vp = pool.v(pages[size_t(p / ps)], layer) + (size_t(p % ps) * n_kv + kvh) * hd;
    axpy(att[p], vp, oh, hd, isa);
  }
}

void check_attention(const attention_seq& s, int n_heads, const kv_pool& pool) {
  const kv_layout& L = pool.layout();
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
  isa = resolve_isa(isa);
  const kv_layout& L = pool.layout();
  int64_t rows = 0, max_ctx = 0, work = 0;
  std::vector<int64_t> first;  // first row of each sequence
  first.reserve(seqs.size() + 1);
  for (const attention_seq& s : seqs) {
    check_attention(s, n_heads, pool);
    first.push_back(rows);
    rows += s.n_tokens * n_heads;
    max_ctx = std::max(max_ctx, int64_t(s.pos0) + s.n_tokens);
    work += s.n_tokens * (int64_t(s.pos0) + s.n_tokens) * n_heads;
  }
  first.push_back(rows);
  if (rows == 0) return;
  const int group = n_heads / L.n_kv_heads;
  const int hd = L.head_dim;
  // Index i runs row i/2 from the front (even i) or from the back (odd i): causal rows grow
  // in length, so contiguous chunks of indices get about the same work.
  auto run = [&](int64_t i0, int64_t i1) {
    std::vector<float> att(static_cast<size_t>(max_ctx));
    std::vector<const float*> kv_rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i % 2 == 0 ? i / 2 : rows - 1 - i / 2;
      const size_t s = size_t(std::upper_bound(first.begin(), first.end(), r) - first.begin()) - 1;
      const attention_seq& q = seqs[s];
      // Head-major within a sequence: consecutive rows share one head's K/V, which then
      // stays in L2 across a prefill chunk's queries instead of cycling through all heads.
      const int64_t t = (r - first[s]) % q.n_tokens;
      const int h = int((r - first[s]) / q.n_tokens);
      attention_row(q.q + (t * n_heads + h) * hd, int64_t(q.pos0) + t + 1, h / group, pool, layer, q.pages,
                    q.out + (t * n_heads + h) * hd, att.data(), isa, kv_rows);
    }
  };
  // A handful of short rows is cheaper than waking the workers.
  if (tp == nullptr || tp->size() == 1 || work * hd < (int64_t(1) << 15)) return run(0, rows);
  tp->parallel_for(rows, run);
}

void paged_attention(const float* q, int64_t n_tokens, int32_t pos0, int n_heads, const kv_pool& pool,
                     int32_t layer, std::span<const int32_t> pages, float* out, std::vector<float>& scratch,
                     thread_pool* tp, cpu_isa isa) {
  (void)scratch;  // kept for callers; each thread now holds its own score buffer
  const attention_seq s{.q = q, .n_tokens = n_tokens, .pos0 = pos0, .pages = pages, .out = out};
  paged_attention_batch(std::span<const attention_seq>(&s, 1), n_heads, pool, layer, tp, isa);
}

}  // namespace tandem::cpu
