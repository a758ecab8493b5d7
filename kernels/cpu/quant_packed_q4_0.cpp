// q4_0 in 16-row interleaved groups (kernels/cpu/quant_packed.h) and its AVX-512 VNNI kernel.
//
// A group of nb blocks per row is nb * 288 bytes, its blocks in pairs: a pair's two code runs
// (2 x 256 bytes), then their two scale runs (2 x 32 bytes); an unpaired last block's scales
// follow its codes.
//   codes of block i: 4 vectors of 64 bytes; 32-bit lane r of vector j is row r's qs[4j .. 4j + 3]
//     (low nibbles: elements 4j .. 4j + 3, high nibbles: 16 + 4j .. 16 + 4j + 3);
//   scales of block i: the 16 rows' d (IEEE half), row r at 2r.
// A pair is 576 bytes, 9 lines, so every code vector starts on a 64-byte boundary of the group
// (its loads never split a line where the group starts on one: always when nb is even). A
// batch-1 step reads a group range as one sequential stream, which the hardware prefetcher
// runs at memory speed. Measured against the previous layout (all codes, then all scales:
// two streams, the next group requested into L2 block by block), 2 threads, 48 weights of
// 8192 x 2048 in rotation, side by side (Zen 5): 34 -> 41-47 GB/s. Batch 1 also requests, 8 KB
// further on, the first lines of each 4 KiB page the stream reaches (kick_page): every line
// requested instead ran no faster than no requests at all (see kick_page's numbers).
//
// Per block and activation row: 8 vpdpbusd, each the 16 rows' 4 nibbles (u8) against one
// broadcast group of 4 activation bytes (s8), started from -8 times the block's activation sum,
// give the exact sum of (q - 8) x of the 16 rows at once; then one conversion and one fma by
// the 16 rows' d times the block's dx: the recipe of quant_matmul.h, lane by lane.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/simd.h"

namespace tandem::cpu::quant_detail {

namespace {

#define TANDEM_P512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int64_t codes_bytes = 256;  // per block of a group
constexpr int64_t scales_bytes = 32;  // per block of a group
constexpr int64_t pair_bytes = 2 * (codes_bytes + scales_bytes);

/// Offsets in a group of nb blocks of block i's codes and scales.
constexpr int64_t codes_at(int64_t i) { return i / 2 * pair_bytes + i % 2 * codes_bytes; }
constexpr int64_t scales_at(int64_t i, int64_t nb) {
  return i / 2 * pair_bytes + (i / 2 * 2 + 1 < nb ? 2 : 1) * codes_bytes + i % 2 * scales_bytes;
}

// Batch 1's software prefetch distance (see the top of the file).
constexpr int64_t fetch_ahead = int64_t(8) << 10;

// One group (16 rows) x B activation rows from b0: y[b][r] for the rows whose bit is set in
// `valid` (y points at the group's first row of activation row 0; n is its stride). With `end`
// (batch 1), each block pair kicks the page its bytes fetch_ahead further on reach (kick_page).
template <int B>
TANDEM_P512 void group_tile(const uint8_t* g, int64_t nb, const quant_acts& a, int64_t b0,
                            float* y, int64_t n, __mmask16 valid, const uint8_t* end = nullptr) {
  __m512 acc[B];
  // Each activation row's values, block sums and scales found once: through a's accessors the
  // loop recomputed the three addresses every block (loads, multiplies and a signed shift),
  // 64 -> 75 GB/s in L2 on one thread (Zen 5, 512 x 2048, alternating runs).
  const int8_t* xs[B];
  const int16_t* ss[B];
  const float* ds[B];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) {
    acc[b] = _mm512_setzero_ps();
    xs[b] = a.q(b0 + b), ss[b] = a.sum32(b0 + b), ds[b] = a.scale(b0 + b);
  }
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* q = g + codes_at(i);
    if (end != nullptr && i % 2 == 0) kick_page(q + fetch_ahead, pair_bytes, end);
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(q + 64 * j);
      lo[j] = _mm512_and_si512(raw, mask);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + scales_at(i, nb))));
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const int8_t* x = xs[b] + q4_0_block * i;
      // Batch 1: two chains (low and high nibbles) for latency, summed; with several activation
      // rows the rows' chains overlap and one chain saves the add. An exact integer either way.
      __m512i s0 = _mm512_set1_epi32(-8 * int32_t(ss[b][i]));
      [[maybe_unused]] __m512i s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        int32_t x0, x1;
        std::memcpy(&x0, x + 4 * j, 4);
        std::memcpy(&x1, x + 16 + 4 * j, 4);
        s0 = _mm512_dpbusd_epi32(s0, lo[j], _mm512_set1_epi32(x0));
        if constexpr (B < 4) s1 = _mm512_dpbusd_epi32(s1, hi[j], _mm512_set1_epi32(x1));
        else s0 = _mm512_dpbusd_epi32(s0, hi[j], _mm512_set1_epi32(x1));
      }
      if constexpr (B < 4) s0 = _mm512_add_epi32(s0, s1);
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(ds[b][i]));
      acc[b] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s0), acc[b]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b) _mm512_mask_storeu_ps(y + (b0 + b) * n, valid, acc[b]);
}

// group_tile for `count` (< C) activation rows.
template <int C>
void group_tile_rest(int count, const uint8_t* g, int64_t nb, const quant_acts& a, int64_t b0, float* y,
                     int64_t n, __mmask16 valid, const uint8_t* end = nullptr) {
  if constexpr (C > 1) {
    if (count == C - 1) return group_tile<C - 1>(g, nb, a, b0, y, n, valid, end);
    return group_tile_rest<C - 1>(count, g, nb, a, b0, y, n, valid, end);
  }
}

// Activation rows per tile of a batch: 8 accumulators, 8 decoded code vectors.
constexpr int tile_batch = 8;

// `groups` consecutive packed groups at `base` against every activation row of `a`: y points
// at the first group's first row (stride n), and only the first `real` rows are written.
// Batch 1 and batches of one tile stream the groups (prefetching up to `stream_end`); a larger
// batch runs blocks of groups that fit in L2, and in each block every tile of activation rows
// meets every group (each group comes from memory once per call).
void run_groups(const uint8_t* base, int64_t groups, int64_t nb, const quant_acts& a, float* y, int64_t n,
                int64_t real, const uint8_t* stream_end) {
  const int64_t gbytes = nb * (codes_bytes + scales_bytes);
  auto valid = [&](int64_t g) {
    const int64_t left = real - g * pack_rows;
    return __mmask16(left >= 16 ? 0xFFFF : (1u << left) - 1);
  };
  if (a.batch <= tile_batch) {
    // One tile of activation rows (decode, batch 1 included): the groups in order, one stream.
    // The pages of the range's first fetch_ahead bytes are kicked up front; each block pair then
    // kicks those further on, up to the end of the weight: a thread walks its share of it in
    // pieces (thread_pool::parallel_for_steal), one stream across them. Batches of 2-8 rows
    // ran prefill's blocks below with no kicks, and their loads stalled at every 4 KiB page (a
    // batch-8 step read its weights at 12-14 GB/s): llama-1b q4_0 batch 8, with and without
    // alternated every 10 steps, 2 threads (Zen 5): -8 to -10% a step; batch 4 unchanged.
    kick_pages(base, fetch_ahead, stream_end);
    const int count = int(a.batch);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = base + g * gbytes;
      float* yg = y + g * pack_rows;
      if (count == tile_batch)
        group_tile<tile_batch>(p, nb, a, 0, yg, n, valid(g), stream_end);
      else
        group_tile_rest<tile_batch>(count, p, nb, a, 0, yg, n, valid(g), stream_end);
    }
    return;
  }
  const int64_t block = std::max<int64_t>(1, (int64_t(256) << 10) / gbytes);
  for (int64_t gb = 0; gb < groups; gb += block) {
    const int64_t ge = std::min(groups, gb + block);
    for (int64_t b = 0; b < a.batch; b += tile_batch) {
      const int count = int(std::min<int64_t>(tile_batch, a.batch - b));
      for (int64_t g = gb; g < ge; ++g) {
        const uint8_t* p = base + g * gbytes;
        float* yg = y + g * pack_rows;
        if (count == tile_batch)
          group_tile<tile_batch>(p, nb, a, b, yg, n, valid(g));
        else
          group_tile_rest<tile_batch>(count, p, nb, a, b, yg, n, valid(g));
      }
    }
  }
}

// pack_group_q4_0 of 16 real rows on AVX-512: per block, A_t holds rows 4m + t's 16 code bytes
// in its 128-bit lane m; a 4 x 4 transpose of 32-bit words within the lanes then gives vector j
// (lane r: row r's bytes 4j .. 4j + 3). An unpacked weight is packed this way on every call.
TANDEM_P512 void pack_full_group(const tensor_view& w, int64_t r0, uint8_t* dst) {
  const int64_t nb = w.cols() / q4_0_block;
  const block_q4_0* rows[pack_rows];
  for (int64_t r = 0; r < pack_rows; ++r) rows[r] = reinterpret_cast<const block_q4_0*>(w.row(r0 + r));
  const int64_t ahead = pack_rows * int64_t(row_bytes(ggml_type::q4_0, w.cols()));
  for (int64_t i = 0; i < nb; ++i) {
    // 16 rows read side by side, each too short a stream for the hardware prefetcher: the next
    // group's same bytes (16 rows on) are requested into L2 as these are read, as tile_k does
    // (a batch-1 call from memory streamed at 3 GB/s without, 5.6 with a request 512 bytes ahead).
    if (i % 2 == 0)
      for (int64_t r = 0; r < pack_rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows[r] + i) + ahead, _MM_HINT_T1);
    __m512i A[4];
    for (int t = 0; t < 4; ++t) {
      auto qs = [&](int m) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[4 * m + t][i].qs)); };
      A[t] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(qs(0)), qs(1), 1), qs(2), 2),
                                qs(3), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(A[0], A[1]), t1 = _mm512_unpackhi_epi32(A[0], A[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(A[2], A[3]), t3 = _mm512_unpackhi_epi32(A[2], A[3]);
    uint8_t* q = dst + codes_at(i);
    _mm512_storeu_si512(q, _mm512_unpacklo_epi64(t0, t2));
    _mm512_storeu_si512(q + 64, _mm512_unpackhi_epi64(t0, t2));
    _mm512_storeu_si512(q + 128, _mm512_unpacklo_epi64(t1, t3));
    _mm512_storeu_si512(q + 192, _mm512_unpackhi_epi64(t1, t3));
    for (int64_t r = 0; r < pack_rows; ++r) std::memcpy(dst + scales_at(i, nb) + 2 * r, &rows[r][i].d, 2);
  }
}

}  // namespace

void pack_group_q4_0(const tensor_view& w, int64_t r0, uint8_t* dst) {
  const int64_t nb = w.cols() / q4_0_block;
  if (r0 + pack_rows <= w.rows() && has_avx512_vnni()) return pack_full_group(w, r0, dst);
  std::memset(dst, 0, size_t(nb * (codes_bytes + scales_bytes)));
  for (int64_t r = 0; r < pack_rows && r0 + r < w.rows(); ++r) {
    const auto* blocks = reinterpret_cast<const block_q4_0*>(w.row(r0 + r));
    for (int64_t i = 0; i < nb; ++i) {
      std::memcpy(dst + scales_at(i, nb) + 2 * r, &blocks[i].d, 2);
      for (int j = 0; j < 4; ++j) std::memcpy(dst + codes_at(i) + 64 * j + 4 * r, blocks[i].qs + 4 * j, 4);
    }
  }
}

void packed_rows_q4_0(const quant_packed& p, const quant_acts& a, float* y, int64_t g0, int64_t g1) {
  if (g0 >= g1 || a.batch <= 0) return;
  run_groups(p.group(g0), g1 - g0, p.cols / q4_0_block, a, y + g0 * pack_rows, p.rows,
             p.rows - g0 * pack_rows, p.bytes.data() + p.bytes.size());
}

void rows_q4_0_repacked(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1) {
  const int64_t nb = w.cols() / q4_0_block, gbytes = nb * (codes_bytes + scales_bytes);
  // Groups packed a block at a time (as many as run_groups keeps in L2), then run.
  const int64_t block = std::max<int64_t>(1, (int64_t(256) << 10) / gbytes);
  thread_local aligned_vector<uint8_t> buf;
  for (int64_t r = r0; r < r1; r += block * pack_rows) {
    const int64_t groups = std::min(block, (r1 - r + pack_rows - 1) / pack_rows);
    if (buf.size() < size_t(groups * gbytes)) buf.resize(size_t(groups * gbytes));
    for (int64_t g = 0; g < groups; ++g) pack_group_q4_0(w, r + g * pack_rows, buf.data() + g * gbytes);
    run_groups(buf.data(), groups, nb, a, y + r, w.rows(), r1 - r, buf.data() + groups * gbytes);
  }
}

}  // namespace tandem::cpu::quant_detail
