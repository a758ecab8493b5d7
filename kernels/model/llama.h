#pragma once
/// Dense decoder forward pass (Llama and the architectures shaped like it: Qwen2, Qwen3) over paged KV.
/// One call serves a batch of sequences, each contributing any number of new tokens
/// (prefill chunks and decode steps mixed). A sequence's results do not depend on what
/// else is in the batch: per-row arithmetic is the same for batch 1 and batch N.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/backend/graph_cache.h"
#include "kernels/cpu/isa.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/kv_pools.h"
#include "kernels/model/logprobs.h"
#include "kernels/model/rope_scaling.h"
#include "kernels/tensor.h"

namespace tandem {

namespace backend {
class ops;
}  // namespace backend

/// How RoPE pairs the elements of a head: `normal` rotates adjacent pairs (x[2i], x[2i+1])
/// (Llama, DeepSeek), `neox` rotates the halves (x[i], x[i + head_dim/2]) (Qwen2/3, Gemma,
/// GPT-NeoX); llama.cpp's LLAMA_ROPE_TYPE_NORM / _NEOX.
enum class rope_kind : int32_t { normal = 0, neox = 2 };

/// The FFN's gate activation: SiLU (SwiGLU: Llama, Qwen) or tanh-GELU (GeGLU: Gemma).
enum class ffn_kind : int32_t { silu = 0, gelu = 1 };

/// Hyper-parameters of a dense decoder, read from `<architecture>.*` metadata by the
/// architecture's module (kernels/model/arch/).
struct model_config {
  std::string arch = "llama";  ///< general.architecture
  std::string name;  ///< general.name or the file name
  int32_t n_vocab = 0;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t n_ff = 0;
  int32_t n_ctx = 0;  ///< llama.context_length
  int32_t head_dim = 0;  ///< <arch>.attention.key_length, else n_embd / n_head
  float rope_freq_base = 10000.0f;
  rope_kind rope = rope_kind::normal;
  /// Linear RoPE scaling (`<arch>.rope.scaling.type = linear`): positions are multiplied by
  /// this (1 / rope.scaling.factor).
  float rope_freq_scale = 1.0f;
  /// YaRN (rope_freq_scale is then 1 / yarn.factor for the interpolated pairs).
  yarn_scaling yarn;
  float rms_eps = 1e-5f;
  ffn_kind ffn = ffn_kind::silu;
  // Gemma 2 (all off by default):
  bool scale_embeddings = false;  ///< embeddings multiplied by sqrt(n_embd)
  float attn_scale = 0.0f;        ///< > 0: q multiplied by it before q.k (else 1/sqrt(head_dim))
  float attn_softcap = 0.0f;      ///< > 0: attention scores soft-capped at it
  float final_softcap = 0.0f;     ///< > 0: logits soft-capped at it
  int32_t sliding_window = 0;     ///< > 0: window of the sliding-window layers
  /// Layer l uses the window when l % swa_pattern < swa_pattern - 1 (llama.cpp's pattern: 2 =
  /// every even layer); 0 = no layer does.
  int32_t swa_pattern = 0;
  // DeepSeek-V2/V3 (0 when the architecture has none): multi-head latent attention caches
  // kv_lora_rank + rope_dims floats per token and layer; head_dim is then the query/key head
  // size (nope + rope dims) and v_head_dim the value head size. MoE layers follow
  // n_dense_lead dense ones.
  int32_t q_lora_rank = 0, kv_lora_rank = 0, rope_dims = 0, v_head_dim = 0;
  int32_t n_expert = 0, n_expert_used = 0, n_expert_shared = 0, n_ff_exp = 0, n_dense_lead = 0;
  int32_t expert_gating = 1;  ///< 1 softmax, 2 sigmoid (llama.cpp's expert_gating_func)
  bool expert_weights_norm = false;
  float expert_weights_scale = 1.0f;
  /// True when layer l attends within the sliding window.
  bool is_swa_layer(int32_t l) const {
    return sliding_window > 0 && swa_pattern > 0 && l % swa_pattern < swa_pattern - 1;
  }
};

/// The KV layout a model of config `c` caches: one latent component per position for MLA
/// (kv_lora_rank > 0, f32 only), else K and V of n_head_kv x head_dim in `dtype`. The model and
/// check-config both size pools with it. Throws tandem::error for an f16 cache on MLA.
kv_layout model_kv_layout(const model_config& c, int32_t page_size, kv_dtype dtype);

/// The pools a model of config `c` keeps: one "full" pool of model_kv_layout's geometry holding
/// the full-context layers and, when some layers slide (gemma2), a "window" pool holding those
/// with window_tokens = c.sliding_window. The model and check-config both size pools with it.
kv_pools_layout model_pools_layout(const model_config& c, int32_t page_size, kv_dtype dtype);

/// One sequence's part of a batch.
struct batch_seq {
  std::span<const int32_t> tokens;  ///< new tokens to run now
  int32_t pos = 0;                  ///< position of tokens[0]; KV of [0, pos) is already in its pages
  std::span<const int32_t> pages;   ///< page table covering positions [0, pos + tokens.size())
  bool want_logits = true;          ///< produce logits of the last new token
  /// One page table per pool of a multi-pool layout set (pool p's pages at [p]); empty: `pages`
  /// is pool 0's and the set has one pool. A window pool's table may hold -1 for blocks the
  /// step does not read (kv_pool_spec::first_live_block).
  std::span<const std::span<const int32_t>> pool_pages = {};
  /// Pool p's page table.
  std::span<const int32_t> pages_of(size_t p) const { return pool_pages.empty() ? pages : pool_pages[p]; }
};

/// Options for the CPU backend.
struct cpu_options {
  int32_t threads = 1;
  cpu_isa isa = cpu_isa::best;  ///< kernel path; an unsupported one is rejected at construction
  kv_dtype kv = kv_dtype::f32;   ///< element type of the K/V cache the model writes and reads
  /// The backend to run on instead of the CPU backend of these options (e.g. the CUDA backend,
  /// kernels/backend/cuda); empty: the CPU backend.
  std::function<std::unique_ptr<backend::ops>()> make_backend;
};

class llama_model {
 public:
  /// Builds the model from a GGUF file with the module of its `general.architecture`
  /// (kernels/model/arch/registry.h); the file must outlive the model: weights stay mmapped.
  /// Throws tandem::error naming the missing tensor/key, unsupported type or architecture.
  static std::unique_ptr<llama_model> load(const gguf::file& f, const cpu_options& opt = {});
  virtual ~llama_model() = default;

  virtual const model_config& config() const = 0;
  /// The KV layout of one pool holding every layer (full context) for a given page size.
  virtual kv_layout layout(int32_t page_size) const = 0;
  /// The pools this model keeps its KV in: one full pool for most architectures; gemma2 adds
  /// a window pool for its sliding-window layers. forward() also takes the single-pool set
  /// of layout() (sliding layers then mask full-context pages).
  virtual kv_pools_layout pools_layout(int32_t page_size) const {
    return kv_pools_layout::single(layout(page_size));
  }
  /// Runs the batch; writes the new tokens' K/V into their pages and returns one row of
  /// n_vocab logits per sequence with want_logits, in batch order.
  virtual void forward(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>& logits) = 0;
  /// forward() over the single-pool set of one pool of layout().
  void forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) {
    kv_pools one(pool);
    forward(batch, one, logits);
  }
  /// forward(), then one draw per sequence with want_logits (`rows` in batch order, one each;
  /// sampler.h's sample_row) by the backend where the logits are: a device's logits do not
  /// cross to the host, only the tokens and the logprobs asked. `out[i].token` is row i's token.
  /// Here: forward() and the host sampler; the layered models draw on their backend.
  virtual void forward_sample(std::span<const batch_seq> batch, kv_pools& pools, std::span<const sample_row> rows,
                              std::vector<token_logprobs>& out);
  /// True when activations and logits live in a device's memory (forward_sample saves the
  /// logits' trip to the host there).
  virtual bool on_device() const { return false; }
  /// The backend's decode-step graph counters (all 0 where steps run eagerly).
  virtual backend::graph_stats graph_counters() const { return {}; }

 protected:
  /// Throws tandem::error unless `rows` has one entry per sequence with want_logits.
  static void check_sample_rows(std::span<const batch_seq> batch, std::span<const sample_row> rows);
};

}  // namespace tandem
