// Packed (16-row interleaved) q4_K and q5_K weights and their AVX-512 VNNI kernel
// (quant_packed.h). The bits are rows_scalar's (quant_matmul.h's recipe): per super-block the
// exact integers isum = sum_j sc_j s_j and msum = sum_j m_j sum32_j(x), then
// acc = fma(d * dx, isum, acc) and acc = fma(-(dmin * dx), msum, acc), in block order.
//
// Layout of a group (16 rows r0 .. r0 + 15; missing rows are zeros): super-block after
// super-block, each pack_rows * sizeof(block) bytes, every part 64-byte aligned; a vector
// below is 64 bytes whose 32-bit lane r belongs to row r0 + r:
//   0    d: 16 fp16 (row r at bytes 2r), then dmin: 16 fp16;
//   64   the 12 scale bytes as 3 vectors: vector t lane r = row r's scales[4t .. 4t + 3]
//        (the file's 6-bit packing, unchanged; unpacked per group and super-block);
//   256  q5_K only, qh as 8 vectors: vector q lane r = row r's qh[4q .. 4q + 3];
//   then qs as 32 vectors: vector v = 8c + q lane r = row r's qs[4v .. 4v + 3], i.e. the
//        low nibbles of elements 64c + 4q .. + 3 (sub-block 2c) and the high nibbles of
//        elements 64c + 32 + 4q .. + 3 (sub-block 2c + 1).
// 144 (q4_K) or 176 (q5_K) bytes per row per super-block, as in the file, so a decode step
// reads as many bytes, in one sequential stream per group range instead of 16 row streams.
//
// The kernel: per super-block the group's nibbles are decoded once per sub-block (8 vectors,
// the fifth bit or-ed in for q5_K) and reused for B activation rows. Per sub-block j and
// activation row, 8 vpdpbusd (u8 weights x the broadcast 4 activation bytes 32j + 4q .. + 3)
// give s_j exactly for 16 rows; isum += sc_j * s_j (vpmulld); msum is 4 vpdpwssd of the
// (m_2k, m_2k+1) word pairs against the activation's (sum32_2k, sum32_2k+1) pairs; then the
// two fma's for 16 rows at once. No horizontal sums.
//
// Measured against rows_avx512 (Zen 4, one thread, thread CPU time, medians of alternated
// calls, tests/kernels/test_quant_packed_k4.cpp's timing case): q4_K 2048 x 2048 batch 512
// 13.6 ms vs 40.3 (3.0x; q5_K 3.1x); batch 1 from memory 24.5 GB/s vs 13.8 (1.4-1.8x over
// the shapes), batch 4 from memory 3-4.9x.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_K4P __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

template <class Block>
constexpr bool has_qh = requires(const Block& b) {
  b.qh;
};

/// Bytes of one packed super-block of 16 rows, and where its parts start.
template <class Block>
constexpr size_t sb_bytes = size_t(pack_rows) * sizeof(Block);
constexpr size_t off_scales = 64, off_qh = 256;
template <class Block>
constexpr size_t off_qs = has_qh<Block> ? off_qh + 512 : off_qh;

static_assert(off_qs<block_q4_K> + 2048 == sb_bytes<block_q4_K>);
static_assert(off_qs<block_q5_K> + 2048 == sb_bytes<block_q5_K>);

template <class Block>
void pack_group_k4(const tensor_view& w, int64_t r0, uint8_t* dst) {
  const int64_t nb = w.cols() / qk_k;
  std::memset(dst, 0, size_t(nb) * sb_bytes<Block>);
  for (int r = 0; r < pack_rows && r0 + r < w.rows(); ++r) {
    const Block* row = reinterpret_cast<const Block*>(w.row(r0 + r));
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t* s = dst + size_t(i) * sb_bytes<Block>;
      std::memcpy(s + 2 * r, &row[i].d, 2);
      std::memcpy(s + 32 + 2 * r, &row[i].dmin, 2);
      for (int t = 0; t < 3; ++t) std::memcpy(s + off_scales + 64 * t + 4 * r, row[i].scales + 4 * t, 4);
      if constexpr (has_qh<Block>)
        for (int q = 0; q < 8; ++q) std::memcpy(s + off_qh + 64 * q + 4 * r, row[i].qh + 4 * q, 4);
      for (int v = 0; v < 32; ++v) std::memcpy(s + off_qs<Block> + 64 * v + 4 * r, row[i].qs + 4 * v, 4);
    }
  }
}

// In-lane byte shuffles: byte j of each 32-bit lane to the whole lane (zero-extended), and
// bytes 2k, 2k + 1 to the lane's two 16-bit words.
TANDEM_K4P inline __m512i byte_to_lane(int j) {
  auto lane = [&](int d) { return int(0x80808000u | uint32_t(4 * d + j)); };
  return _mm512_set4_epi32(lane(3), lane(2), lane(1), lane(0));
}
TANDEM_K4P inline __m512i bytes_to_words(int k) {
  auto lane = [&](int d) {
    return int(0x80008000u | uint32_t(4 * d + 2 * k + 1) << 16 | uint32_t(4 * d + 2 * k));
  };
  return _mm512_set4_epi32(lane(3), lane(2), lane(1), lane(0));
}

// c ? a : b, bit by bit (vpternlogd's table for operands a, b, c).
constexpr int select_ca_b = 0xE4;

// The 16 rows' scales and mins of one super-block from its 3 transposed scale vectors, as
// bytes: sc[0] lane r = row r's scales 0-3 (byte j = scale j), sc[1] scales 4-7; the same for
// the mins (ggml's get_scale_min_k4: scales and mins 0-3 are the low 6 bits of bytes 0-3 and
// 4-7; 4-7 take their low 4 bits from bytes 8-11 and their top 2 from the top bits of bytes
// 0-3 / 4-7).
TANDEM_K4P inline void scale_bytes(const uint8_t* s, __m512i (&sc)[2]) {
  const __m512i v0 = _mm512_load_si512(s), v2 = _mm512_load_si512(s + 128);
  const __m512i m6 = _mm512_set1_epi8(0x3F);
  sc[0] = _mm512_and_si512(v0, m6);
  sc[1] = _mm512_and_si512(
      _mm512_ternarylogic_epi32(v2, _mm512_srli_epi32(v0, 2), _mm512_set1_epi8(0x0F), select_ca_b), m6);
}
TANDEM_K4P inline void min_bytes(const uint8_t* s, __m512i (&m)[2]) {
  const __m512i v1 = _mm512_load_si512(s + 64), v2 = _mm512_load_si512(s + 128);
  const __m512i m6 = _mm512_set1_epi8(0x3F);
  m[0] = _mm512_and_si512(v1, m6);
  m[1] = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(v2, 4), _mm512_srli_epi32(v1, 2),
                                                    _mm512_set1_epi8(0x0F), select_ca_b),
                          m6);
}

// acc + the 4-byte dot products of w (unsigned) with the 4 bytes at x, broadcast: the
// broadcast folded into vpdpbusd's memory operand, which GCC 12 leaves a separate
// vpbroadcastd (measured 5% faster at batch 512).
TANDEM_K4P inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

TANDEM_K4P inline __m512i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One group x activation rows b0 .. b0 + B - 1: y[b][r0 .. r0 + real - 1]. With `ahead` not
// 0 (batch 1), each super-block requests the bytes `ahead` further on into L2, up to
// fetch_end.
template <class Block, int B>
TANDEM_K4P void tile(const uint8_t* grp, int64_t nb, const quant_acts& a, int64_t b0, float* y, int64_t n,
                     int64_t r0, int real, const uint8_t* fetch_end, int64_t ahead) {
  constexpr size_t sbb = sb_bytes<Block>;
  const int8_t* xs[B];
  const int16_t* ss[B];
  const float* ds[B];
  for (int b = 0; b < B; ++b) xs[b] = a.q(b0 + b), ss[b] = a.sum32(b0 + b), ds[b] = a.scale(b0 + b);
  // In memory: touched once a super-block, its registers go to the isum and nibbles.
  alignas(64) float acc[B][16] = {};
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* s = grp + size_t(i) * sbb;
    if (ahead != 0) prefetch_l2(s + ahead, int64_t(sbb), fetch_end);
    __m512i sc8[2];
    scale_bytes(s + off_scales, sc8);
    __m512i isum[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) isum[b] = _mm512_setzero_si512();
    const __m512i* qv = reinterpret_cast<const __m512i*>(s + off_qs<Block>);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      // Sub-block j: the low (even j) or high (odd j) nibbles of vectors 8 (j / 2) + q.
      __m512i wv[8];
#pragma GCC unroll 8
      for (int q = 0; q < 8; ++q) {
        const __m512i v = _mm512_load_si512(qv + 8 * (j / 2) + q);
        const __m512i nib = j % 2 == 0 ? v : _mm512_srli_epi16(v, 4);
        if constexpr (has_qh<Block>) {
          // Bit j of each qh byte to bit 4 (16-bit shifts: bit 4 of a byte only ever comes
          // from the same byte for these shift counts).
          const __m512i h = _mm512_load_si512(s + off_qh + 64 * q);
          const __m512i at4 = j < 4 ? _mm512_slli_epi16(h, 4 - j) : j == 4 ? h : _mm512_srli_epi16(h, j - 4);
          wv[q] =
              _mm512_ternarylogic_epi32(nib, _mm512_and_si512(at4, _mm512_set1_epi8(0x10)), m4, select_ca_b);
        } else {
          wv[q] = _mm512_and_si512(nib, m4);
        }
      }
      const __m512i sc = _mm512_shuffle_epi8(sc8[j / 4], byte_to_lane(j % 4));
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        const int8_t* x = xs[b] + qk_k * i + 32 * j;
        __m512i sj = dpbusd_bcast(_mm512_setzero_si512(), wv[0], x);
#pragma GCC unroll 8
        for (int q = 1; q < 8; ++q) sj = dpbusd_bcast(sj, wv[q], x + 4 * q);
        isum[b] = _mm512_add_epi32(isum[b], _mm512_mullo_epi32(sj, sc));
        // Keeps the sum in order: GCC otherwise reassociates the 8 products of each row into
        // a tree and holds every s_j until the end (spilled: 5-10% slower).
        asm("" : "+v"(isum[b]));
      }
    }
    // The min pairs (m_2k, m_2k+1) as 16-bit words against the sums' pairs.
    __m512i m8[2], mp[4];
    min_bytes(s + off_scales, m8);
    for (int k = 0; k < 4; ++k) mp[k] = _mm512_shuffle_epi8(m8[k / 2], bytes_to_words(k % 2));
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(s)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(s + 32)));
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int16_t* sums = ss[b] + 8 * i;
      __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mp[0], bcast32(sums));
      for (int k = 1; k < 4; ++k) msum = _mm512_dpwssd_epi32(msum, mp[k], bcast32(sums + 2 * k));
      const __m512 dx = _mm512_set1_ps(ds[b][i]);
      __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum[b]), _mm512_load_ps(acc[b]));
      v = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(msum), v);
      _mm512_store_ps(acc[b], v);
    }
  }
  const __mmask16 lanes = __mmask16((1u << real) - 1);
  for (int b = 0; b < B; ++b) _mm512_mask_storeu_ps(y + (b0 + b) * n + r0, lanes, _mm512_load_ps(acc[b]));
}

// Activation rows a tile: the decoded nibbles of a sub-block (8 vectors) meet this many rows,
// whose isums stay in registers (8 rows measured 5% faster than 4 at batch 512).
constexpr int tile_b = 8;

// One group x `count` (1 .. tile_b) activation rows from b0.
template <class Block>
TANDEM_K4P void run_tile(int64_t count, const uint8_t* grp, int64_t nb, const quant_acts& a, int64_t b0,
                         float* y, int64_t n, int64_t r0, int real, const uint8_t* fetch_end, int64_t ahead) {
  static_assert(tile_b == 8);
  switch (count) {
    case 8:
      return tile<Block, 8>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 7:
      return tile<Block, 7>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 6:
      return tile<Block, 6>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 5:
      return tile<Block, 5>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 4:
      return tile<Block, 4>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 3:
      return tile<Block, 3>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    case 2:
      return tile<Block, 2>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
    default:
      return tile<Block, 1>(grp, nb, a, b0, y, n, r0, real, fetch_end, ahead);
  }
}

template <class Block>
TANDEM_K4P void packed_rows_k4(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  if (g0 >= g1 || a.batch <= 0) return;
  const int64_t nb = p.cols / qk_k, n = p.rows;
  const size_t gbytes = p.group_bytes();
  auto real = [&](int64_t g) { return int(std::min<int64_t>(pack_rows, n - g * pack_rows)); };
  if (a.batch <= tile_b) {
    // Decode (one tile of activation rows): the range is one sequential stream, each weight
    // byte used once. Each super-block requests the bytes `ahead` further on into L2 (up to
    // the weight's end: the thread's next piece follows this one), the first `ahead` bytes up
    // front. 8 KB measured best of 0, 2, 8, 16 and 32 KB at batch 1 (noisy: a shared machine).
    constexpr int64_t ahead = 8 << 10;
    const uint8_t* end = p.bytes.data() + p.bytes.size();
    prefetch_l2(p.group(g0), ahead, end);
    for (int64_t g = g0; g < g1; ++g)
      run_tile<Block>(a.batch, p.group(g), nb, a, 0, y, n, g * pack_rows, real(g), end, ahead);
    return;
  }
  // Prefill: blocks of groups that fit in L2; every tile of activation rows meets every group
  // of the block (each weight byte comes from memory once per call).
  const int64_t block = std::max<int64_t>(1, int64_t(256 << 10) / int64_t(gbytes));
  for (int64_t gb = g0; gb < g1; gb += block) {
    const int64_t ge = std::min(g1, gb + block);
    for (int64_t b = 0; b < a.batch; b += tile_b)
      for (int64_t g = gb; g < ge; ++g)
        run_tile<Block>(std::min<int64_t>(tile_b, a.batch - b), p.group(g), nb, a, b, y, n, g * pack_rows,
                        real(g), nullptr, 0);
  }
}

}  // namespace

void pack_group_q4_K(const tensor_view& w, int64_t r0, uint8_t* dst) {
  pack_group_k4<block_q4_K>(w, r0, dst);
}
void pack_group_q5_K(const tensor_view& w, int64_t r0, uint8_t* dst) {
  pack_group_k4<block_q5_K>(w, r0, dst);
}

void packed_rows_q4_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  packed_rows_k4<block_q4_K>(p, a, y, g0, g1);
}
void packed_rows_q5_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  packed_rows_k4<block_q5_K>(p, a, y, g0, g1);
}

}  // namespace tandem::cpu::quant_detail
