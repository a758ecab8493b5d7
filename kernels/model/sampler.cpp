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
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    return fmt::format("presence_penalty {} is out of range; use a value in [-2, 2] (0 = off)", presence_penalty);
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    return fmt::format("frequency_penalty {} is out of range; use a value in [-2, 2] (0 = off)", frequency_penalty);
  if (!(repetition_penalty > 0.0f && repetition_penalty <= 2.0f))
    return fmt::format("repetition_penalty {} is out of range; use a value in (0, 2] (1 = off)", repetition_penalty);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return fmt::format("min_p {} is out of range; use a value in [0, 1] (0 = off)", min_p);
  if (logit_bias.size() > max_logit_bias_entries)
    return fmt::format("logit_bias has {} entries; at most {} are allowed", logit_bias.size(), max_logit_bias_entries);
  for (const auto& [id, b] : logit_bias) {
    if (id < 0) return fmt::format("logit_bias token id {} is out of range; ids are >= 0", id);
    if (!(b >= -100.0f && b <= 100.0f))
      return fmt::format("logit_bias value {} for token {} is out of range; use a value in [-100, 100]", b, id);
  }
  return {};
}

bool sampling_params::processes_logits() const {
  return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f || min_p > 0.0f ||
         !logit_bias.empty();
}

void apply_logit_processing(std::span<float> logits, const sampling_params& p, const token_history& h) {
  const int64_t n = int64_t(logits.size());
  auto in_row = [n](int32_t id) { return id >= 0 && id < n; };
  for (const auto& [id, b] : p.logit_bias)
    if (in_row(id)) logits[size_t(id)] += b;
  if (p.repetition_penalty != 1.0f) {
    // Each distinct token once (llama.cpp and HF penalize the set, not the count).
    std::vector<int32_t> seen;
    seen.reserve(h.prompt.size() + h.generated.size());
    seen.insert(seen.end(), h.prompt.begin(), h.prompt.end());
    seen.insert(seen.end(), h.generated.begin(), h.generated.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int32_t id : seen) {
      if (!in_row(id)) continue;
      float& l = logits[size_t(id)];
      l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::vector<int32_t> gen(h.generated.begin(), h.generated.end());
    std::sort(gen.begin(), gen.end());
    for (size_t i = 0; i < gen.size();) {
      size_t j = i;
      while (j < gen.size() && gen[j] == gen[i]) ++j;
      if (in_row(gen[i]))
        logits[size_t(gen[i])] -= float(j - i) * p.frequency_penalty + p.presence_penalty;
      i = j;
    }
  }
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

double sampler::next_uniform() { return double(next_u64() >> 11) * 0x1.0p-53; }

double sampler::first_uniform(uint64_t seed) {
  sampler s{sampling_params{}};
  s.state_ = seed;
  return s.next_uniform();
}

bool samples_raw(const sampling_params& p) { return !p.processes_logits() && !p.grammar.active(); }

sample_row sample_row_of(const sampling_params& p, int32_t top_logprobs) {
  return sample_row{.temperature = p.temperature,
                    .top_k = p.top_k,
                    .top_p = p.top_p,
                    .top_logprobs = top_logprobs,
                    .uniform = sampler::first_uniform(p.seed)};
}

sampling_params params_of(const sample_row& r) {
  sampling_params p;
  p.temperature = r.temperature;
  p.top_k = r.top_k;
  p.top_p = r.top_p;
  return p;
}

int32_t draw_with_uniform(const sample_row& r, std::span<const float> logits) {
  if (logits.empty()) throw tandem::error("sampler: empty logits row; the model returned no vocabulary");
  if (!(r.uniform >= 0.0 && r.uniform < 1.0))
    throw tandem::error(fmt::format("sampler: uniform draw {} is outside [0, 1)", r.uniform));
  sampler s(params_of(r));
  return s.draw_with(logits, r.uniform);
}

int32_t sampler::sample(std::span<const float> logits, const token_history& h) {
  if (logits.empty()) throw tandem::error("sampler: empty logits row; the model returned no vocabulary");
  if (!p_.processes_logits()) return draw(logits);
  work_.assign(logits.begin(), logits.end());
  apply_logit_processing(work_, p_, h);
  if (p_.min_p > 0.0f && p_.temperature != 0.0f) {
    // p_i >= min_p * p_max  <=>  l_i / T >= l_max / T + ln(min_p): cut the tail to -inf.
    const float mx = work_[size_t(cpu::argmax(work_.data(), int64_t(work_.size())))];
    const float cut = mx + p_.temperature * std::log(p_.min_p);
    for (auto& l : work_)
      if (l < cut) l = -INFINITY;
  }
  return draw(work_);
}

int32_t sampler::draw(std::span<const float> logits) {
  // Greedy rows draw nothing (the generator state stays as it was).
  if (p_.temperature == 0.0f || p_.top_k == 1) return draw_with(logits, 0.0);
  return draw_with(logits, next_uniform());
}

int32_t sampler::draw_with(std::span<const float> logits, double u01) {
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
    const double u = u01 * sum;
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
  const double u = u01 * sum;
  double cum = 0.0;
  for (int32_t i = 0; i < keep; ++i) {
    cum += scratch_[size_t(i)].first;
    if (u < cum) return scratch_[size_t(i)].second;
  }
  return scratch_[size_t(keep - 1)].second;
}

}  // namespace tandem
