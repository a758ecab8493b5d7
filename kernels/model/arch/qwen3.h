#pragma once
/// `qwen3` (Qwen3 dense): per-head RMSNorm of q and k before NeoX RoPE, no biases, head size
/// from `qwen3.attention.key_length`.
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

/// The `qwen3` module.
const architecture& qwen3_architecture();

}  // namespace tandem::arch
