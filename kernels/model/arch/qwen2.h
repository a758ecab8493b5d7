#pragma once
/// `qwen2` (Qwen1.5 / Qwen2 / Qwen2.5): the Llama block with Q/K/V biases and NeoX RoPE.
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

/// The `qwen2` module.
const architecture& qwen2_architecture();

}  // namespace tandem::arch
