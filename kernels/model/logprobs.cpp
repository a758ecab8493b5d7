#include "kernels/model/logprobs.h"

#include <algorithm>
#include <cmath>

#include "kernels/base/error.h"

namespace tandem {

token_logprobs compute_logprobs(std::span<const float> logits, const sampling_params& p, const token_history& h,
                                int32_t chosen, int32_t top_n) {
  if (logits.empty()) throw tandem::error("logprobs: empty logits row; the model returned no vocabulary");
  std::vector<float> row(logits.begin(), logits.end());
  if (p.processes_logits()) apply_logit_processing(row, p, h);
  const double inv_t = p.temperature > 0.0f ? 1.0 / double(p.temperature) : 1.0;
  // log-sum-exp in double around the maximum: stable for any logit range.
  double mx = -INFINITY;
  for (float l : row) mx = std::max(mx, double(l) * inv_t);
  double sum = 0.0;
  if (std::isfinite(mx))
    for (float l : row) sum += std::exp(double(l) * inv_t - mx);
  const double lse = mx + std::log(sum);
  auto lp = [&](int32_t id) { return float(double(row[size_t(id)]) * inv_t - lse); };

  token_logprobs out;
  const int32_t n = int32_t(row.size());
  if (chosen >= 0 && chosen < n) {
    out.token = chosen;
    out.logprob = lp(chosen);
  }
  const int32_t k = std::clamp(top_n, 0, std::min(max_top_logprobs, n));
  if (k == 0) return out;
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) ids[size_t(i)] = i;
  // Highest first, ties by lowest id: the sampler's argmax is first at temperature 0.
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    const float la = row[size_t(a)], lb = row[size_t(b)];
    return la > lb || (la == lb && a < b);
  });
  out.top.reserve(size_t(k));
  for (int32_t i = 0; i < k; ++i) out.top.push_back({ids[size_t(i)], lp(ids[size_t(i)])});
  return out;
}

}  // namespace tandem
