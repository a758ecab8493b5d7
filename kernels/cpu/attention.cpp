// Paged attention over the KV pool: the avx512 grouped and head-block kernels, the
// row-at-a-time path (scalar, avx2, and the scale / soft-cap / window variants), and the batch
// driver that splits (sequence, token, head) rows across threads. Every row's arithmetic
// depends only on its own inputs, so prefill and decode, any batch and any split agree bit
// for bit.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/base/error.h"
#include "kernels/cpu/avx512_sum.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

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

// Rows before `from` are left unset and their pages unread (a window pool releases them).
template <class T>
void k_rows(const kv_pool& pool, int32_t layer, std::span<const int32_t> pages, int kvh, int64_t len,
            std::vector<const T*>& rows, int64_t from = 0) {
  const kv_layout& L = pool.layout();
  const size_t stride = size_t(L.n_kv_heads) * L.head_dim;
  rows.resize(size_t(len));
  for (int64_t pg = from / L.page_size, p0 = pg * L.page_size; p0 < len; p0 += L.page_size, ++pg) {
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
  // 11.1-11.5 ms for a step's attention on one thread without, 8.1-8.4 with). Since then the
  // requests had been compiled away (see prefetch_t0); issued again, 16 layers of llama-1b
  // shapes, 2 threads, caches flushed (Zen 5): batch 32 context 80 f16 6.3 -> 4.9 ms, f32 7.1
  // -> 6.4-6.6 (2 and 8 rows ahead alike); batch 1 context 1024 4.2 -> 3.8 ms 2 ahead, 3.0 8
  // ahead, context 256 0.93 -> 0.73 ms 8 ahead.
  constexpr int64_t ahead = 8;
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
    for (size_t b = lo; b < hi; b += 64) prefetch_t0(c + b);
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
                   std::vector<const T*>& rows, std::vector<float>& wide, const attention_params& ap = {}) {
  const int hd = pool.layout().head_dim;
  const float scale = ap.scale != 0.0f ? ap.scale : 1.0f / std::sqrt(float(hd));
  auto row = [&](const T* r) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return r;
    } else {
      wide.resize(size_t(hd));
      dequantize_row(ggml_type::f16, r, wide.data(), hd);
      return wide.data();
    }
  };
  // A sliding window reads only the last `window` positions (the row's own included).
  const int64_t p0 = ap.window > 0 ? std::max<int64_t>(0, len - ap.window) : 0, n = len - p0;
  k_rows(pool, layer, pages, kvh, len, rows, p0);
  for (int64_t p = 0; p < n; ++p) att[p] = dot(qh, row(rows[size_t(p0 + p)]), hd, isa) * scale;
  if (ap.softcap > 0.0f) softcap(att, size_t(n), ap.softcap);
  softmax(att, size_t(n), isa);
  std::fill(oh, oh + hd, 0.0f);
  const size_t v_offset = pool.layout().layer_elems();  // V sits right after K
  for (int64_t p = 0; p < n; ++p) axpy(att[p], row(rows[size_t(p0 + p)] + v_offset), oh, hd, isa);
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
                           thread_pool* tp, cpu_isa isa, const attention_params& ap) {
  isa = vector_isa(resolve_isa(isa));
  const kv_layout& L = pool.layout();
  const int hd = L.head_dim;
  // The avx512 path takes up to 4 consecutive tokens of one head at a time (same bits as
  // one at a time); the others one token at a time. Scale, soft-cap and window variants
  // take the row path only.
  const bool grouped = isa == cpu_isa::avx512 && hd % 16 == 0 && ap.is_default();
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
                      q.out + (t0 * n_heads + h) * hd, att.data(), isa, kv_rows, wide, ap);
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
