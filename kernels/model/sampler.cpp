#include "kernels/model/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "actors/common/error.h"

namespace tandem {

std::string sampling_params::validate() const {
  if (!(temperature >= 0.0f && temperature <= 2.0f))
    return fmt::format("temperature {} is out of range; use a value in [0, 2] (0 = greedy)", temperature);
  if (top_k < 0) return fmt::format("top_k {} is out of range; use 0 (off) or a positive count", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f))
    return fmt::format("top_p {} is out of range; use a value in (0, 1] (1 = off)", top_p);
  return {};
}

sampler::sampler(const sampling_params& p) : p_(p), rng_(p.seed) {
  if (auto m = p.validate(); !m.empty()) throw tandem::error(m);
}

int32_t sampler::sample(std::span<const float> logits) {
  if (logits.empty()) throw tandem::error("sampler: empty logits row; the model returned no vocabulary");
  if (p_.temperature == 0.0f || p_.top_k == 1) {
    // max_element returns the first maximum: ties go to the lowest id.
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const int32_t n = int32_t(logits.size());
  scratch_.resize(size_t(n));
  for (int32_t i = 0; i < n; ++i) scratch_[size_t(i)] = {logits[size_t(i)] / p_.temperature, i};
  // Highest first; ties by lowest id so the order (and the draw) is reproducible.
  auto cmp = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int32_t keep = n;
  if (p_.top_k > 0 && p_.top_k < n) {
    keep = p_.top_k;
    std::partial_sort(scratch_.begin(), scratch_.begin() + keep, scratch_.end(), cmp);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), cmp);
  }
  const float mx = scratch_[0].first;
  double sum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    scratch_[size_t(i)].first = std::exp(scratch_[size_t(i)].first - mx);
    sum += scratch_[size_t(i)].first;
  }
  if (p_.top_p < 1.0f) {
    double cum = 0.0;
    int32_t cut = keep;
    for (int32_t i = 0; i < keep; ++i) {
      cum += scratch_[size_t(i)].first / sum;
      if (cum >= double(p_.top_p)) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0.0;
    for (int32_t i = 0; i < keep; ++i) sum += scratch_[size_t(i)].first;
  }
  // Draw with our own uniform from the raw 64-bit output: std distributions differ across
  // standard libraries, this does not.
  const double u = double(rng_() >> 11) * 0x1.0p-53 * sum;
  double cum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    cum += scratch_[size_t(i)].first;
    if (u < cum) return scratch_[size_t(i)].second;
  }
  return scratch_[size_t(keep - 1)].second;
}

}  // namespace tandem
