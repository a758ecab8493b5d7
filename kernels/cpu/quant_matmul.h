#pragma once
/// Matmul of low-bit and q8_0 weights (q4_0, q4_K, q5_K, q6_K, q8_0) as llama.cpp computes it: each
/// activation row is quantized once per call to int8 groups with a float scale, each weight
/// block meets it in exact integer dot products (sub-block scales applied in integers), and
/// only the per-block combination is floating point, in a fixed order:
///   q4_K, q5_K: acc = fma(d * dx, isum, acc); acc = fma(-(dmin * dx), msum, acc) per block,
///     isum = sum_j sc_j * sum_(e in j) q_e x_e, msum = sum_j m_j * sum_(e in j) x_e;
///   q6_K: acc = fma(d * dx, isum, acc), isum = sum_j sc_j * sum_(e in j) (q_e - 32) x_e;
///   q4_0: acc = fma(d * dx, s, acc) per block in order, s = sum over the block of (q_e - 8) x_e
///     (one sum per block, so that a kernel can hold 16 weight rows in the 16 lanes of a vector:
///     kernels/cpu/quant_packed.h);
///   q8_0: 16 float lanes, lane 8 (i % 2) + l of block i gets fma(d * dx, s_l, lane) where s_l
///     = sum of q_e x_e over elements 4l .. 4l + 3; then lane i + 8, i + 4, i + 2, i + 1
///     (hsum16's tree).
/// Integer sums are exact, so the scalar, avx2 and avx512 paths, every batch size and every
/// thread count give the same bits (kernels/cpu/ops.h's invariant, here across paths too).
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cpu/aligned_vector.h"
#include "kernels/cpu/isa.h"
#include "kernels/tensor.h"

namespace tandem::cpu {

class thread_pool;
struct quant_packed;

/// Activation rows quantized for the low-bit kernels: row b's k values in groups of `group`
/// (32 for q4_0 and q8_0, 256 for the k-quants), each with scale d = max|x| / 127 and int8 values
/// round(x / d) in [-127, 127]; plus the sum of every 32 values.
struct quant_acts {
  int64_t k = 0, batch = 0;
  int group = 0;
  /// k / group, set with them by quantize_acts: the kernels call scale() in their block loops,
  /// and there a division was an idiv per block (GCC keeps a division, which may trap, inside
  /// its loop), the batch-1 q4_0 loop's costliest instruction.
  int64_t groups = 0;
  aligned_vector<int8_t> qs;  ///< [batch][k]; rows start on a cache line when 64 divides k
  std::vector<float> d;       ///< [batch][k / group]
  std::vector<int16_t> sums;  ///< [batch][k / 32]
  /// Group 32 only, for the avx512 q8_0 kernel's unsigned-weight dot products: per pair of
  /// groups (64 values, the last one padded with zeros when k / 32 is odd), 16 lanes of -128
  /// times the sum of each 4 values, and the two scales, each repeated 8 times.
  aligned_vector<int32_t> off128;  ///< [batch][pairs * 16]
  aligned_vector<float> d16;             ///< [batch][pairs * 16]
  int64_t pair_lanes() const { return (k / 32 + 1) / 2 * 16; }
  const int32_t* offset128(int64_t b) const { return off128.data() + b * pair_lanes(); }
  const float* scale16(int64_t b) const { return d16.data() + b * pair_lanes(); }
  const int8_t* q(int64_t b) const { return qs.data() + b * k; }
  const float* scale(int64_t b) const { return d.data() + b * groups; }
  const int16_t* sum32(int64_t b) const { return sums.data() + b * (k / 32); }
};

/// Fills `a` from `batch` rows of k floats (k a multiple of `group`), on the best path.
void quantize_acts(const float* x, int64_t batch, int64_t k, int group, quant_acts& a);
/// The same on path `isa` (avx512 where the CPU has it, else the scalar code): the same bits.
void quantize_acts(const float* x, int64_t batch, int64_t k, int group, quant_acts& a, cpu_isa isa);

/// The activation group of weight type `t` (32 for q4_0 and q8_0, 256 for the k-quants).
constexpr int act_group(ggml_type t) { return t == ggml_type::q4_0 || t == ggml_type::q8_0 ? 32 : 256; }

/// y[b][n] = sum_k W[n][k] x[b][k] for a low-bit weight, by the recipe above; rows split over
/// `pool`'s threads (same bits). `isa` must be resolved (not best or amx). Throws
/// tandem::error for another type or a row length that is not a multiple of the block.
void quant_matmul(const tensor_view& w, const float* x, int64_t batch, float* y, thread_pool* pool, cpu_isa isa);

/// A low-bit weight as quant_matmul_many and quant_matmul_jobs take it: the view, and its
/// packed copy (kernels/cpu/quant_packed.h) or null. A packed weight runs the packed kernel
/// where the path is avx512 (the same bits as the view), split by 16-row groups.
struct quant_weight {
  const tensor_view* view = nullptr;
  const quant_packed* packed = nullptr;
};

/// quant_matmul of several low-bit weights with the same columns on one input (ys[i] is
/// [batch][rows_i]): the input quantized once per activation group, one fork-join over the
/// row groups of all of them; each output has the bits quant_matmul gives it alone.
void quant_matmul_many(std::span<const quant_weight> ws, const float* x, int64_t batch, std::span<float* const> ys,
                       thread_pool* pool, cpu_isa isa);

/// quant_matmul of several low-bit weights, each on its own input (xs[i], batches[i] rows;
/// ys[i] is [batches[i]][rows_i]): every input quantized once, one fork-join over the row
/// groups of all of them; each output has the bits quant_matmul gives it alone.
void quant_matmul_jobs(std::span<const quant_weight> ws, std::span<const float* const> xs,
                       std::span<const int64_t> batches, std::span<float* const> ys, thread_pool* pool,
                       cpu_isa isa);

namespace quant_detail {
/// y[b][r] for rows [r0, r1) of w and every activation row of `a`, on one path.
void rows_scalar(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1);
void rows_avx2(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1);
void rows_avx512(const tensor_view& w, const quant_acts& a, float* y, int64_t r0, int64_t r1);
/// quantize_acts' loop on AVX-512 (needs has_avx512_vnni); `a` sized and its offsets zeroed.
void quantize_acts_avx512(const float* x, int64_t batch, int64_t k, int group, quant_acts& a);
/// Whether this CPU has AVX-512 VNNI (the avx512 kernels need it, with BW; without it the
/// avx512 path runs the avx2 kernels: the same bits).
bool has_avx512_vnni();
/// The loop order of the vector kernels over rows [r0, r1) and `batch` activation rows:
/// batch 1 runs tiles of R1 rows; a larger batch runs blocks of rows that fit in L2, and in
/// each block every tile of up to B activation rows meets every group of R rows (each weight
/// row comes from memory once per call). tile(row, rows, b0, count) computes rows
/// [row, row + rows) x activation rows [b0, b0 + count); rows is R1, R or 1 (the leftovers).
template <int R1, int R, int B, class Tile>
void for_tiles(int64_t row_bytes, int64_t batch, int64_t r0, int64_t r1, Tile&& tile) {
  int64_t r = r0;
  if (batch == 1) {
    for (; r + R1 <= r1; r += R1) tile(r, R1, 0, 1);
  } else {
    const int64_t block = std::max<int64_t>(1, (int64_t(256) << 10) / std::max<int64_t>(1, row_bytes) / R) * R;
    const int64_t rR = r0 + (r1 - r0) / R * R;
    for (int64_t rb = r0; rb < rR; rb += block) {
      const int64_t re = std::min(rR, rb + block);
      for (int64_t b = 0; b < batch; b += B)
        for (int64_t g = rb; g < re; g += R) tile(g, R, b, std::min<int64_t>(B, batch - b));
    }
    r = rR;
  }
  for (; r < r1; ++r)
    for (int64_t b = 0; b < batch; ++b) tile(r, 1, b, 1);
}
/// q8_0's final lane reduction (the tree of hsum16).
inline float tree16(const float* a) {
  float t8[8], t4[4];
  for (int i = 0; i < 8; ++i) t8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t4[i] = t8[i] + t8[i + 4];
  return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}
}  // namespace quant_detail

}  // namespace tandem::cpu
