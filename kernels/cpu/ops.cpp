#include "kernels/cpu/ops.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/avx512_sum.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels/base/error.h"
#include "kernels/gguf/half.h"

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

uint16_t fp32_to_fp16(float f) { return gguf::fp32_to_fp16(f); }

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

uint16_t fp32_to_bf16(float f) { return gguf::fp32_to_bf16(f); }

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
    case ggml_type::q4_0:
    case ggml_type::q4_K:
    case ggml_type::q5_K:
    case ggml_type::q6_K: {
      if (n % block_elems(t) != 0)
        throw tandem::error(
            fmt::format("{} row of {} elements is not a multiple of {}", to_string(t), n, block_elems(t)));
      if (t == ggml_type::q4_0) dequantize_row_q4_0(static_cast<const block_q4_0*>(row), out, n);
      if (t == ggml_type::q4_K) dequantize_row_q4_K(static_cast<const block_q4_K*>(row), out, n);
      if (t == ggml_type::q5_K) dequantize_row_q5_K(static_cast<const block_q5_K*>(row), out, n);
      if (t == ggml_type::q6_K) dequantize_row_q6_K(static_cast<const block_q6_K*>(row), out, n);
      return;
    }
    default:
      throw tandem::error(fmt::format("tensor type {} is not supported for compute; use {}", to_string(t),
                                      supported_types_list));
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

void rope_table::build(const int32_t* pos, int64_t n_rows, int head_dim_, float freq_base, bool neox_,
                       const float* freq_factors, const yarn_scaling* yarn, float yarn_magnitude) {
  rows = n_rows;
  head_dim = head_dim_;
  neox = neox_;
  // The frequencies once per table, not once per row (the same doubles either way).
  const int half = head_dim / 2;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    freq[size_t(i)] = std::pow(double(freq_base), -2.0 * i / double(head_dim));
    if (freq_factors != nullptr) freq[size_t(i)] /= double(freq_factors[i]);
  }
  // YaRN: how much of pair i keeps its original angle (1) or takes the interpolated one (0).
  std::vector<double> keep(static_cast<size_t>(half), 1.0);
  double interp = 1.0, magnitude = 1.0;
  if (yarn != nullptr && yarn->on()) {
    interp = 1.0 / double(yarn->factor);
    magnitude = double(yarn_magnitude);
    // The pair index whose wavelength fits `rotations` turns into the original context.
    auto corr_dim = [&](float rotations) {
      return double(head_dim) * std::log(double(yarn->orig_ctx) / (double(rotations) * 2.0 * M_PI)) /
             (2.0 * std::log(double(freq_base)));
    };
    const double low = std::max(0.0, std::floor(corr_dim(yarn->beta_fast)));
    const double high = std::min(double(head_dim - 1), std::ceil(corr_dim(yarn->beta_slow)));
    for (int i = 0; i < half; ++i) {
      const double y = (double(i) - low) / std::max(0.001, high - low);
      keep[size_t(i)] = 1.0 - std::min(1.0, std::max(0.0, y));
    }
  }
  cos_sin.resize(size_t(rows) * size_t(half) * 2);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < half; ++i) {
      const double extrap = double(pos[r]) * freq[size_t(i)];
      const double k = keep[size_t(i)];
      const double theta = interp == 1.0 ? extrap : extrap * interp * (1.0 - k) + extrap * k;
      cos_sin[size_t((r * half + i) * 2)] = float(std::cos(theta) * magnitude);
      cos_sin[size_t((r * half + i) * 2 + 1)] = float(std::sin(theta) * magnitude);
    }
}

void rope(float* x, const rope_table& t, int n_heads, thread_pool* pool) {
  const int half = t.head_dim / 2;
  auto run = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int h = 0; h < n_heads; ++h) {
        float* p = x + (r * n_heads + h) * t.head_dim;
        const float* cs = t.cos_sin.data() + size_t(r * half) * 2;
        // The two elements a pair rotates: adjacent (normal) or half a head apart (neox).
        const int stride = t.neox ? half : 1, step = t.neox ? 1 : 2;
        for (int i = 0; i < half; ++i) {
          const float c = cs[2 * i], s = cs[2 * i + 1];
          float* e0 = p + i * step;
          const float a = e0[0], b = e0[stride];
          e0[0] = a * c - b * s;
          e0[stride] = a * s + b * c;
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


}  // namespace tandem::cpu
