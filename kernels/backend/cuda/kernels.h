#pragma once
/// Launchers of the CUDA backend's kernels (kernels/backend/cuda/*.cu), callable from host C++:
/// this header stays C++17 and free of Tandem's C++20 headers so nvcc never parses them. All
/// pointers are device pointers; every launcher enqueues on `s` and returns the launch error.
/// Each kernel computes an output row from that row's inputs only, in an order fixed by the
/// shapes, so a row gets the same bits whatever else is in the batch.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tandem::cuda_backend {

// --- elementwise and row-wise (elementwise.cu)
/// RoPE over x [rows][n_heads][head_dim] with the angles' cos and sin ([rows][head_dim/2][2]),
/// pairs (2i, 2i+1) or, `neox`, (i, i + head_dim/2).
cudaError_t rope(float* x, const float* cos_sin, int64_t rows, int n_heads, int head_dim, bool neox, cudaStream_t s);
cudaError_t geglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t s);
cudaError_t softcap(float* x, size_t n, float cap, cudaStream_t s);
cudaError_t add(float* y, const float* x, int64_t n, cudaStream_t s);
cudaError_t scale(float* x, int64_t n, float v, cudaStream_t s);
cudaError_t add_bias(float* y, const float* b, int64_t rows, int64_t n, cudaStream_t s);
/// dst[j] = src[rows[j]] (gather) or dst[rows[j]] = src[j] (scatter), rows of width floats.
cudaError_t gather_rows(const float* src, const int32_t* rows, int64_t n_rows, float* dst, int64_t width,
                        cudaStream_t s);
cudaError_t scatter_rows(const float* src, const int32_t* rows, int64_t n_rows, float* dst, int64_t width,
                         cudaStream_t s);
/// y[t] = sum_j w[t][j] * e[t][j] (+ shared[t]), as the CPU backend orders it.
cudaError_t moe_combine(const float* expert_out, const float* weights, int64_t rows, int64_t k, int64_t n,
                        const float* shared, float* y, cudaStream_t s);
/// Row i of `rows` [n][width] (f32) into pool + page_stride * slots[2i] + comp_offset +
/// slots[2i+1] * width * elem_bytes, as f32 (elem_bytes 4) or IEEE halves (2, finite values
/// past the half range clamped to +-65504 as cpu::fp32_to_fp16_row does).
cudaError_t kv_write(uint8_t* pool, size_t page_stride, size_t comp_offset, const int32_t* slots, int64_t n,
                     const float* rows, int64_t width, int elem_bytes, cudaStream_t s);

// --- matmuls (matmul.cu)
/// x [rows][k] f32 -> xs [2 * rows][k] of 16-bit floats: rows [0, rows) the rounded value
/// (hi), rows [rows, 2 rows) the rounded remainder (lo), so W hi + W lo carries x to about 2^-22
/// (f16) or 2^-16 (bf16) instead of one rounding. bf16: brain floats, else IEEE halves.
/// The lo rows start at row `stride` of xs (a chunk of fixed size whose first `rows` are used).
cudaError_t split_hi_lo(const float* x, int64_t rows, int64_t k, bool bf16, void* xs, int64_t stride, cudaStream_t s);
/// y[r][i] = t[r][i] + t[rows + r][i] for r < used (t is [2 rows][n]).
cudaError_t join_hi_lo(const float* t, int64_t rows, int64_t used, int64_t n, float* y, cudaStream_t s);
/// The activation group of a quantized weight type (32 for q4_0 / q8_0, 256 for the k-quants).
int quant_group(uint32_t type);
/// kernels/cpu/quant_matmul.h's quantize_acts: x [batch][k] to int8 qs [batch][k] in groups of
/// `group` with scales d [batch][k / group] and the sums of every 32 q (sums [batch][k / 32]).
cudaError_t quantize_acts(const float* x, int64_t batch, int64_t k, int group, int8_t* qs, float* d, int16_t* sums,
                          cudaStream_t s);
/// y [batch][n] = W x for a quantized W [n][k] in ggml blocks (type: the ggml type id of q4_0,
/// q8_0, q4_K, q5_K or q6_K) over quantize_acts' output, by kernels/cpu/quant_matmul.h's recipe:
/// the same bits as the CPU's quant_matmul. One warp per (weight row, activation row).
cudaError_t matmul_quant(uint32_t type, const void* w, const int8_t* qs, const float* d, const int16_t* sums,
                         int64_t batch, float* y, int64_t n, int64_t k, cudaStream_t s);
/// True for the ggml type ids matmul_quant computes.
bool quant_supported(uint32_t type);
/// One input of a grouped quantize_acts launch: x [batch][k] into qs, d, sums as quantize_acts
/// lays them out; its blocks are [first, first + batch * k / group) of the launch.
struct quant_input {
  const float* x = nullptr;
  int8_t* qs = nullptr;
  float* d = nullptr;
  int16_t* sums = nullptr;
  int64_t k = 0, batch = 0, first = 0;
};
/// quantize_acts of every input in one launch (inputs sorted by first; one group size).
cudaError_t quantize_acts_grouped(const quant_input* inputs, int n_inputs, int64_t total_blocks, int group,
                                  cudaStream_t s);
/// One matmul of a grouped launch: y [batch][n] = W x on x's quantize_acts output; its work
/// items (one warp per weight row and activation row) are [first, first + n * batch).
struct quant_task {
  const void* w = nullptr;
  const int8_t* qs = nullptr;
  const float* d = nullptr;
  const int16_t* sums = nullptr;
  float* y = nullptr;
  int64_t n = 0, k = 0, first = 0;
};
/// matmul_quant of every task (one weight type, sorted by first) in one launch: each output
/// has the bits matmul_quant gives it (the same per-warp arithmetic).
cudaError_t matmul_quant_grouped(uint32_t type, const quant_task* tasks, int n_tasks, int64_t total_items,
                                 cudaStream_t s);

// --- attention (attention.cu)
/// One query row of a paged attention call: the query at position `pos` attends positions
/// [lo, pos] through page table `table` (offset into the call's table array).
struct attn_row {
  const float* q = nullptr;  ///< [n_heads][q_split] (standard: q_split = dk)
  const float* q_pe = nullptr;  ///< elements [q_split, dk) of the query (MLA's rope part), or null
  float* out = nullptr;      ///< [n_heads][dv]
  int32_t pos = 0;
  int32_t lo = 0;
  int32_t table = 0;
  int32_t split_base = 0;  ///< index of its first split's partial (split_softmax.h), when split
};
static_assert(sizeof(attn_row) == 40, "host and device agree on the row descriptor");
/// Where K and V of (page, slot, kv head) live: pool + page * page_stride + k_offset +
/// (slot * n_kv + head) * dk * elem_bytes, V at the same place from v_offset, its first dv
/// elements (standard: dv = dk; MLA: K is the latent row [c | k_pe], V its first kv_lora_rank
/// elements, v_offset = k_offset).
struct attn_shape {
  const uint8_t* pool = nullptr;
  size_t page_stride = 0, k_offset = 0, v_offset = 0;
  int page_size = 0, n_kv = 0, dk = 0, dv = 0, n_heads = 0, elem_bytes = 4;
  int q_split = 0;  ///< query elements from attn_row::q; the rest from q_pe
  float scale = 1.0f, softcap = 0.0f;
};
/// Attention of every (row, head): score = scale * q.k (then softcap * tanh(score / softcap)
/// when softcap > 0), softmax over [lo, pos], out = sum softmax * v. dv <= dk <= 1024;
/// query head h reads KV head h / (n_heads / n_kv). Rows of more than k_split_positions
/// positions are split (split_softmax.h): max_splits is the largest split_count of the rows,
/// `partials` holds [sum of their split counts][n_heads][dv + 2] floats, a split row's part
/// starting at its split_base (null when max_splits is 1).
cudaError_t paged_attention(const attn_row* rows, int64_t n_rows, const int32_t* tables, const attn_shape& sh,
                            int max_splits, float* partials, cudaStream_t s);

}  // namespace tandem::cuda_backend
