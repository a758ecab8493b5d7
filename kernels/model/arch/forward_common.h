#pragma once
/// What every architecture's forward pass does the same way around its layers: checking and
/// laying out a batch, and the output head.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kernels/backend/backend.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/llama.h"
#include "kernels/tensor.h"

namespace tandem::arch {

/// A checked batch, flattened: the new tokens in order with their positions and KV slots (one
/// list per pool), the flat index of each sequence's first new token, and the rows whose logits
/// are wanted.
struct batch_plan {
  std::vector<int32_t> tokens, positions;
  std::vector<std::vector<backend::kv_slot>> slots;  ///< [pool][new token]
  std::vector<std::pair<int64_t, const batch_seq*>> starts;  ///< sequences with new tokens
  std::vector<int32_t> last;                                 ///< last token of each wanting logits
  int64_t n_tokens() const { return int64_t(tokens.size()); }
};

/// Refuses a bad batch (check_batch); fills `plan` (its vectors reused between calls).
void plan_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pools& pools, batch_plan& plan);

/// Where one layer's KV lives: its pool, the pool's index in the set, the layer's index in it.
struct layer_kv {
  kv_pool& pool;
  size_t index;
  int32_t layer;
};

/// The output head: the final norm of the planned rows of `x` ([tokens][n_embd]) into `xn`,
/// the output matmul into `out` (one row of n_vocab per plan.last entry, in the backend's
/// memory), then soft-capping when `softcap` > 0.
void output_logits(backend::ops& o, const batch_plan& plan, const float* x, float* xn, const float* norm, float eps,
                   int64_t n_embd, backend::weight_id output, float softcap, int64_t n_vocab, float* out);

/// y = down(act(gate x) * up x) for `rows` rows of x (width the FFN's hidden size): gate and
/// up in one matmul_many through the scratch buffers, the activation SiLU or tanh-GELU.
void gated_ffn(backend::ops& o, backend::weight_id gate, backend::weight_id up, backend::weight_id down, const float* x,
               int64_t rows, int64_t width, ffn_kind act, backend::buffer& gate_buf, backend::buffer& up_buf,
               float* y);

/// A decoder whose forward pass is: embed the new tokens, then per layer x += attention(norm(x))
/// and x += ffn(norm(x)), then the output head; an architecture supplies the parts, written
/// against the backend op table.
class layered_model : public llama_model {
 public:
  const model_config& config() const override { return config_; }
  kv_layout layout(int32_t page_size) const override { return model_kv_layout(config_, page_size, kv_); }
  kv_pools_layout pools_layout(int32_t page_size) const override {
    return model_pools_layout(config_, page_size, kv_);
  }
  using llama_model::forward;
  /// Takes the pools of pools_layout() or the single pool of layout(); refuses any other set
  /// naming both.
  void forward(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>& logits) final;
  /// The logits stay in the backend's memory and its sample op draws there.
  void forward_sample(std::span<const batch_seq> batch, kv_pools& pools, std::span<const sample_row> rows,
                      std::vector<token_logprobs>& out) final;
  bool on_device() const final { return ops_->domain() == backend::memory_domain::device; }
  backend::graph_stats graph_counters() const final { return ops_->graph_counters(); }

 protected:
  layered_model(const model_config& c, kv_dtype kv, std::unique_ptr<backend::ops> ops);

  /// The angles of this step's positions (plan_.positions) into rope_.
  virtual void build_rope(int64_t T) = 0;
  /// Layer l's norm weights before attention and before the FFN.
  virtual const float* attn_norm(int32_t l) const = 0;
  virtual const float* ffn_norm(int32_t l) const = 0;
  /// Layer l's attention of xn_ (the normed input) into tmp_ (T rows each), its KV in `kv`.
  virtual void attention(int32_t l, const layer_kv& kv, int64_t T) = 0;
  /// Layer l's FFN of xn_ into tmp_.
  virtual void ffn(int32_t l, int64_t T) = 0;

  /// Runs the batch up to the logits: into `host` (resized) when given and the backend's memory
  /// is the host's, else into logits_ (the backend's memory). Returns where they are (null
  /// when no row wants logits).
  float* run(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>* host);

  model_config config_;
  kv_dtype kv_;
  std::unique_ptr<backend::ops> ops_;
  // Set by the architecture's constructor:
  tensor_view token_embd_;
  float embed_scale_ = 0.0f;  ///< > 0: embeddings multiplied by it (Gemma)
  std::vector<float> output_norm_;
  backend::weight_id output_;
  float final_softcap_ = 0.0f;
  /// Activations in the backend's memory, reused across calls (one model serves one executor
  /// thread): the residual stream, its normed copy, a layer part's output, logits staging.
  std::unique_ptr<backend::buffer> x_, xn_, tmp_, logits_;
  backend::rope_table rope_;
  batch_plan plan_;
  std::vector<std::pair<size_t, int32_t>> layer_pool_;  ///< per layer: pool index, layer in it
};

}  // namespace tandem::arch
