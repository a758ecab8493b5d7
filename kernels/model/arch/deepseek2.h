#pragma once
/// `deepseek2` (DeepSeek-V2, V2-Lite, V2.5, V3 and their distillations into the same shape):
/// multi-head latent attention with the KV cache holding only the latent (GGUFs converted with
/// the split `attn_k_b` / `attn_v_b` tensors and `attention.key_length_mla`), optional q LoRA,
/// and a mixture-of-experts FFN with shared experts after `leading_dense_block_count` dense
/// layers, softmax or sigmoid gating and V3's `exp_probs_b` selection bias.
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

/// The `deepseek2` module.
const architecture& deepseek2_architecture();

}  // namespace tandem::arch
