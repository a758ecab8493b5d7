#pragma once
/// Llama-architecture forward pass on the CPU over paged KV.
/// One call serves a batch of sequences, each contributing any number of new tokens
/// (prefill chunks and decode steps mixed). A sequence's results do not depend on what
/// else is in the batch: per-row arithmetic is the same for batch 1 and batch N.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/kv_pool.h"
#include "kernels/tensor.h"

namespace tandem {

/// Hyper-parameters read from `llama.*` metadata.
struct model_config {
  std::string name;  ///< general.name or the file name
  int32_t n_vocab = 0;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t n_ff = 0;
  int32_t n_ctx = 0;  ///< llama.context_length
  int32_t head_dim = 0;
  float rope_freq_base = 10000.0f;
  float rms_eps = 1e-5f;
};

/// One sequence's part of a batch.
struct batch_seq {
  std::span<const int32_t> tokens;  ///< new tokens to run now
  int32_t pos = 0;                  ///< position of tokens[0]; KV of [0, pos) is already in its pages
  std::span<const int32_t> pages;   ///< page table covering positions [0, pos + tokens.size())
  bool want_logits = true;          ///< produce logits of the last new token
};

/// Options for the CPU backend.
struct cpu_options {
  int32_t threads = 1;
  cpu_isa isa = cpu_isa::best;  ///< kernel path; an unsupported one is rejected at construction
  kv_dtype kv = kv_dtype::f32;   ///< element type of the K/V cache the model writes and reads
};

class llama_model {
 public:
  /// Builds the model from a GGUF file (the file must outlive the model: weights stay mmapped).
  /// Throws tandem::error naming the missing tensor/key or unsupported type.
  static std::unique_ptr<llama_model> load(const gguf::file& f, const cpu_options& opt = {});
  virtual ~llama_model() = default;

  virtual const model_config& config() const = 0;
  /// The KV layout this model needs for a given page size.
  virtual kv_layout layout(int32_t page_size) const = 0;
  /// Runs the batch; writes the new tokens' K/V into their pages and returns one row of
  /// n_vocab logits per sequence with want_logits, in batch order.
  virtual void forward(std::span<const batch_seq> batch, kv_pool& pool, std::vector<float>& logits) = 0;
};

}  // namespace tandem
