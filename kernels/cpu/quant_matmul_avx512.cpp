// AVX-512 (BW + VNNI) kernels of the low-bit matmul (quant_matmul.h): weights decoded to
// bytes in registers, u8 x s8 pair products (vpmaddubsw), sub-block scales applied by
// vpdpwssd, all exact; the float combination per block as quant_matmul.cpp's scalar code.
#include <cmath>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_Q512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// Lane j of the result: the exact sum of the 16 lanes of A[j] (an add tree; any order gives
// the same integer).
TANDEM_Q512 inline __m256i hsum_epi32_x8(const __m512i* A) {
  __m512i B[4], C[2];
  for (int m = 0; m < 4; ++m)  // lanes 0-7: A[2m] folded to 8, lanes 8-15: A[2m+1]
    B[m] = _mm512_add_epi32(_mm512_shuffle_i64x2(A[2 * m], A[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i64x2(A[2 * m], A[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 2; ++m)  // quarter q: A[4m + q] folded to 4
    C[m] = _mm512_add_epi32(_mm512_shuffle_i64x2(B[2 * m], B[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i64x2(B[2 * m], B[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i E = _mm512_add_epi32(_mm512_unpacklo_epi32(C[0], C[1]), _mm512_unpackhi_epi32(C[0], C[1]));
  // Quarter q, lane 0: sum of A[q]; lane 1: sum of A[4 + q].
  const __m512i F = _mm512_add_epi32(E, _mm512_shuffle_epi32(E, _MM_PERM_BADC));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(idx, F));
}

// isum[j] = sum of the lanes of A[j], j < n.
template <int N>
TANDEM_Q512 inline void hsum_all(const __m512i* A, int32_t* isum) {
  if constexpr (N % 8 == 0) {
    for (int c = 0; c < N / 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(isum + 8 * c), hsum_epi32_x8(A + 8 * c));
  } else {
    for (int j = 0; j < N; ++j) isum[j] = _mm512_reduce_add_epi32(A[j]);
  }
}

// The 8 scales (low 8 bytes) and 8 mins (high 8 bytes) of a q4_K / q5_K block's packed 12.
inline void k4_unpack(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  uint32_t u0, u1, u2;
  __builtin_memcpy(&u0, s, 4);
  __builtin_memcpy(&u1, s + 4, 4);
  __builtin_memcpy(&u2, s + 8, 4);
  const uint32_t sc_lo = u0 & 0x3f3f3f3fu, m_lo = u1 & 0x3f3f3f3fu;
  const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4;
  const uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4;
  sc = uint64_t(sc_lo) | uint64_t(sc_hi) << 32;
  m = uint64_t(m_lo) | uint64_t(m_hi) << 32;
}

// Per-row state of one super-block and the bytes of chunk c (elements 64c .. 64c + 63) with
// their int16 scale vector (one scale per pair of bytes after vpmaddubsw).
template <ggml_type T>
struct kblock;

template <>
struct kblock<ggml_type::q4_K> {
  using block = block_q4_K;
  static constexpr bool offset32 = false;
  const block* b;
  __m512i sc;   // 8 int16 scales in lanes 0-7
  uint64_t m8;  // the 8 mins
  TANDEM_Q512 void load(const block* p) {
    b = p;
    uint64_t s8;
    k4_unpack(p->scales, s8, m8);
    sc = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(s8))));
  }
  TANDEM_Q512 __m512i bytes(int c) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * c));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  }
  // Lanes 0-15: sub-block 2c, 16-31: 2c + 1.
  TANDEM_Q512 __m512i scales(int c) const {
    const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16(short(2 * c)), _mm256_set1_epi16(short(2 * c + 1)), 1);
    return _mm512_permutexvar_epi16(idx, sc);
  }
};

// q5_K: q4_K's nibbles and scales plus the fifth bits.
template <>
struct kblock<ggml_type::q5_K> {
  using block = block_q5_K;
  static constexpr bool offset32 = false;
  const block* b;
  __m512i sc;
  uint64_t m8;
  TANDEM_Q512 void load(const block* p) {
    b = p;
    uint64_t s8;
    k4_unpack(p->scales, s8, m8);
    sc = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(s8))));
  }
  TANDEM_Q512 __m512i bytes(int c) const {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * c));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    const __m512i low = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
    // Fifth bits: bit 2c of qh[l] for the low half, bit 2c + 1 for the high half.
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh)));
    const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi8(char(1 << (2 * c))), _mm256_set1_epi8(char(2 << (2 * c))), 1);
    return _mm512_or_si512(low, _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, sel), _mm512_set1_epi8(16)));
  }
  TANDEM_Q512 __m512i scales(int c) const {
    const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16(short(2 * c)), _mm256_set1_epi16(short(2 * c + 1)), 1);
    return _mm512_permutexvar_epi16(idx, sc);
  }
};

template <>
struct kblock<ggml_type::q6_K> {
  using block = block_q6_K;
  static constexpr bool offset32 = true;
  const block* b;
  __m512i sc;  // 16 int16 scales in lanes 0-15
  uint64_t m8 = 0;
  TANDEM_Q512 void load(const block* p) {
    b = p;
    sc = _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p->scales))));
  }
  TANDEM_Q512 __m512i bytes(int c) const {
    const int h = c / 2;
    const __m512i L = _mm512_loadu_si512(b->ql + 64 * h);
    const __m512i low = _mm512_and_si512(c % 2 == 0 ? L : _mm512_srli_epi16(L, 4), _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h)));
    // Top two bits: qh bits 0-1 / 2-3 (even c) or 4-5 / 6-7 (odd c) for the two halves, moved
    // to bits 4-5 by one shift per half (left 4 / 2, or right 0 / 2).
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(short(c % 2 == 0 ? 4 : 0)), _mm256_set1_epi16(2), 1);
    const __m512i moved = c % 2 == 0 ? _mm512_sllv_epi16(qh, shift) : _mm512_srlv_epi16(qh, shift);
    return _mm512_or_si512(low, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  }
  // Lane i (bytes 2i, 2i + 1 of the chunk): sub-block 4c + i / 8.
  TANDEM_Q512 __m512i scales(int c) const {
    const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(short(4 * c)),
                                         _mm512_setr_epi32(0, 0, 0, 0, 0x00010001, 0x00010001, 0x00010001, 0x00010001,
                                                           0x00020002, 0x00020002, 0x00020002, 0x00020002,
                                                           0x00030003, 0x00030003, 0x00030003, 0x00030003));
    return _mm512_permutexvar_epi16(idx, sc);
  }
};

// R weight rows x B activation rows of a k-quant weight.
template <ggml_type T, int R, int B, bool Fetch>
TANDEM_Q512 void tile_k(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  using K = kblock<T>;
  using block = typename K::block;
  const int64_t nb = w.cols() / qk_k, n = w.rows();
  const block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const block*>(w.row(r0 + r));
  float acc[R][B] = {};
  // Batch 1: the next tile's rows start R rows further on; request each block of them one
  // tile ahead (rows of a few blocks are too short for the hardware prefetcher to find),
  // into L2 (see kernels/cpu/matmul.cpp's tile_avx512: T0 requests held L1's few miss
  // buffers). Not from the range's last tile (Fetch false): what follows is not ours.
  const int64_t ahead = Fetch && B == 1 && R > 1 ? (reinterpret_cast<const char*>(rows[1]) - reinterpret_cast<const char*>(rows[0])) * R : 0;
  for (int64_t i = 0; i < nb; ++i) {
    K kb[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (ahead != 0) {
        const char* next = reinterpret_cast<const char*>(rows[r] + i) + ahead;
        for (size_t o = 0; o < sizeof(block); o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        _mm_prefetch(next + sizeof(block) - 1, _MM_HINT_T1);
      }
      kb[r].load(rows[r] + i);
    }
    __m512i isum_v[R * B];
#pragma GCC unroll 16
    for (int j = 0; j < R * B; ++j) isum_v[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i xv[B], xo[B];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        xv[b] = _mm512_loadu_si512(a.q(b0 + b) + qk_k * i + 64 * c);
        if constexpr (K::offset32) xo[b] = _mm512_maddubs_epi16(_mm512_set1_epi8(32), xv[b]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i wv = kb[r].bytes(c), sv = kb[r].scales(c);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) {
          __m512i p = _mm512_maddubs_epi16(wv, xv[b]);
          if constexpr (K::offset32) p = _mm512_sub_epi16(p, xo[b]);
          isum_v[b * R + r] = _mm512_dpwssd_epi32(isum_v[b * R + r], p, sv);
        }
      }
    }
    alignas(32) int32_t isum[R * B];
    hsum_all<R * B>(isum_v, isum);
    if constexpr (K::offset32) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d = _cvtsh_ss(rows[r][i].d);
        for (int b = 0; b < B; ++b) acc[r][b] = std::fma(d * a.scale(b0 + b)[i], float(isum[b * R + r]), acc[r][b]);
      }
    } else {
      // msum of every (row, activation row): 4 rows' mins a vector (row 4z + q in 128-bit lane
      // q of M[z]), times the activation row's 8 sums repeated in each lane, summed per lane.
      constexpr int MZ = (R + 3) / 4;
      __m512i M[MZ];
#pragma GCC unroll 2
      for (int z = 0; z < MZ; ++z) {
        uint64_t m[4] = {};
        for (int q = 0; q < 4 && 4 * z + q < R; ++q) m[q] = kb[4 * z + q].m8;
        M[z] = _mm512_cvtepu8_epi16(_mm256_set_epi64x(int64_t(m[3]), int64_t(m[2]), int64_t(m[1]), int64_t(m[0])));
      }
      alignas(64) int32_t msum[B][MZ * 16];
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const __m512i S = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.sum32(b0 + b) + 8 * i)));
#pragma GCC unroll 2
        for (int z = 0; z < MZ; ++z) {
          __m512i v = _mm512_madd_epi16(M[z], S);
          v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
          v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));  // lane 4q: row 4z + q
          _mm512_store_si512(msum[b] + 16 * z, v);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d = _cvtsh_ss(rows[r][i].d), dmin = _cvtsh_ss(rows[r][i].dmin);
        for (int b = 0; b < B; ++b) {
          const float dx = a.scale(b0 + b)[i];
          acc[r][b] = std::fma(d * dx, float(isum[b * R + r]), acc[r][b]);
          acc[r][b] = std::fma(-(dmin * dx), float(msum[b][16 * (r / 4) + 4 * (r % 4)]), acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[(b0 + b) * n + r0 + r] = acc[r][b];
}

TANDEM_Q512 inline float hsum16(__m512 s) {
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// q8_0 as a policy of the tile below: a pair of blocks' weights as 64 unsigned bytes u = w + c,
// whose VNNI dot product (vpdpbusd, u8 x s8, each 4 summed in int32) with x, started from -c
// times each 4 x's sum (quant_acts' offsets), is the exact sum of w x: one instruction per
// (weight row, activation row) and 64 elements. (q4_0 runs the packed kernel instead,
// kernels/cpu/quant_packed_q4_0.cpp: its recipe has one integer sum per block.)
//
// q8_0: codes -128..127 flipped in their top bit are w + 128 (c = 128).
struct q8_0_blocks {
  using block = block_q8_0;
  static constexpr int64_t elems = q8_0_block;
  static const int32_t* offsets(const quant_acts& a, int64_t b) { return a.offset128(b); }
  TANDEM_Q512 static __m512i load(const block* p, bool pair) {
    const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[0].qs));
    const __m256i q1 = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[1].qs)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), _mm512_set1_epi8(char(0x80)));
  }
};

// The pair's weight scales: block i's in lanes 0-7, block i + 1's (or 0) in lanes 8-15.
template <class Block>
TANDEM_Q512 inline __m512 pair_scales(const Block* p, bool pair) {
  uint16_t d0, d1 = 0;
  __builtin_memcpy(&d0, &p[0].d, 2);
  if (pair) __builtin_memcpy(&d1, &p[1].d, 2);
  const __m128 two = _mm_cvtph_ps(_mm_cvtsi32_si128(int(uint32_t(d0) | uint32_t(d1) << 16)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                               _mm512_castps128_ps512(two));
}

// One step of tile_blocks: blocks i and i + 1 (Pair) or block i alone of R weight rows x B
// activation rows, into acc. Per (weight row, activation row) and 64 elements this is four
// vector ops (dpbusd, conversion, scale multiply, fma), and the 4 x 4 tile runs at the
// measured peak FMA instruction rate, so only fewer vector ops make it faster. Measured (Zen 5
// EPYC, 1 thread, 2048 x 2048 q4_0, batch 512, side by side) and not taken:
// - one multiply per weight row for all B scale products, each picked by an in-lane permute
//   (the same bits): 5% slower, the permute costs what the multiply did;
// - an integer sum per 32-value block (eight dpbusd per 16 blocks, tree-reduced to one lane
//   per block, then one conversion, multiply and fma per 16 blocks: a new rounding recipe):
//   0.4x, the reduction's shuffles and adds cost more than the multiplies they replace.
template <class P, int R, int B, bool Pair>
TANDEM_Q512 __attribute__((always_inline)) inline void blocks_step(const typename P::block* const* rows,
                                                                   const int8_t* const* xs, const int32_t* const* offs,
                                                                   const float* const* dxs, int64_t i, int64_t ahead,
                                                                   __m512 (&acc)[R][B]) {
  const __mmask16 lanes = Pair ? 0xFFFF : 0x00FF;
  __m512i xv[B];
  __m512 dx[B];
#pragma GCC unroll 4
  for (int b = 0; b < B; ++b) {
    const int8_t* x = xs[b] + P::elems * i;
    xv[b] = Pair ? _mm512_loadu_si512(x) : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    dx[b] = _mm512_load_ps(dxs[b] + 8 * i);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const typename P::block* p = rows[r] + i;
    if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(p) + ahead, _MM_HINT_T1);
    const __m512i wu = P::load(p, Pair);
    const __m512 dw = pair_scales(p, Pair);
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) {
      const __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(offs[b] + 8 * i), wu, xv[b]);
      acc[r][b] = _mm512_mask3_fmadd_ps(_mm512_mul_ps(dw, dx[b]), _mm512_cvtepi32_ps(s), acc[r][b], lanes);
    }
  }
}

// R weight rows x B activation rows of a 32-element block type: two blocks (64 elements) a
// step, the pair's scales in the low and high 8 lanes; the lanes of an odd last block are
// left alone (masked).
template <class P, int R, int B, bool Fetch>
TANDEM_Q512 void tile_blocks(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  using block = typename P::block;
  const int64_t nb = w.cols() / P::elems, n = w.rows();
  const block* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = reinterpret_cast<const block*>(w.row(r0 + r));
  const int8_t* xs[B];
  const int32_t* offs[B];
  const float* dxs[B];
  for (int b = 0; b < B; ++b) xs[b] = a.q(b0 + b), offs[b] = P::offsets(a, b0 + b), dxs[b] = a.scale16(b0 + b);
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  // Batch 1: request the next tile's rows one tile ahead (see tile_k), a line per block pair.
  const int64_t ahead = Fetch && B == 1 && R > 1 ? (reinterpret_cast<const char*>(rows[1]) - reinterpret_cast<const char*>(rows[0])) * R : 0;
  for (int64_t i = 0; i + 1 < nb; i += 2) blocks_step<P, R, B, true>(rows, xs, offs, dxs, i, ahead, acc);
  if (nb % 2 != 0) blocks_step<P, R, B, false>(rows, xs, offs, dxs, nb - 1, ahead, acc);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) y[(b0 + b) * n + r0 + r] = hsum16(acc[r][b]);
}

// Batch 1 of q8_0: N weight rows r[j] (anywhere) as tile_blocks<P, N, 1> would give them,
// bit for bit, with no software prefetch: each is one sequential stream.
template <class P, int N>
TANDEM_Q512 void dotn_blocks(const tensor_view& w, const quant_acts& a, float* y, const int64_t (&r)[N]) {
  using block = typename P::block;
  const int64_t nb = w.cols() / P::elems;
  const block* rows[N];
  __m512 acc[N][1];
  for (int j = 0; j < N; ++j) rows[j] = reinterpret_cast<const block*>(w.row(r[j])), acc[j][0] = _mm512_setzero_ps();
  const int8_t* xs[1] = {a.q(0)};
  const int32_t* offs[1] = {P::offsets(a, 0)};
  const float* dxs[1] = {a.scale16(0)};
  for (int64_t i = 0; i + 1 < nb; i += 2) blocks_step<P, N, 1, true>(rows, xs, offs, dxs, i, 0, acc);
  if (nb % 2 != 0) blocks_step<P, N, 1, false>(rows, xs, offs, dxs, nb - 1, 0, acc);
  for (int j = 0; j < N; ++j) y[r[j]] = hsum16(acc[j][0]);
}

template <ggml_type T, int R, int B, bool Fetch = true>
TANDEM_Q512 void tile(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t b0) {
  if constexpr (T == ggml_type::q8_0) tile_blocks<q8_0_blocks, R, B, Fetch>(w, a, y, r0, b0);
  else tile_k<T, R, B, Fetch>(w, a, y, r0, b0);
}

template <ggml_type T>
void rows_typed(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  if constexpr (T == ggml_type::q8_0) {
    // Batch 1 in for_row_streams' order (ops.h). Measured against 8 rows side by side with
    // software prefetch, 2 threads, 48 weights of 8192 x 2048 in rotation, side by side
    // (Zen 5): 39-44 -> 45-52 GB/s with two rows at a time; four keep twice the chains going
    // (512 x 2048 in cache, one thread: 50 -> 63 GB/s).
    if (a.batch == 1) {
      int64_t r = for_row_streams<batch1_streams>(r0, r1, [&](const int64_t (&rr)[batch1_streams]) {
        dotn_blocks<q8_0_blocks, batch1_streams>(w, a, y, rr);
      });
      for (; r < r1; ++r) tile<T, 1, 1>(w, a, y, r, 0);
      return;
    }
  }
  // Batch 1 (the k-quants left unpacked): the range's first tile requested at once up front
  // (each tile fetches the next).
  if (a.batch == 1)
    for (const uint8_t* p = w.row(r0); p < w.row(std::min(r1, r0 + 8)); p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  for_tiles<8, 4, 4>(int64_t(row_bytes(w.type, w.cols())), a.batch, r0, r1,
                     [&](int64_t r, int rows, int64_t b, int64_t count) {
                       if (rows == 8 && r + 16 > r1) return tile<T, 8, 1, false>(w, a, y, r, b);
                       if (rows == 8) return tile<T, 8, 1>(w, a, y, r, b);
                       if (rows == 1) return tile<T, 1, 1>(w, a, y, r, b);
                       switch (count) {
                         case 4: return tile<T, 4, 4>(w, a, y, r, b);
                         case 3: return tile<T, 4, 3>(w, a, y, r, b);
                         case 2: return tile<T, 4, 2>(w, a, y, r, b);
                         default: return tile<T, 4, 1>(w, a, y, r, b);
                       }
                     });
}

}  // namespace

void rows_avx512(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  switch (w.type) {
    // An unpacked q4_0 weight is packed a few groups at a time as it goes (the same bits).
    case ggml_type::q4_0: return rows_q4_0_repacked(w, a, y, r0, r1);
    case ggml_type::q8_0: return rows_typed<ggml_type::q8_0>(w, a, y, r0, r1);
    case ggml_type::q4_K: return rows_typed<ggml_type::q4_K>(w, a, y, r0, r1);
    case ggml_type::q5_K: return rows_typed<ggml_type::q5_K>(w, a, y, r0, r1);
    default: return rows_typed<ggml_type::q6_K>(w, a, y, r0, r1);
  }
}

}  // namespace tandem::cpu::quant_detail
