#pragma once
/// Mixture-of-experts routing (DeepSeek-V2/V3, Qwen-MoE, Mixtral): from a router's logits to
/// the experts each token uses and their weights, as llama.cpp's build_moe_ffn computes them.
/// The expert matmuls themselves are ordinary matmuls on one expert's slice of the stacked
/// expert tensors (expert_slice).
#include <cstdint>

#include "kernels/tensor.h"

namespace tandem::cpu {

/// How router logits become probabilities (llama.cpp's expert_gating_func: 1 softmax,
/// 2 sigmoid).
enum class moe_gating : int32_t { softmax = 1, sigmoid = 2 };

/// One MoE layer's routing rule.
struct moe_routing {
  int32_t n_expert = 0;
  int32_t n_used = 0;                   ///< experts per token (top-k)
  moe_gating gating = moe_gating::softmax;
  bool norm_weights = false;            ///< divide the chosen weights by their sum
  float weights_scale = 1.0f;           ///< then multiply them by this
  const float* selection_bias = nullptr;  ///< [n_expert] added for choosing only (V3's exp_probs_b), or null
};

/// For each of `rows` rows of router logits ([rows][n_expert]), the `n_used` chosen experts in
/// descending order of selection score (ties: the lower id first) into experts[row][n_used],
/// and their weights (probabilities without the selection bias, normalised and scaled as `r`
/// says) into weights[row][n_used]. Throws tandem::error for an invalid rule.
void moe_route(const float* logits, int64_t rows, const moe_routing& r, int32_t* experts, float* weights);

/// Expert `e` of a stacked expert tensor (ne = {cols, rows_per_expert, n_expert}) as a 2-D view
/// of rows_per_expert rows. Throws tandem::error naming the expert if it is out of range.
tensor_view expert_slice(const tensor_view& stacked, int64_t e);

}  // namespace tandem::cpu
