#pragma once
/// CPU kernels for the Llama forward pass. All activations are f32, row-major.
/// Every kernel computes each output element with an accumulation order that depends only
/// on that element's inputs, never on the batch size, so batch 1 and batch N agree bit for bit.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kernels/cpu/amx.h"
#include "kernels/cpu/isa.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/rope_scaling.h"
#include "kernels/tensor.h"

namespace tandem::cpu {

class thread_pool;
struct quant_packed;

/// IEEE half bits -> float (exact).
float fp16_to_fp32(uint16_t h);
/// float -> IEEE half bits, round to nearest even (overflow to inf, NaN kept).
uint16_t fp32_to_fp16(float f);
/// fp32_to_fp16 over a row (F16C where the CPU has it; the same bits for every non-NaN value),
/// except that finite values beyond the half range become +-65504 instead of infinity: this
/// is the f16 KV cache's store, where one infinite K turns a whole sequence's attention into
/// NaN (0 * inf in a score, inf - inf in the softmax). Infinities and NaNs stay as they are.
void fp32_to_fp16_row(const float* in, uint16_t* out, int64_t n);
/// bfloat16 bits -> float (exact).
inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
/// float -> bfloat16 bits, round to nearest even (NaN kept quiet).
uint16_t fp32_to_bf16(float f);

/// Converts `n` elements of one row of type `t` (n a multiple of the type's block) to f32.
/// Throws tandem::error for an unsupported type.
void dequantize_row(ggml_type t, const void* row, float* out, int64_t n);

/// Embedding lookup: out[i][:] = row ids[i] of `table` as f32 (table is [n_vocab][n_embd]).
/// Throws tandem::error naming the id if it is out of range.
void get_rows(const tensor_view& table, std::span<const int32_t> ids, float* out);

/// y[b][n] = sum_k W[n][k] x[b][k] for b < batch, n < W.rows(), k < W.cols().
/// Each weight row is read from memory once for the whole batch (a block of rows is reused
/// from L2 by every tile of activation rows) and decoded in registers.
/// `scratch` is reused between calls to avoid allocations. With `pool`, output rows are split
/// across its threads; the result is the same bits for any thread count. `isa` picks the
/// instruction-set path (throws tandem::error if this CPU lacks it). Low-bit weights (q4_0,
/// q4_K, q5_K, q6_K) run quant_matmul (kernels/cpu/quant_matmul.h): the same bits on every path.
void matmul(const tensor_view& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool = nullptr, cpu_isa isa = cpu_isa::best);

/// Matmuls of less work than this (rows x columns x batch) run on the calling thread: too
/// little to be worth waking the workers. Every kernel path uses the same bound.
constexpr int64_t matmul_min_parallel_work = int64_t(1) << 16;

/// The order in which the batch-1 row kernels (f16/bf16/f32 on avx2 and avx512, q8_0 on
/// avx512) read weight rows [r0, r1): rows(r) with r[j] = r0 + j * part + i for j < N, N rows
/// at a time, one from each of N equal parts of the range, so that a thread reads N long
/// sequential streams (which the hardware prefetcher runs at memory speed) and keeps N
/// independent accumulator chains going (one chain per output, as in the batched tiles, so the
/// bits do not depend on N). Returns the first row not covered: the caller runs the last
/// (r1 - r0) % N rows alone. Measured on f16, 2048 columns, 1 GiB of rows, 2 threads (Zen 5):
/// 8 rows side by side with software prefetch 41 GB/s, one row at a time 47, two rows from two
/// halves 48-54, the plain read 55-66. Two chains were FMA-latency bound once the weights sit
/// in cache (f16 512 x 2048, one thread: 52 GB/s for two rows, 74-80 for four; q8_0 50 -> 63),
/// which also showed from memory whenever the machine's bandwidth ran high (16 llama-1b layers,
/// 2 threads, side by side: f16 50 -> 53-58 GB/s, q8_0 42-52 -> 46-56).
template <int N, class Rows>
inline int64_t for_row_streams(int64_t r0, int64_t r1, Rows&& rows) {
  const int64_t part = (r1 - r0) / N;
  for (int64_t i = 0; i < part; ++i) {
    int64_t r[N];
    for (int j = 0; j < N; ++j) r[j] = r0 + j * part + i;
    rows(std::as_const(r));
  }
  return r0 + N * part;
}

/// The N every batch-1 row kernel passes to for_row_streams.
constexpr int batch1_streams = 4;

/// A weight matrix prepared once for the kernel path `isa` (resolved): on the amx path an
/// f16 or bf16 matrix is also copied into the tile layout (`amx`); on the avx512 and amx paths
/// a low-bit weight with a packed kernel (quant_packed.h's packs()) is also copied into 16-row
/// interleaved groups (`quant`); otherwise only the view is kept. The view's memory must
/// outlive it (embedding lookups and the other paths read it).
struct packed_weight {
  tensor_view view;
  cpu_isa isa = cpu_isa::scalar;
  std::shared_ptr<const amx_matrix> amx;      ///< null unless the amx path packed it
  std::shared_ptr<const quant_packed> quant;  ///< null unless the avx512 path packed it
  /// The in-memory copy `view` points into (weight_copy.h); null when it points at the caller's bytes.
  std::shared_ptr<const uint8_t> copy;
};
/// What pack_weights copies besides keeping the view (the RAM check counts each copy).
struct weight_prep {
  /// Low-bit weights into 16-row groups on the avx512 path (false: the same bits, the
  /// row-major kernels).
  bool pack_low_bit = true;
  /// Every weight neither copy above takes into memory on 2 MiB pages (weight_copy.h): the
  /// same bits, faster to stream than the file's mapping.
  bool copy_rest = false;
};
/// Prepares `w` for `isa` (split across `pool`'s threads); throws tandem::error if this CPU
/// lacks the path.
packed_weight pack_weight(const tensor_view& w, cpu_isa isa = cpu_isa::best, thread_pool* pool = nullptr);
/// pack_weight for several matrices at once; on the amx path their tile copies share one
/// buffer (a model's worth on 2 MiB pages, instead of a page-rounded buffer each).
std::vector<packed_weight> pack_weights(std::span<const tensor_view> ws, cpu_isa isa = cpu_isa::best,
                                        thread_pool* pool = nullptr, weight_prep prep = {});
/// matmul of a prepared weight on its path: the same bits as matmul(w.view, ..., w.isa).
void matmul(const packed_weight& w, const float* x, int64_t batch, float* y, std::vector<float>& scratch,
            thread_pool* pool = nullptr);

/// matmul of several prepared weights with the same number of columns on one input x (each
/// output ys[i] is [batch][rows_i]), in one fork-join; on the amx path the input is also split
/// once. Each output has the bits matmul gives it alone.
void matmul_many(std::span<const packed_weight* const> ws, const float* x, int64_t batch, std::span<float* const> ys,
                 std::vector<float>& scratch, thread_pool* pool = nullptr);

/// One of several independent matmuls run together by matmul_jobs: y = W x for `batch` rows
/// of x ([batch][cols] in, [batch][rows] out).
struct matmul_job {
  const packed_weight* w = nullptr;
  const float* x = nullptr;
  int64_t batch = 0;
  float* y = nullptr;
};
/// Several matmuls, each on an input of its own, in one fork-join over the 24-row groups (16
/// for packed low-bit weights) of all of them taken as threads free up (small ones, like a decode step's experts, keep
/// every thread busy instead of one whole matrix per thread); low-bit weights in a second
/// one. Each output has the bits matmul gives it alone. Weights on the amx path run one
/// matmul each.
void matmul_jobs(std::span<const matmul_job> jobs, std::vector<float>& scratch, thread_pool* pool = nullptr);

/// The index std::max_element(x, x + n) returns (first position of the largest value; NaNs
/// never win unless x[0] is one), with a vector max where the CPU has AVX-512; -1 if n is 0.
int64_t argmax(const float* x, int64_t n);

/// Dot product of n floats with a fixed accumulation order (8 lanes; 16 on the avx512 path).
float dot(const float* a, const float* b, int64_t n);
float dot(const float* a, const float* b, int64_t n, cpu_isa isa);
/// y[i] += a * x[i] (one rounding per element on every path: fused multiply-add).
void axpy(float a, const float* x, float* y, int64_t n, cpu_isa isa = cpu_isa::best);

/// y[r][i] = x[r][i] * w[i] / sqrt(mean(x[r]^2) + eps), rows of n floats (y may equal x).
/// With `pool`, rows are split across its threads (the same bits).
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps,
              thread_pool* pool = nullptr);

/// y[i] += x[i] for i < n (the residual add), split across `pool`'s threads if given.
void add_inplace(float* y, const float* x, int64_t n, thread_pool* pool = nullptr);

/// In place: rotate adjacent pairs (x[2i], x[2i+1]) of each head by pos[r] * base^(-2i/head_dim)
/// (llama.cpp "normal" RoPE). x is [rows][n_heads][head_dim].
void rope(float* x, const int32_t* pos, int64_t rows, int n_heads, int head_dim, float freq_base);

/// cos and sin of every (row, pair) angle of rope(), computed once for the positions of a
/// forward pass and shared by its Q and K of every layer (the same bits as rope()).
struct rope_table {
  int64_t rows = 0;
  int head_dim = 0;
  /// false: pair i is (x[2i], x[2i+1]) (llama.cpp's "normal" RoPE); true: (x[i], x[i + head_dim/2])
  /// ("neox": Qwen, Gemma).
  bool neox = false;
  std::vector<float> cos_sin;  ///< [rows][head_dim / 2][cos, sin]
  /// `freq_factors` (head_dim / 2 values, or null): pair i's angle is divided by
  /// freq_factors[i] (Llama 3.1+ rope scaling, the `rope_freqs.weight` tensor). `yarn` (or
  /// null): YaRN as ggml's rope_yarn computes it: pair i's angle blends the interpolated
  /// (pos / factor) and the original one by a ramp over the pairs between the correction dims
  /// of beta_fast and beta_slow, and cos and sin are multiplied by `yarn_magnitude`.
  void build(const int32_t* pos, int64_t n_rows, int head_dim, float freq_base, bool neox = false,
             const float* freq_factors = nullptr, const yarn_scaling* yarn = nullptr, float yarn_magnitude = 1.0f);
};
/// rope() with the angles of `t` (x is [t.rows][n_heads][t.head_dim]); rows split across
/// `pool`'s threads if given (the same bits).
void rope(float* x, const rope_table& t, int n_heads, thread_pool* pool = nullptr);

/// out[i] = silu(gate[i]) * up[i] (out may equal gate), with softmax's exp, so every `isa`
/// path gives the same bits. With `pool`, split across its threads (elementwise, so the same
/// bits).
void swiglu(const float* gate, const float* up, float* out, size_t n, thread_pool* pool = nullptr,
            cpu_isa isa = cpu_isa::best);

/// out[i] = gelu(gate[i]) * up[i] with the tanh form of GELU (0.5 x (1 + tanh(sqrt(2/pi) (x +
/// 0.044715 x^3))), Gemma's gelu_pytorch_tanh); out may equal gate. Elementwise, so any split
/// across `pool`'s threads gives the same bits.
void geglu(const float* gate, const float* up, float* out, size_t n, thread_pool* pool = nullptr);

/// x[i] = cap * tanh(x[i] / cap) for i < n (Gemma 2's logit soft-capping; the division as
/// llama.cpp does it, a multiplication by 1/cap).
void softcap(float* x, size_t n, float cap);

/// In place numerically stable softmax of n floats: exp(x - max) by a fixed polynomial
/// (within 4 ulp after normalising; 0 below e^-87), summed in double in a fixed order, so every `isa` path
/// gives the same bits.
void softmax(float* x, size_t n, cpu_isa isa = cpu_isa::best);

/// Causal grouped-query attention for one sequence over paged KV.
/// q is [n_tokens][n_heads][head_dim] for positions pos0 .. pos0+n_tokens-1; K/V for positions
/// [0, pos0+n_tokens) must already be in `pages` of layer `layer` (position p lives in page
/// pages[p / page_size], slot p % page_size). out is [n_tokens][n_heads][head_dim].
/// Scale is 1/sqrt(head_dim); query head h reads KV head h / (n_heads / n_kv_heads).
/// With `tp`, the (token, head) rows are split across its threads (same bits for any count).
void paged_attention(const float* q, int64_t n_tokens, int32_t pos0, int n_heads, const kv_pool& pool,
                     int32_t layer, std::span<const int32_t> pages, float* out, std::vector<float>& scratch,
                     thread_pool* tp = nullptr, cpu_isa isa = cpu_isa::best);

/// One sequence of a batched attention call (same meaning as paged_attention's arguments).
struct attention_seq {
  const float* q = nullptr;
  int64_t n_tokens = 0;
  int32_t pos0 = 0;
  std::span<const int32_t> pages;
  float* out = nullptr;
};

/// What an architecture changes in attention (Gemma 2). The defaults are standard attention.
struct attention_params {
  float scale = 0.0f;     ///< multiplies q.k; 0 = 1/sqrt(head_dim)
  float softcap = 0.0f;   ///< > 0: scores become softcap * tanh(score / softcap) before the softmax
  int32_t window = 0;     ///< > 0: a token at position p sees only positions (p - window, p]
  bool is_default() const { return scale == 0.0f && softcap == 0.0f && window == 0; }
};

/// paged_attention for every sequence of a batch in one fork-join: all (sequence, token,
/// head) rows are split across `tp`'s threads, each computed exactly as paged_attention does.
/// Non-default `params` run every row on the row-at-a-time path (a token's arithmetic still
/// depends only on its own inputs).
void paged_attention_batch(std::span<const attention_seq> seqs, int n_heads, const kv_pool& pool, int32_t layer,
                           thread_pool* tp, cpu_isa isa = cpu_isa::best, const attention_params& params = {});

}  // namespace tandem::cpu
