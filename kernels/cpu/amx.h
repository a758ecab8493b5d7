#pragma once
/// The matmul of the `amx` kernel path: f16 and bf16 weights on Intel AMX tiles (TDPBF16PS),
/// with f32 accuracy. AMX multiplies bf16 pairs; so that nothing is rounded to bf16,
/// every activation x is split exactly into three bf16 pieces (x = hi + mid + lo, 8 bits of
/// significand each) and every f16 weight into two (w = hi + lo: its top 8 significant
/// bits and the remaining 3). A bf16 weight is exact as it is. The products of the pieces
/// are exact in f32, so y = sum w x is accumulated in f32 from exact terms; only the f16
/// term w_lo * x_lo (under 2^-25 of w x, below f32 rounding) is left out.
///
/// Per output element the arithmetic is fixed by the instruction (Intel SDM, TDPBF16PS, and
/// checked on this hardware against the emulation in the tests): for each 32-column block
/// and each product of pieces in the order below, an even-pair and an odd-pair FMA chain
/// over the block's 16 pairs, each from 0, then y += (even + odd). The tile shapes, batch
/// size and row split only decide which outputs run side by side, so batch 1 and batch N,
/// any thread count and any row split give the same bits. Batch 1 runs that arithmetic as
/// AVX-512 FMAs instead of tiles (one activation row would use a sixteenth of each tile
/// product), with flush-to-zero and denormals-are-zero set as the tile unit has them.
///
/// Not the default path: per decode step at batch 1 it is slower than the avx512 kernels
/// (three or five FMAs per weight instead of one); prefill and large batches are faster
/// (docs/architecture.md, "AMX tiles").
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kernels/tensor.h"

namespace tandem::cpu {

class thread_pool;

/// True when this CPU has AMX-TILE, AMX-BF16 and AVX-512 (F, BW, BF16) and the kernel
/// granted this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once).
bool amx_usable();

/// Weight types the amx path runs on tiles (f16, bf16); the others run the avx512 kernel.
constexpr bool amx_handles(ggml_type t) { return t == ggml_type::f16 || t == ggml_type::bf16; }

/// A weight matrix copied into the tiles' layout, built once per model: groups of 16 rows,
/// each as blocks of 32 columns; a block is 16 column pairs x 16 rows x 2 values (one 1 KiB
/// B tile: tile row p holds, for each of the 16 weight rows, columns 2p and 2p+1). Rows and
/// columns past the matrix are zero. Values keep their type's bits (f16 or bf16).
struct amx_matrix {
  ggml_type type = ggml_type::f16;
  int64_t rows = 0, cols = 0;
  int64_t groups = 0;   ///< ceil(rows / 16)
  int64_t kblocks = 0;  ///< ceil(cols / 32)
  std::shared_ptr<const uint16_t> data;  ///< 64-byte aligned, groups x kblocks x 512 values

  const uint16_t* block(int64_t g, int64_t kb) const { return data.get() + (g * kblocks + kb) * 512; }
};

/// Bytes of `w`'s tile layout (whole 16 x 32 tiles: a multiple of 1 KiB).
size_t amx_packed_bytes(const tensor_view& w);
/// A 64-byte aligned buffer for tile layouts, on 2 MiB pages when it is that large.
std::shared_ptr<uint16_t> amx_arena(size_t bytes);
/// Copies an f16 or bf16 matrix into the tile layout (split across `pool`'s threads): at
/// `offset` values into `arena` (which must hold amx_packed_bytes(w) more bytes there, and
/// which the result keeps alive), or into a buffer of its own without an arena. Throws
/// tandem::error for another type.
amx_matrix amx_pack(const tensor_view& w, thread_pool* pool = nullptr, std::shared_ptr<uint16_t> arena = {},
                    size_t offset = 0);

/// y[b][n] = sum_k W[n][k] x[b][k] on tiles, as described above. Requires amx_usable().
/// `scratch` holds the split activations between calls.
void amx_matmul(const amx_matrix& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
                thread_pool* pool = nullptr);

/// amx_matmul of several matrices with the same number of columns on one input x (each
/// output y_i is [batch][rows_i]): the input is split once and all their work shares one
/// fork-join. Each output has the bits amx_matmul gives it alone.
void amx_matmul_many(std::span<const amx_matrix* const> ws, const float* x, int64_t batch, std::span<float* const> ys,
                     std::vector<float>& scratch, thread_pool* pool = nullptr);

/// The exact bf16 split of one activation (hi + mid + lo == x for every finite x whose
/// pieces are not subnormal), as amx_matmul makes it; for the tests' emulation.
void amx_split_activation(float x, uint16_t& hi, uint16_t& mid, uint16_t& lo);

/// Measured TDPBF16PS rate of all of `pool`'s threads in FLOP/s (16 x 16 x 32 multiply-adds
/// per instruction, 2 FLOP each), best of `reps`; 0 without AMX.
double measure_peak_amx(thread_pool& pool, int reps);

}  // namespace tandem::cpu
