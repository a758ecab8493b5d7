#include "kernels/cpu/quant_ref.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "kernels/base/error.h"
#include "kernels/gguf/half.h"

// Only header-only helpers here (no ops.cpp): the GGUF fuzz target links this file alone.
namespace tandem::cpu {

using gguf::fp16_to_fp32;
using gguf::fp32_to_fp16;

// ---------------------------------------------------------------------------------------------
// Decoding: one element at a time, in the order the format comments in kernels/tensor.h give.

void dequantize_row_q4_0(const block_q4_0* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n / q4_0_block; ++i, out += q4_0_block) {
    const float d = fp16_to_fp32(b[i].d);
    for (int j = 0; j < q4_0_block / 2; ++j) {
      out[j] = d * float((b[i].qs[j] & 0xF) - 8);
      out[j + 16] = d * float((b[i].qs[j] >> 4) - 8);
    }
  }
}

namespace {

// Element e of a q4_K / q5_K super-block: its 4 low bits, its sub-block.
int k4_low(const uint8_t* qs, int e) {
  const int g = e / 64, l = e % 32;
  return e % 64 < 32 ? qs[32 * g + l] & 0xF : qs[32 * g + l] >> 4;
}

template <class Block>
void dequantize_k4(const Block* b, float* out, int64_t n, bool fifth_bit) {
  for (int64_t i = 0; i < n / qk_k; ++i, out += qk_k) {
    const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
    for (int e = 0; e < qk_k; ++e) {
      uint8_t sc, m;
      k4_scale_min(e / 32, b[i].scales, sc, m);
      int q = k4_low(b[i].qs, e);
      if constexpr (requires { b[i].qh; })
        if (fifth_bit && (b[i].qh[e % 32] >> (e / 32) & 1)) q += 16;  // bit 2g or 2g + 1 = e / 32
      out[e] = d * float(sc) * float(q) - dmin * float(m);
    }
  }
}

}  // namespace

void dequantize_row_q4_K(const block_q4_K* b, float* out, int64_t n) { dequantize_k4(b, out, n, false); }
void dequantize_row_q5_K(const block_q5_K* b, float* out, int64_t n) { dequantize_k4(b, out, n, true); }

void dequantize_row_q6_K(const block_q6_K* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n / qk_k; ++i, out += qk_k) {
    const float d = fp16_to_fp32(b[i].d);
    for (int e = 0; e < qk_k; ++e) {
      const int h = e / 128, r = e % 128, l = r % 32, k = r / 32;  // k: which of the four 32-runs
      const uint8_t lo = b[i].ql[64 * h + 32 * (k % 2) + l];
      const int low = k < 2 ? lo & 0xF : lo >> 4;
      const int high = (b[i].qh[32 * h + l] >> (2 * k)) & 3;
      out[e] = d * float(b[i].scales[e / 16]) * float((low | high << 4) - 32);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Quantizing.

namespace {

int nearest(float x) { return int(std::lrintf(x)); }

void q4_0_one(const float* x, block_q4_0& out) {
  float amax = 0.0f, max = 0.0f;  // the value of largest magnitude, with its sign
  for (int j = 0; j < q4_0_block; ++j)
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  const float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  out.d = fp32_to_fp16(d);
  for (int j = 0; j < q4_0_block / 2; ++j) {
    // x * id in [-8, 8]: + 8.5 and truncation round to nearest in 0..16, capped at 15.
    const int a = std::min(15, int(x[j] * id + 8.5f)), b = std::min(15, int(x[j + 16] * id + 8.5f));
    out.qs[j] = uint8_t(a | b << 4);
  }
}

// Scale and min (returned as a non-negative `neg_min`, x ~ scale * L - neg_min) for n values
// with codes 0..nmax, minimising sum w (scale L + min - x)^2: the range endpoints first, then
// nstep + 1 trial scales around nmax / range, each refit by weighted least squares.
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float& neg_min, float rmin,
                    float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = 0.0f, sum_x = 0.0f;
  for (int i = 0; i < n; ++i) {
    min = std::min(min, x[i]);
    max = std::max(max, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0.0f) min = 0.0f;
  if (max == min) {
    std::fill(L, L + n, 0);
    neg_min = -min;
    return 0.0f;
  }
  float iscale = float(nmax) / (max - min), scale = 1.0f / iscale, best = 0.0f;
  for (int i = 0; i < n; ++i) {
    L[i] = uint8_t(std::clamp(nearest(iscale * (x[i] - min)), 0, nmax));
    const float diff = scale * L[i] + min - x[i];
    best += w[i] * diff * diff;
  }
  uint8_t aux[32];
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * float(is) + float(nmax)) / (max - min);
    float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest(iscale * (x[i] - min)), 0, nmax);
      aux[i] = uint8_t(l);
      sum_l += w[i] * float(l);
      sum_l2 += w[i] * float(l * l);
      sum_xl += w[i] * float(l) * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D <= 0.0f) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D, this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0.0f) {
      this_min = 0.0f;
      this_scale = sum_xl / sum_l2;
    }
    float err = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * aux[i] + this_min - x[i];
      err += w[i] * diff * diff;
    }
    if (err < best) {
      std::memcpy(L, aux, size_t(n));
      best = err;
      scale = this_scale;
      min = this_min;
    }
  }
  neg_min = -min;
  return scale;
}

// q4_K / q5_K super-block: per sub-block scale and min fitted, both quantized to 6 bits
// against the block's largest, then the values re-quantized with the stored scales.
template <class Block>
void k4_block(const float* x, Block& out, int nmax, float rmin, int nstep) {
  uint8_t L[qk_k];
  float scales[8], mins[8], max_scale = 0.0f, max_min = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const float* v = x + 32 * j;
    float sum_x2 = 0.0f;
    for (int l = 0; l < 32; ++l) sum_x2 += v[l] * v[l];
    const float av = std::sqrt(sum_x2 / 32.0f);
    float w[32];
    for (int l = 0; l < 32; ++l) w[l] = av + std::fabs(v[l]);
    scales[j] = fit_scale_min(32, nmax, v, w, L + 32 * j, mins[j], rmin, 0.1f, nstep);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  std::memset(out.scales, 0, sizeof out.scales);
  for (int j = 0; j < 8; ++j) {
    const int ls = std::min(63, nearest(inv_scale * scales[j])), lm = std::min(63, nearest(inv_min * mins[j]));
    if (j < 4) {
      out.scales[j] = uint8_t(ls);
      out.scales[j + 4] = uint8_t(lm);
    } else {  // low 4 bits in bytes 8..11, top 2 bits in the top of bytes 0..7
      out.scales[j + 4] = uint8_t((ls & 0xF) | (lm & 0xF) << 4);
      out.scales[j - 4] |= uint8_t((ls >> 4) << 6);
      out.scales[j] |= uint8_t((lm >> 4) << 6);
    }
  }
  out.d = fp32_to_fp16(max_scale / 63.0f);
  out.dmin = fp32_to_fp16(max_min / 63.0f);
  const float d = fp16_to_fp32(out.d), dmin = fp16_to_fp32(out.dmin);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    k4_scale_min(j, out.scales, sc, m);
    const float ds = d * float(sc), dm = dmin * float(m);
    for (int l = 0; l < 32; ++l)
      L[32 * j + l] = ds == 0.0f ? 0 : uint8_t(std::clamp(nearest((x[32 * j + l] + dm) / ds), 0, nmax));
  }
  std::memset(out.qs, 0, sizeof out.qs);
  if constexpr (requires { out.qh; }) std::memset(out.qh, 0, sizeof out.qh);
  for (int e = 0; e < qk_k; ++e) {
    const int g = e / 64, l = e % 32;
    out.qs[32 * g + l] |= uint8_t((L[e] & 0xF) << (e % 64 < 32 ? 0 : 4));
    if constexpr (requires { out.qh; }) out.qh[l] |= uint8_t((L[e] >> 4) << (e / 32));
  }
}

// Symmetric scale for n values with codes -nmax..nmax-1 (stored + nmax), weighted by x^2:
// the scale of the largest magnitude, then 18 nearby trial scales, each refit by least squares.
float fit_scale_sym(int n, int nmax, const float* x, int8_t* L) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  if (amax < 1e-15f) {
    std::fill(L, L + n, int8_t(0));
    return 0.0f;
  }
  auto fit = [&](float iscale, float& sumlx, float& suml2, int8_t* out) {
    sumlx = suml2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest(iscale * x[i]), -nmax, nmax - 1);
      if (out != nullptr) out[i] = int8_t(l);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * float(l);
      suml2 += w * float(l * l);
    }
  };
  float sumlx, suml2;
  fit(-float(nmax) / max, sumlx, suml2, L);
  float scale = suml2 > 0.0f ? sumlx / suml2 : 0.0f, best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float iscale = -(float(nmax) + 0.1f * float(is)) / max;
    fit(iscale, sumlx, suml2, nullptr);
    if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
      fit(iscale, sumlx, suml2, L);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

void q6_K_block(const float* x, block_q6_K& out) {
  int8_t L[qk_k];
  float scales[16], max_scale = 0.0f, max_abs = 0.0f;
  for (int j = 0; j < 16; ++j) {
    scales[j] = fit_scale_sym(16, 32, x + 16 * j, L + 16 * j);
    if (std::fabs(scales[j]) > max_abs) {
      max_abs = std::fabs(scales[j]);
      max_scale = scales[j];
    }
  }
  std::memset(&out, 0, sizeof out);
  if (max_abs < 1e-15f) return;  // all zero: d = 0 decodes every element to 0
  const float iscale = -128.0f / max_scale;
  out.d = fp32_to_fp16(1.0f / iscale);
  for (int j = 0; j < 16; ++j) out.scales[j] = int8_t(std::min(127, nearest(iscale * scales[j])));
  const float d = fp16_to_fp32(out.d);
  for (int j = 0; j < 16; ++j) {
    const float ds = d * float(out.scales[j]);
    for (int i = 0; i < 16; ++i)
      L[16 * j + i] = ds == 0.0f ? 0 : int8_t(std::clamp(nearest(x[16 * j + i] / ds), -32, 31));
  }
  for (int e = 0; e < qk_k; ++e) {
    const int h = e / 128, r = e % 128, l = r % 32, k = r / 32;
    const int q = L[e] + 32;
    out.ql[64 * h + 32 * (k % 2) + l] |= uint8_t((q & 0xF) << (k < 2 ? 0 : 4));
    out.qh[32 * h + l] |= uint8_t((q >> 4) << (2 * k));
  }
}

}  // namespace

void quantize_row_q4_0(const float* x, block_q4_0* out, int64_t n) {
  for (int64_t i = 0; i < n / q4_0_block; ++i) q4_0_one(x + i * q4_0_block, out[i]);
}
void quantize_row_q4_K(const float* x, block_q4_K* out, int64_t n) {
  for (int64_t i = 0; i < n / qk_k; ++i) k4_block(x + i * qk_k, out[i], 15, -1.0f, 20);
}
void quantize_row_q5_K(const float* x, block_q5_K* out, int64_t n) {
  for (int64_t i = 0; i < n / qk_k; ++i) k4_block(x + i * qk_k, out[i], 31, -0.5f, 15);
}
void quantize_row_q6_K(const float* x, block_q6_K* out, int64_t n) {
  for (int64_t i = 0; i < n / qk_k; ++i) q6_K_block(x + i * qk_k, out[i]);
}

void dequantize_row_ref(ggml_type t, const void* row, float* out, int64_t n) {
  if (!is_supported(t) || n % block_elems(t) != 0)
    throw tandem::error(fmt::format("dequantize_row_ref: {} row of {} elements", to_string(t), n));
  const auto* u16 = static_cast<const uint16_t*>(row);
  switch (t) {
    case ggml_type::f32: std::memcpy(out, row, size_t(n) * 4); return;
    case ggml_type::f16:
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(u16[i]);
      return;
    case ggml_type::bf16:
      for (int64_t i = 0; i < n; ++i) out[i] = gguf::bf16_to_fp32(u16[i]);
      return;
    case ggml_type::q8_0: {
      const auto* b = static_cast<const block_q8_0*>(row);
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(b[i / 32].d) * float(b[i / 32].qs[i % 32]);
      return;
    }
    case ggml_type::q4_0: return dequantize_row_q4_0(static_cast<const block_q4_0*>(row), out, n);
    case ggml_type::q4_K: return dequantize_row_q4_K(static_cast<const block_q4_K*>(row), out, n);
    case ggml_type::q5_K: return dequantize_row_q5_K(static_cast<const block_q5_K*>(row), out, n);
    default: return dequantize_row_q6_K(static_cast<const block_q6_K*>(row), out, n);
  }
}

void quantize_row_q8_0(const float* x, block_q8_0* out, int64_t n) {
  for (int64_t blk = 0; blk < n / q8_0_block; ++blk) {
    const float* v = x + blk * q8_0_block;
    float amax = 0.0f;
    for (int j = 0; j < q8_0_block; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[blk].d = fp32_to_fp16(d);
    for (int j = 0; j < q8_0_block; ++j) out[blk].qs[j] = int8_t(std::roundf(v[j] * id));
  }
}

std::vector<uint8_t> quantize_rows(ggml_type t, const float* x, int64_t rows, int64_t cols) {
  if (!int8_matmul(t))
    throw tandem::error(fmt::format("quantize_rows: {} is not one of q4_0, q4_K, q5_K, q6_K, q8_0", to_string(t)));
  if (cols % block_elems(t) != 0)
    throw tandem::error(fmt::format("quantize_rows: rows of {} elements are not a multiple of the {} block of {}",
                                    cols, to_string(t), block_elems(t)));
  // Blocks never span rows, so the rows are one run of blocks, quantized independently: split
  // across threads in contiguous ranges (the bytes do not depend on the split). A 1B model's
  // k-quant search took minutes on one thread.
  const int64_t be = block_elems(t), nb = rows * cols / be;
  const size_t bb = row_bytes(t, be);
  std::vector<uint8_t> out(bb * size_t(nb));
  auto run = [&](int64_t b0, int64_t b1) {
    const float* v = x + b0 * be;
    void* o = out.data() + size_t(b0) * bb;
    const int64_t n = (b1 - b0) * be;
    switch (t) {
      case ggml_type::q4_0: quantize_row_q4_0(v, static_cast<block_q4_0*>(o), n); break;
      case ggml_type::q4_K: quantize_row_q4_K(v, static_cast<block_q4_K*>(o), n); break;
      case ggml_type::q5_K: quantize_row_q5_K(v, static_cast<block_q5_K*>(o), n); break;
      case ggml_type::q8_0: quantize_row_q8_0(v, static_cast<block_q8_0*>(o), n); break;
      default: quantize_row_q6_K(v, static_cast<block_q6_K*>(o), n); break;
    }
  };
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 64);
  if (threads == 1 || nb < 4096) {
    run(0, nb);
    return out;
  }
  std::vector<std::thread> pool;
  for (int64_t i = 0; i < threads; ++i) pool.emplace_back(run, nb * i / threads, nb * (i + 1) / threads);
  for (auto& th : pool) th.join();
  return out;
}

}  // namespace tandem::cpu
