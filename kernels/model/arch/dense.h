#pragma once
/// What the dense decoders (llama, qwen2, qwen3, gemma2) share: the `<arch>.*` hyper-parameter keys
/// and the standard tensor names, as llama.cpp reads them. Each architecture's file adds
/// only what differs.
#include <string_view>

#include "kernels/cpu/llama_cpu.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"

namespace tandem::arch {

/// Reads `<arch>.context_length`, `.embedding_length`, `.block_count`,
/// `.feed_forward_length`, `.attention.head_count[_kv]`, `.attention.key_length` /
/// `.value_length`, `.rope.freq_base`, `.rope.dimension_count`, `.rope.scaling.type` /
/// `.scaling.factor` and `.attention.layer_norm_rms_epsilon`. Throws tandem::error naming the
/// key and the value it needs when the metadata is inconsistent or asks for something this
/// engine does not do (partial RoPE, YaRN scaling, value length != key length).
model_config read_dense_config(const gguf::file& f, std::string_view arch, rope_kind rope);

/// Views of token_embd, output_norm, output (absent = tied), rope_freqs (optional) and each
/// layer's attn_norm, attn_q/k/v, attn_output, ffn_norm, ffn_gate/up/down.
llama_weights read_dense_weights(const gguf::file& f, const model_config& c);

/// The view of `name`, or an empty view (data == nullptr) when the file has no such tensor.
tensor_view optional_tensor(const gguf::file& f, const std::string& name);

}  // namespace tandem::arch
