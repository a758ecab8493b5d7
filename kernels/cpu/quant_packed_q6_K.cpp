// q6_K in 16-row interleaved groups (kernels/cpu/quant_packed.h) and its AVX-512 VNNI kernel.
//
// Layout of a group of nb super-blocks per row (16 x 210 bytes per super-block, as the file),
// super-block after super-block (3360 bytes each, so a batch-1 step reads one sequential stream;
// measured against all codes then all scales and d's, 2 threads, 48 weights of 8192 x 2048 in
// rotation, side by side (Zen 5): 38-45 -> 43-52 GB/s):
//   codes, 3072 bytes: sub-block j (16 elements) is 3 vectors of 64 bytes, P, Q, R, at 192 j;
//     byte t of 32-bit lane r is row r's element 16 j + t (P), 16 j + 4 + t (Q), 16 j + 8 + t
//     (R) in bits 0-5 (the unsigned 6-bit code, 0..63), and bits 6-7 of P, Q, R hold bits 0-1,
//     2-3, 4-5 of element 16 j + 12 + t's code;
//   scales, 256 bytes: row r's scale j at 16 j + r; d, 32 bytes: row r's at 2 r.
//   A super-block starting on a 64-byte boundary holds scales, codes, d; one starting 32 past
//   one (every other, as 3360 = 52.5 lines) holds d, scales, codes: the codes start on a
//   64-byte boundary so that no load splits a line. Which is decided by the address, so a
//   group must be read where it was packed, or at an address equal to it mod 64 (a
//   quant_packed's bytes always are).
//
// Per sub-block j and activation row: u = -32 sum(x) (a table made per call) plus 4 vpdpbusd,
// each the 16 rows' 4 codes (u8) against one broadcast group of 4 activation bytes (s8), is
// the exact sum of (q - 32) x of the 16 rows; isum += sc_j u (vpmulld with the 16 rows' scales
// widened to int32). Per super-block: one conversion and one fma by the 16 rows' d times the
// activation's dx: quant_matmul.h's recipe, lane by lane. The codes are decoded once per
// super-block and group for every activation row of a tile: 3 ands for P, Q, R; the fourth
// vector's bits gathered by 3 shifts, 2 bit selects and an and. Measured (Zen 4 EPYC, 1
// thread, side by side) and not taken: gathering them by 3 GFNI affine byte maps and an or
// (4 ops instead of 6): 0-20% slower at batch 1 from L3, alike at batch 512 (on Zen 4 the
// affine maps seem to share vpdpbusd's and vpmulld's pipes).
#include <algorithm>
#include <cstring>

#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_Q6P __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int64_t codes_bytes = 3072;  // per super-block of a group
constexpr int64_t sub_bytes = 192;     // per sub-block of a group
constexpr int64_t scale_bytes = 256;   // per super-block of a group
constexpr int64_t d_bytes = 32;        // per super-block of a group
constexpr int64_t meta_bytes = scale_bytes + d_bytes;
constexpr int64_t super_bytes = codes_bytes + meta_bytes;  // per super-block of a group
// Batch 1's software prefetch distance. A group is one stream, which the hardware prefetcher
// alone kept about 10% behind the row-major kernel from memory; measured (1 thread, 8 weights
// of 8192 x 2048 in rotation, side by side): 32 to 256 KB ahead into L2 alike, 16 KB 5-10%
// slower, into L1 (T0) 15-20% slower. The first fetch_ahead bytes of a call are left to the
// hardware: requesting them up front cost a call of one group (2048 columns) 40%, of 4 groups
// 20%, from L3. (Measured while every line was requested; each step now kicks page starts.)
constexpr int64_t fetch_ahead = int64_t(64) << 10;

// Byte offsets inside one group at address `base` (a multiple of 32: a quant_packed's groups
// are). Super-block i is 3360 bytes at 3360 i: scales, codes, d where it starts on a 64-byte
// boundary, else d, scales, codes, so that its codes always do.
struct q6_layout {
  int64_t nb = 0;
  uintptr_t base_odd = 0;  // 1 where base is 32 past a 64-byte boundary
  q6_layout(const uint8_t* base, int64_t cols) : nb(cols / qk_k), base_odd((reinterpret_cast<uintptr_t>(base) >> 5) & 1) {}
  bool shifted(int64_t i) const { return ((base_odd + uintptr_t(i)) & 1) != 0; }
  int64_t codes(int64_t i) const { return i * super_bytes + (shifted(i) ? d_bytes + scale_bytes : scale_bytes); }
  int64_t scales(int64_t i) const { return i * super_bytes + (shifted(i) ? d_bytes : 0); }
  int64_t d(int64_t i) const { return i * super_bytes + (shifted(i) ? 0 : scale_bytes + codes_bytes); }
};

// The unsigned 6-bit code of element e of a q6_K block (dequantize_row_q6_K's bits).
inline int code_of(const block_q6_K& b, int e) {
  const int h = e / 128, r = e % 128, l = r % 32, k = r / 32;
  const uint8_t lo = b.ql[64 * h + 32 * (k % 2) + l];
  return (k < 2 ? lo & 0xF : lo >> 4) | ((b.qh[32 * h + l] >> (2 * k)) & 3) << 4;
}

// The 4 code vectors of one sub-block (elements 16 j + 4 v + t, v = 0..3) from its 192 bytes.
TANDEM_Q6P __attribute__((always_inline)) inline void decode(const uint8_t* q, __m512i (&w)[4]) {
  const __m512i P = _mm512_loadu_si512(q), Q = _mm512_loadu_si512(q + 64), R = _mm512_loadu_si512(q + 128);
  const __m512i low6 = _mm512_set1_epi8(0x3F);
  w[0] = _mm512_and_si512(P, low6);
  w[1] = _mm512_and_si512(Q, low6);
  w[2] = _mm512_and_si512(R, low6);
  // 16-bit shifts move bits 6-7 of each byte of P, Q, R to 0-1, 2-3, 4-5 (the neighbour byte's
  // bits land elsewhere); two bit selects (0xCA: first ? second : third) and an and.
  const __m512i t = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x03), _mm512_srli_epi16(P, 6),
                                              _mm512_srli_epi16(Q, 4), 0xCA);
  w[3] = _mm512_and_si512(_mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), t, _mm512_srli_epi16(R, 2), 0xCA), low6);
}

// One group (16 rows) x B activation rows from b0: y[b][r] for the rows whose bit is set in
// `valid` (y points at the group's first row of activation row 0; n is its stride). `off` is
// [batch][k / 16] of -32 times each sub-block's activation sum. Fetch (batch 1): the bytes
// fetch_ahead further on, up to `end` (the weight's), requested into L2 as they are reached.
template <int B, bool Fetch>
TANDEM_Q6P void group_tile(const uint8_t* g, int64_t cols, const quant_acts& a, const int32_t* off, int64_t b0,
                           float* y, int64_t n, __mmask16 valid, const char* end) {
  const q6_layout lay(g, cols);
  const int64_t nb = lay.nb, k16 = cols / 16;
  __m512 acc[B];
  // Each activation row's values, scales and sub-block sums found once (as the q4_0 kernel).
  const int8_t* xs[B];
  const float* ds[B];
  const int32_t* os[B];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) {
    acc[b] = _mm512_setzero_ps();
    xs[b] = a.q(b0 + b), ds[b] = a.scale(b0 + b), os[b] = off + (b0 + b) * k16;
  }
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* q = g + lay.codes(i);
    const int8_t* sc = reinterpret_cast<const int8_t*>(g + lay.scales(i));
    if constexpr (Fetch) {
      // Each super-block kicks the page its span (3360 bytes) fetch_ahead further on reaches:
      // its every line requested, a llama-1b q6_K decode step ran 53-55 tokens/s, page starts
      // 61-63 (2 threads, alternating runs).
      const char* next = reinterpret_cast<const char*>(g + i * super_bytes) + fetch_ahead;
      kick_page(next, super_bytes, end);
    }
    __m512i isum[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) isum[b] = _mm512_setzero_si512();
    for (int j = 0; j < 16; ++j) {
      __m512i w[4];
      decode(q + sub_bytes * j, w);
      const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * j)));
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) {
        const int8_t* x = xs[b] + qk_k * i + 16 * j;
        __m512i u = _mm512_set1_epi32(os[b][16 * i + j]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          int32_t x4;
          std::memcpy(&x4, x + 4 * v, 4);
          u = _mm512_dpbusd_epi32(u, w[v], _mm512_set1_epi32(x4));
        }
        isum[b] = _mm512_add_epi32(isum[b], _mm512_mullo_epi32(u, s));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + lay.d(i))));
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(ds[b][i]));
      acc[b] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(isum[b]), acc[b]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) _mm512_mask_storeu_ps(y + (b0 + b) * n, valid, acc[b]);
}

// off[b][j] = -32 times the sum of activation row b's values 16 j .. 16 j + 15: per 64 values,
// the sums of each 4 (vpdpbusd by ones), then of each 4 lanes (two pair-sum rounds).
TANDEM_Q6P void sub_sums(const quant_acts& a, int32_t* off) {
  const int64_t k64 = a.k / 64;
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int8_t* x = a.q(b);
    int32_t* o = off + b * (a.k / 16);
    for (int64_t c = 0; c < k64; c += 4) {  // a super-block (4 chunks of 64) a step
      __m512i s[4];
      for (int m = 0; m < 4; ++m)
        s[m] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, _mm512_loadu_si512(x + 64 * (c + m)));
      const __m512i p01 = _mm512_add_epi32(_mm512_permutex2var_epi32(s[0], even, s[1]), _mm512_permutex2var_epi32(s[0], odd, s[1]));
      const __m512i p23 = _mm512_add_epi32(_mm512_permutex2var_epi32(s[2], even, s[3]), _mm512_permutex2var_epi32(s[2], odd, s[3]));
      const __m512i sums = _mm512_add_epi32(_mm512_permutex2var_epi32(p01, even, p23), _mm512_permutex2var_epi32(p01, odd, p23));
      _mm512_storeu_si512(o + 4 * c, _mm512_mullo_epi32(sums, _mm512_set1_epi32(-32)));
    }
  }
}

// Activation rows per tile of a batch: 8 int and 8 float accumulators beside 4 code vectors.
constexpr int tile_batch = 8;

// group_tile for `count` (<= C) activation rows.
template <int C>
void group_tile_rest(int count, const uint8_t* g, int64_t cols, const quant_acts& a, const int32_t* off, int64_t b0,
                     float* y, int64_t n, __mmask16 valid) {
  if constexpr (C > 1) {
    if (count == C) return group_tile<C, false>(g, cols, a, off, b0, y, n, valid, nullptr);
    return group_tile_rest<C - 1>(count, g, cols, a, off, b0, y, n, valid);
  } else {
    group_tile<1, false>(g, cols, a, off, b0, y, n, valid, nullptr);
  }
}

}  // namespace

void pack_group_q6_K(const tensor_view& w, int64_t r0, uint8_t* dst) {
  const q6_layout lay(dst, w.cols());
  const int64_t nb = lay.nb;
  std::memset(dst, 0, size_t(nb * super_bytes));
  for (int64_t r = 0; r < pack_rows && r0 + r < w.rows(); ++r) {
    const auto* blocks = reinterpret_cast<const block_q6_K*>(w.row(r0 + r));
    for (int64_t i = 0; i < nb; ++i) {
      const block_q6_K& b = blocks[i];
      uint8_t* q = dst + lay.codes(i);
      for (int j = 0; j < 16; ++j) {
        for (int t = 0; t < 4; ++t) {
          const int top = code_of(b, 16 * j + 12 + t);
          for (int v = 0; v < 3; ++v)
            q[sub_bytes * j + 64 * v + 4 * r + t] = uint8_t(code_of(b, 16 * j + 4 * v + t) | ((top >> (2 * v)) & 3) << 6);
        }
        dst[lay.scales(i) + 16 * j + r] = uint8_t(b.scales[j]);
      }
      std::memcpy(dst + lay.d(i) + 2 * r, &b.d, 2);
    }
  }
}

// Batch 1 streams the groups, fetching ahead; a batch runs blocks of groups that fit in L2,
// and in each block every tile of activation rows meets every group (each group comes from
// memory once per call).
void packed_rows_q6_K(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  if (g0 >= g1 || a.batch <= 0) return;
  const int64_t gbytes = int64_t(p.group_bytes()), n = p.rows;
  // Kept between calls (a decode step runs several matmuls a layer); made per call for every
  // activation row: about 20 vector ops per 256 activation values, against some 230 per
  // group and super-block at batch 1.
  thread_local aligned_vector<int32_t> off;
  if (off.size() < size_t(a.batch * (a.k / 16))) off.resize(size_t(a.batch * (a.k / 16)));
  sub_sums(a, off.data());
  auto valid = [&](int64_t g) {
    const int64_t left = n - g * pack_rows;
    return __mmask16(left >= 16 ? 0xFFFF : (1u << left) - 1);
  };
  if (a.batch == 1) {
    const char* end = reinterpret_cast<const char*>(p.bytes.data() + p.bytes.size());
    for (int64_t g = g0; g < g1; ++g)
      group_tile<1, true>(p.group(g), p.cols, a, off.data(), 0, y + g * pack_rows, n, valid(g), end);
    return;
  }
  const int64_t block = std::max<int64_t>(1, (int64_t(256) << 10) / gbytes);
  for (int64_t gb = g0; gb < g1; gb += block) {
    const int64_t ge = std::min(g1, gb + block);
    for (int64_t b = 0; b < a.batch; b += tile_batch) {
      const int count = int(std::min<int64_t>(tile_batch, a.batch - b));
      for (int64_t g = gb; g < ge; ++g)
        group_tile_rest<tile_batch>(count, p.group(g), p.cols, a, off.data(), b, y + g * pack_rows, n, valid(g));
    }
  }
}

}  // namespace tandem::cpu::quant_detail
