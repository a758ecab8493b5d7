#pragma once
/// What the dense decoders (llama, qwen2, qwen3, gemma2) share: the `<arch>.*` hyper-parameter keys
/// and the standard tensor names, as llama.cpp reads them. Each architecture's file adds
/// only what differs.
#include <memory>
#include <string>
#include <string_view>

#include "kernels/model/arch/dense_forward.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"

namespace tandem::arch {

/// `<arch>.<k>`
std::string key(std::string_view arch, std::string_view k);
/// v as a size, or throws naming key `k` when it is 0 or above 2^30.
int32_t positive(const gguf::file& f, const std::string& k, uint64_t v);
/// The size at key `k`, which must be present.
int32_t required(const gguf::file& f, const std::string& k);

/// The keys every architecture shares: `<arch>.context_length`, `.embedding_length`,
/// `.block_count`, `.feed_forward_length`, `.attention.head_count[_kv]`, `.rope.freq_base`,
/// `.rope.scaling.type` / `.scaling.factor` and `.attention.layer_norm_rms_epsilon` (not the
/// head sizes, which differ: see read_dense_config).
model_config read_base_config(const gguf::file& f, std::string_view arch, rope_kind rope);

/// read_base_config plus the head size: `<arch>.context_length`, `.embedding_length`, `.block_count`,
/// `.feed_forward_length`, `.attention.head_count[_kv]`, `.attention.key_length` /
/// `.value_length`, `.rope.freq_base`, `.rope.dimension_count`, `.rope.scaling.type` /
/// `.scaling.factor` and `.attention.layer_norm_rms_epsilon`. Throws tandem::error naming the
/// key and the value it needs when the metadata is inconsistent or asks for something this
/// engine does not do (partial RoPE, an unknown scaling type, value length != key length).
model_config read_dense_config(const gguf::file& f, std::string_view arch, rope_kind rope);

/// Views of token_embd, output_norm, output (absent = tied), rope_freqs (optional) and each
/// layer's attn_norm, attn_q/k/v, attn_output, ffn_norm, ffn_gate/up/down.
llama_weights read_dense_weights(const gguf::file& f, const model_config& c);

/// The view of `name`, or an empty view (data == nullptr) when the file has no such tensor.
tensor_view optional_tensor(const gguf::file& f, const std::string& name);

/// token_embd's row count, checked against `<arch>.vocab_size` when the file has it.
int32_t vocab_rows(const gguf::file& f, std::string_view arch, const tensor_view& token_embd);

/// The dense CPU model of `w`, after refusing tensors of `f` that `w` does not use.
std::unique_ptr<llama_model> make_dense(const gguf::file& f, const llama_weights& w, const cpu_options& opt);

/// An architecture's `load` from its weight reader.
template <llama_weights (*Read)(const gguf::file&, const model_config&)>
std::unique_ptr<llama_model> load_dense(const gguf::file& f, const model_config& c, const cpu_options& opt) {
  return make_dense(f, Read(f, c), opt);
}

}  // namespace tandem::arch
