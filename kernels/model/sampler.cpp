#include "kernels/model/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"

namespace tandem {

std::string sampling_params::validate() const {
  if (!(temperature >= 0.0f && temperature <= 2.0f))
    return fmt::format("temperature {} is out of range; use a value in [0, 2] (0 = greedy)", temperature);
  if (top_k < 0) return fmt::format("top_k {} is out of range; use 0 (off) or a positive count", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f))
    return fmt::format("top_p {} is out of range; use a value in (0, 1] (1 = off)", top_p);
  return {};
}

sampler::sampler(const sampling_params& p) : p_(p), state_(p.seed) {
  if (auto m = p.validate(); !m.empty()) throw tandem::error(m);
}

uint64_t sampler::next_u64() {
  // splitmix64 (Steele, Lea, Flood 2014): full period, well mixed, same on every platform.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

int32_t sampler::sample(std::span<const float> logits) {
  if (logits.empty()) throw tandem::error("sampler: empty logits row; the model returned no vocabulary");
  if (p_.temperature == 0.0f || p_.top_k == 1) {
    // The first maximum (std::max_element's): ties go to the lowest id.
    return int32_t(cpu::argmax(logits.data(), int64_t(logits.size())));
  }
  const int32_t n = int32_t(logits.size());
  if (p_.top_p >= 1.0f && (p_.top_k <= 0 || p_.top_k >= n)) {
    // The whole distribution: no order is needed, walk the ids in order.
    const float inv_t = 1.0f / p_.temperature;
    const float mx = logits[size_t(cpu::argmax(logits.data(), int64_t(logits.size())))] * inv_t;
    probs_.resize(size_t(n));
    double sum = 0.0;
    for (int32_t i = 0; i < n; ++i) {
      probs_[size_t(i)] = std::exp(logits[size_t(i)] * inv_t - mx);
      sum += probs_[size_t(i)];
    }
    const double u = double(next_u64() >> 11) * 0x1.0p-53 * sum;
    double cum = 0.0;
    int32_t last = 0;
    for (int32_t i = 0; i < n; ++i) {
      if (probs_[size_t(i)] <= 0.0f) continue;
      cum += probs_[size_t(i)];
      last = i;
      if (u < cum) return i;
    }
    return last;
  }
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
  const double u = double(next_u64() >> 11) * 0x1.0p-53 * sum;
  double cum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    cum += scratch_[size_t(i)].first;
    if (u < cum) return scratch_[size_t(i)].second;
  }
  return scratch_[size_t(keep - 1)].second;
}

}  // namespace tandem
