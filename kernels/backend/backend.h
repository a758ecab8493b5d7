#pragma once
/// The backend layer: the op table every architecture's forward pass is written against
/// (kernels/model/arch/*_forward.cpp), and the memory domain its weights, activations and KV
/// pool live in. The CPU backend (cpu_backend.h) runs kernels/cpu; a CUDA backend implements the
/// same table on device memory (kernels/cuda holds its kernels).
///
/// Pointers to activations (`float*`) are in the backend's domain: host memory for the CPU, a
/// device's for CUDA, allocated through make_buffer(). Descriptors (token ids, page tables,
/// rope angles, routing decisions) stay on the host; a device backend copies what it needs.
/// Every op gives a row the same bits whatever else is in the batch, so a sequence's output
/// does not depend on its batch (the tests hold every backend to this).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend/graph_cache.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/logprobs.h"
#include "kernels/tensor.h"

namespace tandem::backend {

/// Where a backend's weights, activations and KV pool live.
enum class memory_domain : int32_t { host, device };

/// A weight prepared by a backend (packed for a CPU kernel path, uploaded to a device).
struct weight_id {
  int32_t index = -1;
  bool valid() const { return index >= 0; }
};

/// Activation memory in the backend's domain, grown on demand and reused across calls.
class buffer {
 public:
  virtual ~buffer() = default;
  /// At least `n` floats; the contents survive only when no growth was needed.
  virtual float* floats(size_t n) = 0;
};

/// Host-side descriptors the ops take (plain data; a device backend uploads them).
using attention_seq = cpu::attention_seq;
using attention_params = cpu::attention_params;
using rope_table = cpu::rope_table;
using moe_routing = cpu::moe_routing;

/// Where one new token's KV row goes: page and slot of the pool.
struct kv_slot {
  int32_t page = 0;
  int32_t slot = 0;
};

/// One sequence of a latent (MLA) attention call: q_lat [n_tokens][kv_lora_rank] and q_pe
/// [n_tokens][rope_dims] of one head, out [n_tokens][kv_lora_rank].
struct mla_seq {
  const float* q_lat = nullptr;
  const float* q_pe = nullptr;
  int64_t n_tokens = 0;
  int32_t pos0 = 0;
  std::span<const int32_t> pages;
  float* out = nullptr;
};

/// One matmul of a batch of independent ones: y [rows][W rows] = W x [rows][W cols].
struct matmul_task {
  weight_id w;
  const float* x = nullptr;
  int64_t rows = 0;
  float* y = nullptr;
};

/// The op table.
class ops {
 public:
  virtual ~ops() = default;
  virtual memory_domain domain() const = 0;
  /// "cpu (avx512, 2 threads)"
  virtual std::string describe() const = 0;

  virtual std::unique_ptr<buffer> make_buffer() = 0;
  /// Copies n floats of the backend's memory to the host (a plain copy on the CPU).
  virtual void download(const float* src, size_t n, float* host) = 0;
  /// Prepares every matmul weight at once (the CPU's amx copies then share one allocation);
  /// ids in the order of `ws`.
  virtual std::vector<weight_id> prepare(std::span<const tensor_view> ws) = 0;

  // --- matrices
  /// y[r] = W x[r] for `rows` rows (x [rows][cols], y [rows][W rows]).
  virtual void matmul(weight_id w, const float* x, int64_t rows, float* y) = 0;
  /// matmul of several weights over the same input, each output with the bits matmul gives it.
  virtual void matmul_many(std::span<const weight_id> ws, const float* x, int64_t rows, std::span<float* const> ys) = 0;
  /// y = W x for independent tasks (per-head and per-expert matrices, each often too small to
  /// split alone): the backend may run them side by side; each output has the bits matmul
  /// gives it.
  virtual void matmul_batch(std::span<const matmul_task> tasks) = 0;
  /// Embedding rows `ids` of `table` as f32 into out [ids][cols].
  virtual void get_rows(const tensor_view& table, std::span<const int32_t> ids, float* out) = 0;

  // --- elementwise and row-wise
  virtual void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) = 0;
  /// RoPE over x [angles.rows][n_heads][angles.head_dim], in place.
  virtual void rope(float* x, const rope_table& angles, int n_heads) = 0;
  virtual void swiglu(const float* gate, const float* up, float* out, size_t n) = 0;
  virtual void geglu(const float* gate, const float* up, float* out, size_t n) = 0;
  virtual void softcap(float* x, size_t n, float cap) = 0;
  /// y += x
  virtual void add(float* y, const float* x, int64_t n) = 0;
  /// x *= s
  virtual void scale(float* x, int64_t n, float s) = 0;
  /// y[r] += b for rows of n.
  virtual void add_bias(float* y, const float* b, int64_t rows, int64_t n) = 0;
  /// dst[r * dst_stride .. + width] = src[r * src_stride .. + width] for r < rows: splits
  /// and joins of heads and row parts.
  virtual void copy_rows(const float* src, int64_t src_stride, float* dst, int64_t dst_stride, int64_t rows,
                         int64_t width) = 0;
  /// dst[j] = src[rows[j]] (rows of width).
  virtual void gather_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) = 0;
  /// dst[rows[j]] = src[j] (rows of width).
  virtual void scatter_rows(const float* src, std::span<const int32_t> rows, float* dst, int64_t width) = 0;

  // --- KV pool and attention
  /// Writes rows [slots][width] of component `c` of layer `layer` (converted to the component's
  /// element type).
  virtual void kv_write(kv_pool& pool, int32_t layer, int32_t c, std::span<const kv_slot> slots, const float* rows,
                        int64_t width) = 0;
  /// Grouped-query attention of every sequence over the standard K/V components.
  virtual void attention(std::span<const attention_seq> seqs, int n_heads, const kv_pool& pool, int32_t layer,
                         const attention_params& params) = 0;
  /// Absorbed latent attention (kernels/cpu/mla_attention.h) of every (sequence, head) call.
  virtual void mla_attention(std::span<const mla_seq> calls, int32_t kv_lora_rank, int32_t rope_dims, float scale,
                             const kv_pool& pool, int32_t layer) = 0;

  // --- mixture of experts
  /// Routes `rows` rows of router logits; experts and weights come back on the host
  /// ([rows][n_used] each), where the forward pass groups rows by expert.
  virtual void moe_route(const float* logits, int64_t rows, const moe_routing& r, int32_t* experts,
                         float* weights) = 0;
  /// y[t] = sum_j weights[t][j] * expert_out[t][j] (j in choice order), plus shared[t] when
  /// given. expert_out is [rows][k][n].
  virtual void moe_combine(const float* expert_out, const float* weights, int64_t rows, int64_t k, int64_t n,
                           const float* shared, float* y) = 0;

  // --- sampling
  /// One token per row of `logits` ([rows.size()][n_vocab], in the backend's memory): sampler.h's
  /// draw with the row's uniform (draw_with_uniform), and for rows with top_logprobs >= 0 the
  /// chosen token's logprob and that many top ones (logprobs.h's distribution). Only `out`
  /// crosses to the host. A row with top_logprobs < 0 gets its token and an empty top.
  virtual void sample(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
                      std::span<token_logprobs> out) = 0;

  // --- graphs of decode steps (a backend without them keeps these defaults: always eager)
  /// Before a decode step's first op: true when the backend records the step's ops to run them
  /// as one graph at end_graph() (graph_cache.h decides per key), false to run them as called.
  virtual bool begin_graph(const graph_key& /*k*/) { return false; }
  /// After the step's last op (before any download): runs the recorded step. False when the
  /// recording failed: nothing ran, so the caller runs the step again (eagerly).
  virtual bool end_graph() { return true; }
  /// Drops a recording an exception interrupted (nothing of it ran).
  virtual void abort_graph() {}
  virtual graph_stats graph_counters() const { return {}; }
};

/// sample() on host memory with the host sampler's code: the CPU backend's op, and what a
/// device backend's rows must equal where the probabilities agree.
void sample_on_host(const float* logits, int64_t n_vocab, std::span<const sample_row> rows,
                    std::span<token_logprobs> out);

}  // namespace tandem::backend
