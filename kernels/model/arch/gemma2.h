#pragma once
/// `gemma2` (Gemma 2): embeddings scaled by sqrt(width), NeoX RoPE, q scaled by
/// 1/sqrt(head size) (1/sqrt(width / heads) for the 46-layer 27B, as llama.cpp), soft-capped
/// attention scores and logits, post-attention and post-FFN norms, a GELU-gated FFN, tied
/// output, and a sliding window on every even layer (`gemma2.attention.sliding_window`).
/// The window is applied as a mask over the full-context pages: those layers do not yet keep
/// their KV in a ring of their own.
#include "kernels/model/arch/registry.h"

namespace tandem::arch {

/// The `gemma2` module.
const architecture& gemma2_architecture();

}  // namespace tandem::arch
