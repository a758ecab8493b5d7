#include "kernels/cpu/amx.h"
#include "kernels/cpu/huge_pages.h"

#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {

#define TANDEM_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")))

// Tile instructions as inline assembly with the operands spelled out. GCC 12's _tile_loadd
// has no memory clobber, so the compiler could move the stores that fill a buffer past the
// load that reads it; these say "memory" (a tile moves 1 KiB the compiler cannot see).
#define TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(int64_t(stride)) : "memory")
#define TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(int64_t(stride)) : "memory")
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
// C += A B (AT&T order: B, A, C).
#define TILE_DP(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// Palette 1, all eight tiles 16 rows x 64 bytes: C tiles are 16 x 16 f32, A and B tiles
// 16 x 32 bf16.
struct alignas(64) tile_config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loads the tile configuration on this thread for the lifetime of the object and releases
// the tile state after (so the kernel need not save it on every context switch).
struct tile_scope {
  TANDEM_AMX tile_scope() {
    static const tile_config cfg;
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  }
  TANDEM_AMX ~tile_scope() { __asm__ volatile("tilerelease" ::); }
  tile_scope(const tile_scope&) = delete;
  tile_scope& operator=(const tile_scope&) = delete;
};

bool detect_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(1, 0, a, b, c, d);
  if (!(c & (1u << 27))) return false;  // OSXSAVE: xgetbv is allowed
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx512f = b & (1u << 16), avx512bw = b & (1u << 30);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  __cpuid_count(7, 1, a, b, c, d);
  const bool avx512_bf16 = a & (1u << 5);
  if (!(avx512f && avx512bw && amx_bf16 && amx_tile && avx512_bf16)) return false;
  if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("fma")) return false;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (uint64_t(hi) << 32) | lo;
  if ((xcr0 & 0xe6) != 0xe6) return false;               // the OS saves the AVX-512 state
  if ((xcr0 & (3ull << 17)) != (3ull << 17)) return false;  // ... and the tile state
  // Linux hands out the 8 KiB tile data state only on request (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); it fails, for one, where signal stacks are too small for it.
  constexpr long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
  return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
}

// bf16 bits of x rounded to nearest even (NaN kept quiet), 16 lanes; the same as
// fp32_to_bf16 lane by lane. Returns the bits in the low half of each 32-bit lane.
TANDEM_AMX inline __m512i bf16_rne(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

TANDEM_AMX inline __m512 bf16_as_f32(__m512i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)); }

// The 16 activations of column block kb, half `half` (0 or 1), of a row of k; zero past k.
TANDEM_AMX inline __m512 load_half(const float* row, int64_t k, int64_t kb, int half) {
  const int64_t c = kb * 32 + half * 16;
  const int64_t left = std::clamp<int64_t>(k - c, 0, 16);
  return left == 16 ? _mm512_loadu_ps(row + c) : _mm512_maskz_loadu_ps(__mmask16((1u << left) - 1), row + c);
}

// 16 activations split into their three pieces (bf16 bits in the low half of each lane):
// hi = x rounded to bf16, mid = the rest rounded, lo = what is left (exact).
TANDEM_AMX inline void pieces16(__m512 x, __m512i& h, __m512i& m, __m512i& l) {
  h = bf16_rne(x);
  const __m512 r = _mm512_sub_ps(x, bf16_as_f32(h));
  m = bf16_rne(r);
  l = bf16_rne(_mm512_sub_ps(r, bf16_as_f32(m)));
}

// bf16 bits (32 lanes: a's 16, then b's) widened back to f32.
TANDEM_AMX inline void widen_bf16x32(__m512i p, __m512& a, __m512& b) {
  a = bf16_as_f32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(p)));
  b = bf16_as_f32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(p, 1)));
}

// The 32 activations of a column block (a: the first 16, b: the rest) split into their three
// pieces, stored as 32 bf16 each at hi, mid and lo: one instruction rounds 32 values
// (VCVTNE2PS2BF16: round to nearest even, NaN quieted, as bf16_rne) where bf16_rne takes
// seven per 16. It reads a denormal as zero where pieces16 keeps it; the tile unit reads every
// denormal piece as zero (denormals-are-zero), so the products are pieces16's either way (the
// batch-1 emulation, which uses pieces16 with the same mode, agrees bit for bit).
TANDEM_AMX inline void split32(__m512 a, __m512 b, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  const __m512i h = __m512i(_mm512_cvtne2ps_pbh(b, a));
  __m512 ha, hb;
  widen_bf16x32(h, ha, hb);
  const __m512 ra = _mm512_sub_ps(a, ha), rb = _mm512_sub_ps(b, hb);
  const __m512i m = __m512i(_mm512_cvtne2ps_pbh(rb, ra));
  __m512 ma, mb;
  widen_bf16x32(m, ma, mb);
  const __m512i l = __m512i(_mm512_cvtne2ps_pbh(_mm512_sub_ps(rb, mb), _mm512_sub_ps(ra, ma)));
  _mm512_storeu_si512(hi, h);
  _mm512_storeu_si512(mid, m);
  _mm512_storeu_si512(lo, l);
}

// Activation rows [m0, m1) of the batch into the A-tile layout: for each 16-row tile mt and
// 32-column block kb, three 1 KiB tiles (hi, mid, lo), row m of a tile at 32 m. Rows past
// the batch and columns past k are zero.
TANDEM_AMX void split_rows(const float* x, int64_t batch, int64_t k, int64_t kblocks, uint16_t* xs, int64_t m0,
                           int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t mt = m / 16, mr = m % 16;
    uint16_t* base = xs + mt * kblocks * 1536 + mr * 32;
    if (m >= batch) {
      for (int64_t kb = 0; kb < kblocks; ++kb)
        for (int p = 0; p < 3; ++p) std::memset(base + kb * 1536 + p * 512, 0, 64);
      continue;
    }
    const float* row = x + m * k;
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      uint16_t* t = base + kb * 1536;
      split32(load_half(row, k, kb, 0), load_half(row, k, kb, 1), t, t + 512, t + 1024);
    }
  }
}

// Blocks ahead of use that a weight stream is prefetched into L2 (see prefetch_block). The
// batch-1 emulation streamed 28-30 GB/s (2 threads) with 8 blocks and 35-37 with 32; 64
// was no better.
constexpr int64_t prefetch_blocks = 32;

// The activation of a batch-1 product as its pieces in f32 for the emulation below:
// xe[kb][hi, mid, lo][32], zero past k; the pieces of split32 (see there for denormals).
TANDEM_AMX void split_activation_f32(const float* x, int64_t k, int64_t kblocks, float* xe) {
  for (int64_t kb = 0; kb < kblocks; ++kb)
    for (int half = 0; half < 2; ++half) {
      __m512i h, m, l;
      pieces16(load_half(x, k, kb, half), h, m, l);
      float* d = xe + kb * 96 + half * 16;
      _mm512_storeu_ps(d, bf16_as_f32(h));
      _mm512_storeu_ps(d + 32, bf16_as_f32(m));
      _mm512_storeu_ps(d + 64, bf16_as_f32(l));
    }
}

// One packed f16 block (16 pairs x 16 rows) as its bf16 hi and lo blocks: hi keeps the
// top 8 significant bits (truncation, so lo = w - hi has at most 3 and both are exact; the
// conversions to bf16 then round nothing). f16 values are normal f32 numbers, so the
// conversion's denormals-are-zero never applies.
TANDEM_AMX inline void f16_block_split(const uint16_t* src, uint16_t* hi, uint16_t* lo) {
  const __m512i top = _mm512_set1_epi32(int32_t(0xffff0000u));
  for (int p = 0; p < 16; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(src + p * 32) + prefetch_blocks * 1024, _MM_HINT_T1);
    const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32)));
    const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + p * 32 + 16)));
    const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
    const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
    _mm512_storeu_si512(hi + p * 32, __m512i(_mm512_cvtne2ps_pbh(bh, ah)));
    _mm512_storeu_si512(lo + p * 32, __m512i(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah))));
  }
}

// Stores C tile `t` (activation rows mt*16.., weight rows g*16..) into y, through a buffer
// where the tile runs past the batch or the matrix.
#define STORE_C(t, g)                                                                                 \
  do {                                                                                                \
    const int64_t b0 = mt * 16, n0 = (g) * 16;                                                        \
    if (b0 + 16 <= batch && n0 + 16 <= n) {                                                           \
      TILE_STORE(t, y + b0 * n + n0, n * 4);                                                          \
    } else {                                                                                          \
      alignas(64) float c[256];                                                                       \
      TILE_STORE(t, c, 64);                                                                           \
      for (int64_t i = 0; i < 16 && b0 + i < batch; ++i)                                              \
        for (int64_t j = 0; j < 16 && n0 + j < n; ++j) y[(b0 + i) * n + n0 + j] = c[i * 16 + j];      \
    }                                                                                                 \
  } while (0)

// Tiles: C 0-2 (three weight groups side by side), the activation pieces hi, mid and lo in
// 3-5, and weight blocks alternating between 6 and 7, so a block loads while the previous
// one still feeds its products (a tile register is not renamed: a load into the tile just
// read would wait for those products to finish).
//
// One group's block against the activation pieces, into C tile c, in the fixed order:
// w.x_hi, w.x_mid, w.x_lo (bf16), and for f16 w_hi.x_hi, w_hi.x_mid, w_hi.x_lo, w_lo.x_hi,
// w_lo.x_mid.
#define GROUP_BF16(c, b, wb) \
  TILE_LOAD(b, wb, 64);      \
  TILE_DP(c, 3, b);          \
  TILE_DP(c, 4, b);          \
  TILE_DP(c, 5, b)
#define GROUP_F16(c, whi, wlo) \
  TILE_LOAD(6, whi, 64);       \
  TILE_DP(c, 3, 6);            \
  TILE_DP(c, 4, 6);            \
  TILE_DP(c, 5, 6);            \
  TILE_LOAD(7, wlo, 64);       \
  TILE_DP(c, 3, 7);            \
  TILE_DP(c, 4, 7)

constexpr int groups_per_pass = 3;  // C tiles

// Where the weight blocks of a pass come from.
enum class source {
  bf16,       // the packed bf16 blocks themselves
  f16_split,  // f16 blocks split beforehand into a buffer [group][kb][hi, lo]
  f16_fused,  // f16 blocks split block by block just before use (one activation tile)
};

// Requests the 16 lines of a 1 KiB block into L2, `prefetch_blocks` blocks ahead of use: a
// tile load that misses stalls every product behind it (one core's stream of tile loads:
// 13 GB/s without, 17 with; plain loads 14-16).
TANDEM_AMX inline void prefetch_block(const uint16_t* b) {
  for (int i = 0; i < 16; ++i) _mm_prefetch(reinterpret_cast<const char*>(b) + 64 * i, _MM_HINT_T1);
}

// NG (1-3) weight groups from gb against activation tile mt, over every column block.
// With `lead`, the first activation tile of a sweep, it also prefetches the next pass's bf16
// blocks.
template <int NG, source S>
TANDEM_AMX void tile_pass(const amx_matrix& w, const uint16_t* split, const uint16_t* xs, int64_t mt, bool lead,
                          int64_t gb, int64_t batch, float* y) {
  const int64_t kblocks = w.kblocks, n = w.rows;
  // f16_fused: two slots of NG split blocks, so a slot is refilled while the other is read.
  alignas(64) uint16_t fused[S == source::f16_fused ? 2 * NG * 1024 : 1];
  if constexpr (NG > 0) TILE_ZERO(0);
  if constexpr (NG > 1) TILE_ZERO(1);
  if constexpr (NG > 2) TILE_ZERO(2);
  const uint16_t* a = xs + mt * kblocks * 1536;
  // The split of column block kb of every group into slot kb % 2.
  auto split_fused = [&](int64_t kb) {
    for (int g = 0; g < NG; ++g) {
      uint16_t* dst = fused + ((kb & 1) * NG + g) * 1024;
      f16_block_split(w.block(gb + g, kb), dst, dst + 512);
    }
  };
  if constexpr (S == source::f16_fused) split_fused(0);
  for (int64_t kb = 0; kb < kblocks; ++kb, a += 1536) {
    const uint16_t* blk[NG];
    if constexpr (S == source::bf16) {
      for (int g = 0; g < NG; ++g) {
        blk[g] = w.block(gb + g, kb);
        // While the first activation tile streams this pass's weights, the next pass's
        // block of the same column comes into L2 (the later tiles read this pass from L2).
        if (lead && gb + NG + g < w.groups) prefetch_block(w.block(gb + NG + g, kb));
      }
    } else if constexpr (S == source::f16_split) {
      for (int g = 0; g < NG; ++g) blk[g] = split + (g * kblocks + kb) * 1024;
    } else {
      for (int g = 0; g < NG; ++g) blk[g] = fused + ((kb & 1) * NG + g) * 1024;
    }
    TILE_LOAD(3, a, 64);
    TILE_LOAD(4, a + 512, 64);
    TILE_LOAD(5, a + 1024, 64);
    if constexpr (S == source::bf16) {
      if constexpr (NG > 0) { GROUP_BF16(0, 6, blk[0]); }
      if constexpr (NG > 1) { GROUP_BF16(1, 7, blk[1]); }
      if constexpr (NG > 2) { GROUP_BF16(2, 6, blk[2]); }
    } else {
      if constexpr (NG > 0) { GROUP_F16(0, blk[0], blk[0] + 512); }
      if constexpr (NG > 1) { GROUP_F16(1, blk[1], blk[1] + 512); }
      if constexpr (NG > 2) { GROUP_F16(2, blk[2], blk[2] + 512); }
    }
    // The next block's split runs on the vector units while the tile unit works on this one.
    if constexpr (S == source::f16_fused)
      if (kb + 1 < kblocks) split_fused(kb + 1);
  }
  if constexpr (NG > 0) STORE_C(0, gb);
  if constexpr (NG > 1) STORE_C(1, gb + 1);
  if constexpr (NG > 2) STORE_C(2, gb + 2);
}

template <source S>
TANDEM_AMX void tile_pass_n(int ng, const amx_matrix& w, const uint16_t* split, const uint16_t* xs, int64_t mt,
                            bool lead, int64_t gb, int64_t batch, float* y) {
  switch (ng) {
    case 3: return tile_pass<3, S>(w, split, xs, mt, lead, gb, batch, y);
    case 2: return tile_pass<2, S>(w, split, xs, mt, lead, gb, batch, y);
    default: return tile_pass<1, S>(w, split, xs, mt, lead, gb, batch, y);
  }
}

// Weight groups [g0, g1) against every activation tile, 3 groups per pass. With several
// activation tiles, each pass's groups meet all of them in turn, so the weights come from
// memory once per call (f16 blocks are split once into `wbuf` and read back from L2); with
// one, f16 blocks are split just before use into a buffer that stays in L1.
TANDEM_AMX void groups_run(const amx_matrix& w, const uint16_t* xs, int64_t batch, float* y, int64_t g0, int64_t g1,
                           std::vector<uint16_t>& wbuf) {
  const tile_scope tiles;
  const int64_t kblocks = w.kblocks, mtiles = (batch + 15) / 16;
  const bool f16 = w.type == ggml_type::f16;
  if (f16 && mtiles > 1) wbuf.resize(size_t(groups_per_pass * kblocks * 1024) + 32);
  // Tile rows must not straddle cache lines (a split line costs each tile load twice).
  uint16_t* split = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(wbuf.data()) + 63) & ~uintptr_t(63));
  // Activation tiles per sweep over this thread's weight groups: as many as keep their pieces
  // (3 KiB per column block) within ~1 MiB, so they stay in L2 while the weights stream by
  // (all 512 rows of a prefill at k = 768 are 2.3 MiB, read again for every pass).
  const int64_t sweep = std::max<int64_t>(1, (int64_t(1) << 20) / (kblocks * 3072));
  for (int64_t m0 = 0; m0 < mtiles; m0 += sweep) {
    const int64_t m1 = std::min(mtiles, m0 + sweep);
    for (int64_t gb = g0; gb < g1; gb += groups_per_pass) {
      const int ng = int(std::min<int64_t>(groups_per_pass, g1 - gb));
      if (!f16) {
        for (int64_t mt = m0; mt < m1; ++mt)
          tile_pass_n<source::bf16>(ng, w, nullptr, xs, mt, mt == m0, gb, batch, y);
      } else if (mtiles == 1) {
        tile_pass_n<source::f16_fused>(ng, w, nullptr, xs, 0, false, gb, batch, y);
      } else {
        for (int g = 0; g < ng; ++g)
          for (int64_t kb = 0; kb < kblocks; ++kb) {
            uint16_t* dst = split + (g * kblocks + kb) * 1024;
            f16_block_split(w.block(gb + g, kb), dst, dst + 512);
          }
        for (int64_t mt = m0; mt < m1; ++mt)
          tile_pass_n<source::f16_split>(ng, w, split, xs, mt, false, gb, batch, y);
      }
    }
  }
}

// Batch 1 without tiles, bit for bit the tile arithmetic. A tile product on one activation
// row uses a sixteenth of the tile unit and waits on every weight tile load (measured: 1.6x
// the time of the avx512 kernel per decode step), while these FMAs stream the weights at
// memory speed. Each lane runs what TDPBF16PS runs for one output: the even-pair and odd-pair
// FMA chains of one product of pieces over a 32-column block, from 0, then acc + (even +
// odd), products in the same order; with denormals-are-zero and flush-to-zero set, as the
// tile unit has them. `xe` holds the activation's pieces as f32: [kb][hi, mid, lo][32].
//
// bf16: lane n is weight row n; a tile row of the block (column pair p of 16 rows) gives the
// even columns by a shift and the odd ones by a mask.
template <int NG>
TANDEM_AMX void emulate_bf16(const amx_matrix& w, const float* xe, int64_t g0, float* out) {
  const __m512i top = _mm512_set1_epi32(int32_t(0xffff0000u));
  __m512 acc[NG];
  for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < w.kblocks; ++kb) {
    const float* xp = xe + kb * 96;
    __m512 e[NG][3], o[NG][3];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 3; ++j) e[g][j] = o[g][j] = _mm512_setzero_ps();
    // Fully unrolled so the 6 NG chains stay in registers (left as loops, GCC kept them
    // on the stack: a store and a load per FMA, a third of the speed).
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p)
#pragma GCC unroll 4
      for (int g = 0; g < NG; ++g) {
        const uint16_t* row = w.block(g0 + g, kb) + p * 32;
        _mm_prefetch(reinterpret_cast<const char*>(row) + prefetch_blocks * 1024, _MM_HINT_T1);
        const __m512i v = _mm512_load_si512(row);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(v, top));
#pragma GCC unroll 3
        for (int j = 0; j < 3; ++j) {
          e[g][j] = _mm512_fmadd_ps(we, _mm512_set1_ps(xp[j * 32 + 2 * p]), e[g][j]);
          o[g][j] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xp[j * 32 + 2 * p + 1]), o[g][j]);
        }
      }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 3; ++j) acc[g] = _mm512_add_ps(acc[g], _mm512_add_ps(e[g][j], o[g][j]));
  }
  for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out + g * 16, acc[g]);
}

// f16: lanes 2i and 2i+1 are the even and odd chains of one weight row (rows 0-7 in one
// vector, 8-15 in the other), as the f16 values convert in their stored order; the
// activation pair is broadcast as one 64-bit element. Products: w_hi.x_hi, w_hi.x_mid,
// w_hi.x_lo, w_lo.x_hi, w_lo.x_mid.
TANDEM_AMX void emulate_f16(const amx_matrix& w, const float* xe, int64_t g, float* out) {
  const __m512i top = _mm512_set1_epi32(int32_t(0xffff0000u));
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < w.kblocks; ++kb) {
    const float* xp = xe + kb * 96;
    const uint16_t* blk = w.block(g, kb);
    __m512 ca[5], cb[5];
    for (int j = 0; j < 5; ++j) ca[j] = cb[j] = _mm512_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      const uint16_t* row = blk + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(row) + prefetch_blocks * 1024, _MM_HINT_T1);
      const __m512 a = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(row)));
      const __m512 b = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(row + 16)));
      const __m512 ah = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top));
      const __m512 bh = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top));
      const __m512 al = _mm512_sub_ps(a, ah), bl = _mm512_sub_ps(b, bh);
      double pair[3];
      std::memcpy(pair, xp + 2 * p, 8);
      std::memcpy(pair + 1, xp + 32 + 2 * p, 8);
      std::memcpy(pair + 2, xp + 64 + 2 * p, 8);
      const __m512 xh = _mm512_castpd_ps(_mm512_set1_pd(pair[0]));
      const __m512 xm = _mm512_castpd_ps(_mm512_set1_pd(pair[1]));
      const __m512 xl = _mm512_castpd_ps(_mm512_set1_pd(pair[2]));
      ca[0] = _mm512_fmadd_ps(ah, xh, ca[0]);
      cb[0] = _mm512_fmadd_ps(bh, xh, cb[0]);
      ca[1] = _mm512_fmadd_ps(ah, xm, ca[1]);
      cb[1] = _mm512_fmadd_ps(bh, xm, cb[1]);
      ca[2] = _mm512_fmadd_ps(ah, xl, ca[2]);
      cb[2] = _mm512_fmadd_ps(bh, xl, cb[2]);
      ca[3] = _mm512_fmadd_ps(al, xh, ca[3]);
      cb[3] = _mm512_fmadd_ps(bl, xh, cb[3]);
      ca[4] = _mm512_fmadd_ps(al, xm, ca[4]);
      cb[4] = _mm512_fmadd_ps(bl, xm, cb[4]);
    }
    for (int j = 0; j < 5; ++j) {
      // even + odd of each row (a + b == b + a in IEEE), then rows 0-15 in order.
      const __m512 sa = _mm512_add_ps(ca[j], _mm512_permute_ps(ca[j], 0xb1));
      const __m512 sb = _mm512_add_ps(cb[j], _mm512_permute_ps(cb[j], 0xb1));
      acc = _mm512_add_ps(acc, _mm512_permutex2var_ps(sa, evens, sb));
    }
  }
  _mm512_storeu_ps(out, acc);
}

// Weight groups [g0, g1) of a batch-1 product into y (n values), emulated as above.
TANDEM_AMX void emulate_groups(const amx_matrix& w, const float* xe, float* y, int64_t g0, int64_t g1) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // flush-to-zero and denormals-are-zero, as in the tile unit
  alignas(64) float out[32];
  for (int64_t g = g0; g < g1;) {
    int ng = 1;
    if (w.type == ggml_type::f16) {
      emulate_f16(w, xe, g, out);
    } else if (g + 1 < g1) {
      emulate_bf16<2>(w, xe, g, out);  // two weight streams: more loads in flight
      ng = 2;
    } else {
      emulate_bf16<1>(w, xe, g, out);
    }
    const int64_t n0 = g * 16, cnt = std::min<int64_t>(16 * ng, w.rows - n0);
    std::memcpy(y + n0, out, size_t(cnt) * 4);
    g += ng;
  }
  _mm_setcsr(csr);
}

// The calling thread's buffer for split f16 blocks. It lives as long as the thread:
// allocating up to 400 KiB per call would fault fresh pages in every time.
std::vector<uint16_t>& split_buffer() {
  thread_local std::vector<uint16_t> buf;
  return buf;
}

TANDEM_AMX double amx_rate_one(int64_t iters) {
  const tile_scope tiles;
  alignas(64) static const uint16_t zeros[512] = {};
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_ZERO(2);
  TILE_ZERO(3);
  TILE_LOAD(4, zeros, 64);
  TILE_LOAD(5, zeros, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    TILE_DP(0, 4, 5);
    TILE_DP(1, 4, 5);
    TILE_DP(2, 4, 5);
    TILE_DP(3, 4, 5);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(iters) * 4 * 16 * 16 * 32 * 2 / s;
}

}  // namespace

bool amx_usable() {
  static const bool ok = detect_amx();
  return ok;
}

void amx_split_activation(float x, uint16_t& hi, uint16_t& mid, uint16_t& lo) {
  hi = fp32_to_bf16(x);
  const float r = x - bf16_to_fp32(hi);
  mid = fp32_to_bf16(r);
  lo = fp32_to_bf16(r - bf16_to_fp32(mid));
}

size_t amx_packed_bytes(const tensor_view& w) {
  return size_t((w.rows() + 15) / 16) * size_t((w.cols() + 31) / 32) * 1024;
}

std::shared_ptr<uint16_t> amx_arena(size_t bytes) {
  // 2 MiB pages where the kernel gives them: a decode step streams every weight once, and
  // on 4 KiB pages the hardware prefetcher stops at each page boundary (prefill of 128
  // tokens ran 5-14% slower with the attention matrices on small pages). One arena for a
  // whole model wastes at most one page; a buffer under 2 MiB stays on small pages.
  size_t alloc = 0;
  auto* buf = static_cast<uint16_t*>(huge_alloc(bytes, alloc));
  if (buf == nullptr) throw tandem::error(fmt::format("amx: cannot allocate {} bytes for the tile copy of the weights", alloc));
  return std::shared_ptr<uint16_t>(buf, huge_free{});
}

amx_matrix amx_pack(const tensor_view& w, thread_pool* pool, std::shared_ptr<uint16_t> arena, size_t offset) {
  if (!amx_handles(w.type))
    throw tandem::error(fmt::format("amx_pack: weight type {} has no tile layout; only f16 and bf16 do",
                                    to_string(w.type)));
  if (offset % 32 != 0) throw tandem::error("amx_pack: the offset into the arena must be a multiple of 32 values");
  amx_matrix m;
  m.type = w.type;
  m.rows = w.rows();
  m.cols = w.cols();
  m.groups = (m.rows + 15) / 16;
  m.kblocks = (m.cols + 31) / 32;
  if (!arena) {
    arena = amx_arena(amx_packed_bytes(w));
    offset = 0;
  }
  uint16_t* buf = arena.get() + offset;
  m.data = std::shared_ptr<const uint16_t>(arena, buf);  // shares the arena's lifetime
  const int64_t kblocks = m.kblocks, rows = m.rows, cols = m.cols;
  parallel_for_if(pool, m.groups, m.groups * kblocks * 512, [&](int64_t g0, int64_t g1) {
    std::memset(buf + g0 * kblocks * 512, 0, size_t((g1 - g0) * kblocks) * 1024);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t r = 0; r < 16 && g * 16 + r < rows; ++r) {
        const auto* src = reinterpret_cast<const uint16_t*>(w.row(g * 16 + r));
        uint16_t* dst = buf + g * kblocks * 512 + r * 2;
        for (int64_t c = 0; c < cols; ++c) dst[(c / 32) * 512 + ((c % 32) / 2) * 32 + (c % 2)] = src[c];
      }
  });
  return m;
}

void amx_matmul(const amx_matrix& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
                thread_pool* pool) {
  const amx_matrix* ws[] = {&w};
  float* ys[] = {y};
  amx_matmul_many(ws, x, batch, ys, scratch, pool);
}

void amx_matmul_many(std::span<const amx_matrix* const> ws, const float* x, int64_t batch, std::span<float* const> ys,
                     std::vector<float>& scratch, thread_pool* pool) {
  if (!amx_usable()) throw tandem::error("amx_matmul: this CPU or OS does not run AMX tiles; use the avx512 path");
  if (ws.size() != ys.size()) throw tandem::error("amx_matmul_many: one output per matrix");
  if (batch <= 0 || ws.empty()) return;
  const int64_t k = ws[0]->cols, kblocks = ws[0]->kblocks, mtiles = (batch + 15) / 16;
  int64_t rows = 0;
  for (const amx_matrix* w : ws) {
    if (w->cols != k)
      throw tandem::error(fmt::format("amx_matmul_many: matrices of {} and {} columns cannot share one input", k,
                                      w->cols));
    rows += w->rows;
  }
  const bool threads = pool != nullptr && pool->size() > 1 && rows * k * batch >= matmul_min_parallel_work;
  // Work units of every matrix numbered one after another, so one fork-join (and, with
  // tiles, one split of the input) serves all of them: Q, K and V, or gate and up.
  std::vector<int64_t> off(1, 0);
  if (batch == 1) {
    // The activation's pieces as f32, [kb][hi, mid, lo][32] (zero past k).
    if (scratch.size() < size_t(kblocks * 96)) scratch.resize(size_t(kblocks * 96));
    float* xe = scratch.data();
    split_activation_f32(x, k, kblocks, xe);
    // Units of whole 2-group pairs (the bf16 emulation runs two groups side by side).
    for (const amx_matrix* w : ws) off.push_back(off.back() + (w->groups + 1) / 2);
    auto run = [&](int64_t u0, int64_t u1) {
      for_parts(off, u0, u1, [&](size_t i, int64_t p0, int64_t p1) {
        emulate_groups(*ws[i], xe, ys[i], p0 * 2, std::min(ws[i]->groups, p1 * 2));
      });
    };
    if (threads)
      pool->parallel_for_dynamic(off.back(), 4, run);
    else
      run(0, off.back());
    return;
  }
  const size_t xs_values = size_t(mtiles * kblocks) * 1536;
  if (scratch.size() * 2 < xs_values + 32) scratch.resize(xs_values / 2 + 32);
  // 64-byte aligned start inside the float buffer (tile rows are then whole cache lines).
  auto* xs = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
  parallel_for_if(
      threads ? pool : nullptr, mtiles * 16, mtiles * 16 * k,
      [&](int64_t m0, int64_t m1) { split_rows(x, batch, k, kblocks, xs, m0, m1); });
  // Units of whole 3-group passes, taken as threads free up (see matmul in ops.cpp).
  for (const amx_matrix* w : ws) off.push_back(off.back() + (w->groups + groups_per_pass - 1) / groups_per_pass);
  auto run = [&](int64_t u0, int64_t u1) {
    for_parts(off, u0, u1, [&](size_t i, int64_t p0, int64_t p1) {
      groups_run(*ws[i], xs, batch, ys[i], p0 * groups_per_pass, std::min(ws[i]->groups, p1 * groups_per_pass),
                 split_buffer());
    });
  };
  if (threads)
    pool->parallel_for_dynamic(off.back(), 4, run);
  else
    run(0, off.back());
}

double measure_peak_amx(thread_pool& pool, int reps) {
  if (!amx_usable()) return 0;
  double best = 0;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    std::vector<double> rate(size_t(pool.size()), 0.0);
    pool.parallel_for(pool.size(), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) rate[size_t(i)] = amx_rate_one(200000);
    });
    double sum = 0;
    for (double v : rate) sum += v;
    best = std::max(best, sum);
  }
  return best;
}

}  // namespace tandem::cpu
