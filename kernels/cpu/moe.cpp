#include "kernels/cpu/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/base/error.h"

namespace tandem::cpu {

void moe_route(const float* logits, int64_t rows, const moe_routing& r, int32_t* experts, float* weights) {
  if (r.n_expert <= 0 || r.n_used <= 0 || r.n_used > r.n_expert)
    throw tandem::error(fmt::format("moe routing: {} experts used of {}; need 1 <= used <= experts", r.n_used,
                                    r.n_expert));
  if (r.gating != moe_gating::softmax && r.gating != moe_gating::sigmoid)
    throw tandem::error(fmt::format("moe routing: gating function {} is not softmax (1) or sigmoid (2)",
                                    int32_t(r.gating)));
  const size_t n = size_t(r.n_expert);
  std::vector<float> probs(n), score(n);
  std::vector<int32_t> order(n);
  for (int64_t row = 0; row < rows; ++row) {
    const float* l = logits + size_t(row) * n;
    if (r.gating == moe_gating::softmax) {
      const float mx = *std::max_element(l, l + n);
      double sum = 0;
      for (size_t i = 0; i < n; ++i) sum += probs[i] = std::exp(l[i] - mx);
      for (size_t i = 0; i < n; ++i) probs[i] = float(probs[i] / sum);
    } else {
      for (size_t i = 0; i < n; ++i) probs[i] = 1.0f / (1.0f + std::exp(-l[i]));
    }
    for (size_t i = 0; i < n; ++i) score[i] = probs[i] + (r.selection_bias != nullptr ? r.selection_bias[i] : 0.0f);
    std::iota(order.begin(), order.end(), 0);
    // Highest score first; equal scores keep the lower id first, so the choice is the same
    // for any batch (the routing of a token depends only on its own logits).
    std::partial_sort(order.begin(), order.begin() + r.n_used, order.end(), [&](int32_t a, int32_t b) {
      return score[size_t(a)] > score[size_t(b)] || (score[size_t(a)] == score[size_t(b)] && a < b);
    });
    int32_t* ex = experts + size_t(row) * size_t(r.n_used);
    float* w = weights + size_t(row) * size_t(r.n_used);
    float total = 0.0f;
    for (int32_t k = 0; k < r.n_used; ++k) {
      ex[k] = order[size_t(k)];
      w[k] = probs[size_t(ex[k])];
      total += w[k];
    }
    for (int32_t k = 0; k < r.n_used; ++k) {
      if (r.norm_weights) w[k] /= total;
      w[k] *= r.weights_scale;
    }
  }
}

tensor_view expert_slice(const tensor_view& stacked, int64_t e) {
  if (e < 0 || e >= stacked.ne[2])
    throw tandem::error(fmt::format("expert {} is outside the stacked tensor's {} experts", e, stacked.ne[2]));
  tensor_view v = stacked;
  v.ne[2] = 1;
  v.ne[3] = 1;
  v.n_dims = 2;
  const size_t bytes = row_bytes(stacked.type, stacked.ne[0]) * size_t(stacked.ne[1]);
  v.data = static_cast<const uint8_t*>(stacked.data) + size_t(e) * bytes;
  v.nbytes = bytes;
  return v;
}

}  // namespace tandem::cpu
