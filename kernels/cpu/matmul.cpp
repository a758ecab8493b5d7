// The batched matmul (ops.h: matmul, matmul_many, pack_weight): the blocked GEMM driver and its
// f32/f16/bf16 row kernels per ISA; q8_0 and the low-bit weights go to quant_matmul.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/base/error.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/avx512_sum.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

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
    for (int64_t b = 0; b < batch; ++b) y[b * n + r] = dot(wr, x + b * k, k, cpu_isa::scalar);
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
  } else {
    static_assert(T == ggml_type::bf16, "f32, f16 and bf16 only: q8_0 and the low-bit types run quant_matmul");
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  }
}

template <ggml_type T>
inline float load_w1(const uint8_t* row, int64_t i) {
  if constexpr (T == ggml_type::f32) {
    return reinterpret_cast<const float*>(row)[i];
  } else if constexpr (T == ggml_type::f16) {
    return fp16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
  } else {
    static_assert(T == ggml_type::bf16, "f32, f16 and bf16 only");
    return bf16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
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
  for (int64_t i = 0; i < k8; i += 8) {
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = load_w8<T>(rows[r], i);
    fma_step<R, B>(acc, wv, xs, i);
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

/// y[j] of N weight rows anywhere (batch 1): tile_avx2<T, N, 1>'s sums, bit for bit.
template <ggml_type T, int N>
__attribute__((target("avx2,fma,f16c"))) void dotn_avx2(const uint8_t* const (&rows)[N], int64_t k, const float* x,
                                                        float* const (&y)[N]) {
  const int64_t k8 = k & ~int64_t(7);
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k8; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(load_w8<T>(rows[j], i), xv, acc[j]);
  }
  for (int j = 0; j < N; ++j) {
    float t = 0.0f;
    for (int64_t i = k8; i < k; ++i) t = std::fma(load_w1<T>(rows[j], i), x[i], t);
    *y[j] = hsum8(acc[j]) + t;
  }
}

/// Batch 1 over rows [r0, r1) in for_row_streams' order: dot(rows, out) with the rows' bytes
/// and their outputs in y. Returns the first row not covered.
template <class Dot>
int64_t batch1_rows(const tensor_view& w, float* y, int64_t r0, int64_t r1, Dot&& dot) {
  return for_row_streams<batch1_streams>(r0, r1, [&](const int64_t (&rr)[batch1_streams]) {
    const uint8_t* rows[batch1_streams];
    float* out[batch1_streams];
    for (int j = 0; j < batch1_streams; ++j) rows[j] = w.row(rr[j]), out[j] = y + rr[j];
    dot(std::as_const(rows), std::as_const(out));
  });
}

// Rows [r0, r1). Batch 1 reads rows in for_row_streams' order (ops.h). A larger
// batch runs tiles of 3 weight rows x up to 4 activation rows (12 accumulators, all 16
// registers in use) in gemm_blocks' order, also decoding the weights in registers.
template <ggml_type T>
void rows_avx2(const tensor_view& w, const float* x, int64_t batch, float* y, int64_t r0, int64_t r1) {
  const int64_t k = w.cols(), n = w.rows();
  int64_t r = r0;
  if (batch == 1) {
    r = batch1_rows(w, y, r0, r1,
                    [&](const auto& rows, const auto& out) { dotn_avx2<T, batch1_streams>(rows, k, x, out); });
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
  } else {
    static_assert(T == ggml_type::bf16, "f32, f16 and bf16 only");
    // Widened by a zero-extend and a shift: measured as cheap as f16's conversion (batch 1,
    // 192 x 2048 in L2, 1 thread, Zen 5, side by side: 45-49 GB/s of weights for both), so
    // batch-1 bf16 is as memory-bound as f16.
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
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
  if constexpr (R > 1 && R <= 4 && Fetch) {
    // The tile's rows are consecutive and the next tile takes the next R rows, which start
    // `R * row bytes` further on; fetch them one tile ahead, one 64-byte line per row per
    // step (a 16-wide step reads at most 64 bytes of a row). Only in the first activation
    // tile of each gemm_blocks block, where they come from memory (the later ones find the
    // block in L2). Measured on f16, side by side: at batch 32 (6 tiles a block) dropping it
    // cost 14%; at batch 480 fetching in every tile cost 2-5% at k = 768 (10% at k = 2048
    // with activations not cache-line aligned).
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

/// y[j] of N weight rows anywhere (batch 1): tile_avx512<T, N, 1>'s sums, bit for bit.
template <ggml_type T, int N>
TANDEM_AVX512 void dotn_avx512(const uint8_t* const (&rows)[N], int64_t k, const float* x, float* const (&y)[N]) {
  const int64_t k16 = k & ~int64_t(15);
  __m512 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t i = 0; i < k16; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
#pragma GCC unroll 4
    for (int j = 0; j < N; ++j) acc[j] = _mm512_fmadd_ps(load_w16<T>(rows[j], i), xv, acc[j]);
  }
  for (int j = 0; j < N; ++j) {
    float t = 0.0f;
    for (int64_t i = k16; i < k; ++i) t = std::fma(load_w1<T>(rows[j], i), x[i], t);
    *y[j] = hsum16(acc[j]) + t;
  }
}

// Rows [r0, r1). Batch 1 reads rows in for_row_streams' order (ops.h). A larger batch runs
// tiles of 4 weight rows x up to 6 activation rows (24 accumulators) in gemm_blocks' order at every k. Measured on f16,
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
    r = batch1_rows(w, y, r0, r1,
                    [&](const auto& rows, const auto& out) { dotn_avx512<T, batch1_streams>(rows, k, x, out); });
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
      default: break;
    }
  }
  if (isa == cpu_isa::avx2) {
    switch (w.type) {
      case ggml_type::f32: return rows_avx2<ggml_type::f32>(w, x, batch, y, r0, r1);
      case ggml_type::f16: return rows_avx2<ggml_type::f16>(w, x, batch, y, r0, r1);
      case ggml_type::bf16: return rows_avx2<ggml_type::bf16>(w, x, batch, y, r0, r1);
      default: break;
    }
  }
  if (buf.size() < size_t(w.cols())) buf.resize(size_t(w.cols()));
  matmul_rows_generic(w, x, batch, y, buf.data(), r0, r1);
}

}  // namespace

void matmul(const packed_weight& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool) {
  if (w.amx) return amx_matmul(*w.amx, x, batch, y, scratch, pool);
  if (w.quant) {
    const quant_weight ws[] = {{&w.view, w.quant.get()}};
    float* ys[] = {y};
    return quant_matmul_many(ws, x, batch, ys, pool, vector_isa(resolve_isa(w.isa)));
  }
  matmul(w.view, x, batch, y, scratch, pool, w.isa);
}

namespace {

// Threaded matmuls run chunks of whole 24-row groups so every chunk runs whole tiles (8, 4, 6
// or 3 rows; the bits do not depend on the split either way).
constexpr int64_t matmul_group_rows = 24;

// The weight types and shapes the vector kernels take (tandem::error otherwise).
void check_matmul_weight(const tensor_view& w) {
  if (!is_supported(w.type))
    throw tandem::error(fmt::format("matmul: weight type {} is not supported; use {}", to_string(w.type),
                                    supported_types_list));
  if (w.cols() % block_elems(w.type) != 0)
    throw tandem::error(fmt::format("matmul: {} weight with {} columns is not a multiple of {}", to_string(w.type),
                                    w.cols(), block_elems(w.type)));
}

}  // namespace

void matmul_many(std::span<const packed_weight* const> ws, const float* x, int64_t batch, std::span<float* const> ys,
                 std::vector<float>& scratch, thread_pool* pool) {
  if (ws.size() != ys.size()) throw tandem::error("matmul_many: one output per weight");
  if (ws.empty()) return;
  const int64_t k = ws[0]->view.cols();
  bool all_amx = true, same_path = true, all_low_bit = true;
  int64_t work = 0;
  for (const packed_weight* w : ws) {
    if (w->view.cols() != k)
      throw tandem::error(fmt::format("matmul_many: weights of {} and {} columns cannot share one input", k,
                                      w->view.cols()));
    all_amx = all_amx && w->amx != nullptr;
    same_path = same_path && w->amx == nullptr && w->isa == ws[0]->isa && !int8_matmul(w->view.type);
    all_low_bit = all_low_bit && int8_matmul(w->view.type) && w->isa == ws[0]->isa;
    work += w->view.rows() * k * batch;
  }
  if (all_low_bit) {  // one input quantization and one fork-join for all (quant_matmul.h)
    std::vector<quant_weight> vs;
    for (const packed_weight* w : ws) vs.push_back({&w->view, w->quant.get()});
    return quant_matmul_many(vs, x, batch, ys, pool, vector_isa(resolve_isa(ws[0]->isa)));
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

void matmul_jobs(std::span<const matmul_job> jobs, std::vector<float>& scratch, thread_pool* pool) {
  // Float weights on one vector path share one fork-join, low-bit ones another (their inputs
  // are quantized first); the rest (amx tiles, a mix of paths) run one matmul each.
  std::vector<const matmul_job*> vec, other;
  std::vector<quant_weight> qw;
  std::vector<const float*> qx;
  std::vector<int64_t> qb;
  std::vector<float*> qy;
  cpu_isa isa = cpu_isa::scalar, qisa = cpu_isa::scalar;
  for (const matmul_job& j : jobs) {
    const packed_weight& w = *j.w;
    const cpu_isa path = vector_isa(resolve_isa(w.isa));
    if (w.amx != nullptr || j.batch <= 0) {
      other.push_back(&j);
    } else if (int8_matmul(w.view.type) && (qw.empty() || path == qisa)) {
      qisa = path;
      qw.push_back({&w.view, w.quant.get()}), qx.push_back(j.x), qb.push_back(j.batch), qy.push_back(j.y);
    } else if (!int8_matmul(w.view.type) && (vec.empty() || path == isa)) {
      check_matmul_weight(w.view);
      isa = path;
      vec.push_back(&j);
    } else {
      other.push_back(&j);
    }
  }
  for (const matmul_job* j : other) matmul(*j->w, j->x, j->batch, j->y, scratch, pool);
  if (!qw.empty()) quant_matmul_jobs(qw, qx, qb, qy, pool, qisa);
  if (vec.empty()) return;
  // A row group weighs its job's batch: a prefill's experts get very different row counts.
  std::vector<int64_t> off(1, 0), per;
  int64_t work = 0;
  for (const matmul_job* j : vec) {
    per.push_back(j->batch);
    off.push_back(off.back() + (j->w->view.rows() + matmul_group_rows - 1) / matmul_group_rows * j->batch);
    work += j->w->view.rows() * j->w->view.cols() * j->batch;
  }
  auto run = [&](int64_t u0, int64_t u1) {
    std::vector<float> buf;  // per chunk: the decoded weight rows of the generic path
    for_weighted_parts(off, per, u0, u1, [&](size_t i, int64_t lo, int64_t hi) {
      const matmul_job& j = *vec[i];
      matmul_rows(j.w->view, j.x, j.batch, j.y, buf, lo * matmul_group_rows,
                  std::min(j.w->view.rows(), hi * matmul_group_rows), isa);
    });
  };
  if (pool == nullptr || pool->size() == 1 || work < matmul_min_parallel_work) return run(0, off.back());
  pool->parallel_for_dynamic(off.back(), 4, run);
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
  if (int8_matmul(w.type)) return quant_matmul(w, x, batch, y, pool, isa);
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


}  // namespace tandem::cpu
