// AVX2 kernels of the low-bit matmul (quant_matmul.h): the avx512 scheme in 32-byte steps
// (vpmaddubsw, then vpmaddwd by the sub-block scales), the same exact integers, the same
// float combination per block.
#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_Q256 __attribute__((target("avx2,fma,f16c")))

TANDEM_Q256 inline int32_t hsum_epi32(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(h);
}

// sc (low 8 bytes) and m (high 8 bytes) of a q4_K / q5_K block's packed 12 (see tensor.h).
inline void k4_unpack(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint32_t u0, u1, u2;
  __builtin_memcpy(&u0, s, 4);
  __builtin_memcpy(&u1, s + 4, 4);
  __builtin_memcpy(&u2, s + 8, 4);
  const uint32_t v[4] = {u0 & 0x3f3f3f3fu, (u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4, u1 & 0x3f3f3f3fu,
                         ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4};
  __builtin_memcpy(sc, v, 8);
  __builtin_memcpy(m, v + 2, 8);
}

// Bytes and int16 scale vector of 32-element chunk c (0..7) of one row's super-block.
template <ggml_type T>
struct kblock;

template <>
struct kblock<ggml_type::q4_K> {
  using block = block_q4_K;
  static constexpr bool offset32 = false;
  const block* b;
  uint8_t sc[8], m[8];
  void load(const block* p) {
    b = p;
    k4_unpack(p->scales, sc, m);
  }
  TANDEM_Q256 __m256i bytes(int c) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * (c / 2)));
    return _mm256_and_si256(c % 2 == 0 ? q : _mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
  }
  TANDEM_Q256 __m256i scales(int c) const { return _mm256_set1_epi16(sc[c]); }
};

template <>
struct kblock<ggml_type::q5_K> {
  using block = block_q5_K;
  static constexpr bool offset32 = false;
  const block* b;
  uint8_t sc[8], m[8];
  void load(const block* p) {
    b = p;
    k4_unpack(p->scales, sc, m);
  }
  TANDEM_Q256 __m256i bytes(int c) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * (c / 2)));
    const __m256i low = _mm256_and_si256(c % 2 == 0 ? q : _mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh));
    // Bit c of each qh byte, moved to bit 4 (shifts within 16-bit lanes, masked per byte).
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(c)), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(bit, 4));
  }
  TANDEM_Q256 __m256i scales(int c) const { return _mm256_set1_epi16(sc[c]); }
};

template <>
struct kblock<ggml_type::q6_K> {
  using block = block_q6_K;
  static constexpr bool offset32 = true;
  const block* b;
  uint8_t m[8] = {};
  void load(const block* p) { b = p; }
  // Chunk c: elements 128 h + 32 k + l (h = c / 4, k = c % 4).
  TANDEM_Q256 __m256i bytes(int c) const {
    const int h = c / 4, k = c % 4;
    const __m256i L = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->ql + 64 * h + 32 * (k % 2)));
    const __m256i low = _mm256_and_si256(k < 2 ? L : _mm256_srli_epi16(L, 4), _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h));
    const __m256i high = _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), 4),
                                          _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  }
  // Lanes 0-7: sub-block 2c, 8-15: 2c + 1.
  TANDEM_Q256 __m256i scales(int c) const {
    return _mm256_set_m128i(_mm_set1_epi16(b->scales[2 * c + 1]), _mm_set1_epi16(b->scales[2 * c]));
  }
};

template <ggml_type T, int R, int B>
TANDEM_Q256 void tile_k(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  using K = kblock<T>;
  using block = typename K::block;
  const int64_t nb = w.cols() / qk_k, n = w.rows();
  const block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const block*>(w.row(r0 + r));
  float acc[R][B] = {};
  // Batch 1: request the next tile's rows one tile ahead (as the avx512 kernels).
  const int64_t ahead = B == 1 && R > 1 ? (reinterpret_cast<const char*>(rows[1]) - reinterpret_cast<const char*>(rows[0])) * R : 0;
  for (int64_t i = 0; i < nb; ++i) {
    K kb[R];
    for (int r = 0; r < R; ++r) {
      if (ahead != 0) {
        const char* next = reinterpret_cast<const char*>(rows[r] + i) + ahead;
        for (size_t o = 0; o < sizeof(block); o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
        _mm_prefetch(next + sizeof(block) - 1, _MM_HINT_T0);
      }
      kb[r].load(rows[r] + i);
    }
    __m256i isum_v[R][B];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) isum_v[r][b] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i xv[B], xo[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        xv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(b0 + b) + qk_k * i + 32 * c));
        if constexpr (K::offset32) xo[b] = _mm256_maddubs_epi16(_mm256_set1_epi8(32), xv[b]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i wv = kb[r].bytes(c), sv = kb[r].scales(c);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) {
          __m256i p = _mm256_maddubs_epi16(wv, xv[b]);
          if constexpr (K::offset32) p = _mm256_sub_epi16(p, xo[b]);
          isum_v[r][b] = _mm256_add_epi32(isum_v[r][b], _mm256_madd_epi16(p, sv));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = _cvtsh_ss(rows[r][i].d);
      for (int b = 0; b < B; ++b) {
        const float dx = a.scale(b0 + b)[i];
        acc[r][b] = std::fma(d * dx, float(hsum_epi32(isum_v[r][b])), acc[r][b]);
        if constexpr (!K::offset32) {
          const __m128i m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kb[r].m)));
          const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32(b0 + b) + 8 * i));
          __m128i v = _mm_madd_epi16(m16, s);
          v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
          v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
          const float dmin = _cvtsh_ss(rows[r][i].dmin);
          acc[r][b] = std::fma(-(dmin * dx), float(_mm_cvtsi128_si32(v)), acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[(b0 + b) * n + r0 + r] = acc[r][b];
}

// q8_0's 16-lane tree over even-block lanes `lo` (0-7) and odd-block lanes `hi` (8-15):
// lane i + lane i + 8, then the halves of what is left.
TANDEM_Q256 inline float tree16_pair(__m256 lo, __m256 hi) {
  const __m256 v = _mm256_add_ps(lo, hi);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// q8_0 as a policy of the tile below: what an activation register needs besides its bytes,
// how a block's weights load, and the exact int32 dot products of 4-element groups.
//
// q8_0: |w| times x with w's sign (maddubs takes an unsigned and a signed operand; |w| <= 128
// and |x| <= 127 keep each pair sum inside int16).
struct q8_0_blocks {
  using block = block_q8_0;
  static constexpr int64_t elems = q8_0_block;
  static constexpr int64_t prefetch_every = 1;
  struct x_reg {
    __m256i v;
  };
  TANDEM_Q256 static x_reg prep(__m256i xv) { return {xv}; }
  struct w_reg {
    __m256i v, abs;
  };
  TANDEM_Q256 static w_reg load(const block& p) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qs));
    return {wv, _mm256_sign_epi8(wv, wv)};
  }
  TANDEM_Q256 static __m256i dot(const w_reg& w, const x_reg& x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x.v, w.v)), _mm256_set1_epi16(1));
  }
};

// R weight rows x B activation rows of q8_0, one block a step; even blocks
// in acc[..][0] (lanes 0-7 of the recipe), odd in [1].
template <class P, int R, int B>
TANDEM_Q256 void tile_blocks(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  using block = typename P::block;
  const int64_t nb = w.cols() / P::elems, n = w.rows();
  const block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const block*>(w.row(r0 + r));
  __m256 acc[R][B][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b][0] = acc[r][b][1] = _mm256_setzero_ps();
  const int64_t ahead = B == 1 && R > 1 ? (reinterpret_cast<const char*>(rows[1]) - reinterpret_cast<const char*>(rows[0])) * R : 0;
  for (int64_t i = 0; i < nb; ++i) {
    const int half = int(i % 2);
    typename P::x_reg xr[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b)
      xr[b] = P::prep(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(b0 + b) + P::elems * i)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (ahead != 0 && i % P::prefetch_every == 0)
        _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i) + ahead, _MM_HINT_T0);
      const typename P::w_reg wr = P::load(rows[r][i]);
      const float dw = _cvtsh_ss(rows[r][i].d);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const __m256 dd = _mm256_set1_ps(dw * a.scale(b0 + b)[i]);
        acc[r][b][half] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(P::dot(wr, xr[b])), acc[r][b][half]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[(b0 + b) * n + r0 + r] = tree16_pair(acc[r][b][0], acc[r][b][1]);
}

// Lane j: the sum of the 8 lanes of v[j] (exact, in any order).
TANDEM_Q256 inline __m256i hsum_epi32_x8(const __m256i* v) {
  const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}

// q4_0 (R x B <= 8): per block, the exact int sum s of (q - 8) x for every (weight row,
// activation row), the 8 sums reduced together, then acc = fma(d * dx, s, acc) as the recipe.
// Nibbles w in 0..15 stand for w - 8: maddubs(w, x) - maddubs(8, x) is the signed product.
template <int R, int B>
TANDEM_Q256 void tile_q4_0(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  static_assert(R * B <= 8);
  const int64_t nb = w.cols() / q4_0_block, n = w.rows();
  const block_q4_0* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const block_q4_0*>(w.row(r0 + r));
  float acc[R][B] = {};
  const int64_t ahead = B == 1 && R > 1 ? (reinterpret_cast<const char*>(rows[1]) - reinterpret_cast<const char*>(rows[0])) * R : 0;
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i) {
    __m256i xv[B], xo[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      xv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q(b0 + b) + q4_0_block * i));
      xo[b] = _mm256_maddubs_epi16(_mm256_set1_epi8(8), xv[b]);
    }
    __m256i v[8];
#pragma GCC unroll 8
    for (int j = R * B; j < 8; ++j) v[j] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (ahead != 0 && i % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i) + ahead, _MM_HINT_T0);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r][i].qs));
      const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), mask);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b)
        v[b * R + r] = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(wv, xv[b]), xo[b]), ones);
    }
    alignas(32) int32_t s[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s), hsum_epi32_x8(v));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float dw = _cvtsh_ss(rows[r][i].d);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[r][b] = std::fma(dw * a.scale(b0 + b)[i], float(s[b * R + r]), acc[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[(b0 + b) * n + r0 + r] = acc[r][b];
}

template <ggml_type T, int R, int B>
TANDEM_Q256 void tile(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  if constexpr (T == ggml_type::q4_0) tile_q4_0<R, B>(w, a, y, r0, b0);
  else if constexpr (T == ggml_type::q8_0) tile_blocks<q8_0_blocks, R, B>(w, a, y, r0, b0);
  else tile_k<T, R, B>(w, a, y, r0, b0);
}

// Batch 1: 4 rows side by side; larger batches 2 rows x up to 4 activation rows (16 registers).
template <ggml_type T>
void rows_typed(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  for_tiles<4, 2, 4>(int64_t(row_bytes(w.type, w.cols())), a.batch, r0, r1,
                     [&](int64_t r, int rows, int64_t b, int64_t count) {
                       if (rows == 4) return tile<T, 4, 1>(w, a, y, r, b);
                       if (rows == 1) return tile<T, 1, 1>(w, a, y, r, b);
                       switch (count) {
                         case 4: return tile<T, 2, 4>(w, a, y, r, b);
                         case 3: return tile<T, 2, 3>(w, a, y, r, b);
                         case 2: return tile<T, 2, 2>(w, a, y, r, b);
                         default: return tile<T, 2, 1>(w, a, y, r, b);
                       }
                     });
}

}  // namespace

void rows_avx2(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  switch (w.type) {
    case ggml_type::q4_0: return rows_typed<ggml_type::q4_0>(w, a, y, r0, r1);
    case ggml_type::q8_0: return rows_typed<ggml_type::q8_0>(w, a, y, r0, r1);
    case ggml_type::q4_K: return rows_typed<ggml_type::q4_K>(w, a, y, r0, r1);
    case ggml_type::q5_K: return rows_typed<ggml_type::q5_K>(w, a, y, r0, r1);
    default: return rows_typed<ggml_type::q6_K>(w, a, y, r0, r1);
  }
}

}  // namespace tandem::cpu::quant_detail
