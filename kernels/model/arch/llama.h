#pragma once
/// `llama` (Llama 1/2/3, Mistral-style dense models): normal RoPE, optional Llama 3.1+ frequency
/// factors (`rope_freqs.weight`) or linear scaling, tied or untied output.
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

/// The `llama` module.
const architecture& llama_architecture();

}  // namespace tandem::arch
