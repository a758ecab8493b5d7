#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "kernels/model/logprobs.h"
#include "kernels/model/sampler.h"

using namespace tandem;

namespace {

/// Naive reference: probabilities by direct softmax of logits / T, then their log.
std::vector<double> naive_logprobs(std::vector<float> logits, const sampling_params& p, const token_history& h) {
  apply_logit_processing(logits, p, h);
  const double t = p.temperature > 0.0f ? double(p.temperature) : 1.0;
  double sum = 0.0;
  for (float l : logits) sum += std::exp(double(l) / t);
  std::vector<double> out;
  for (float l : logits) out.push_back(std::log(std::exp(double(l) / t) / sum));
  return out;
}

std::vector<float> row() { return {0.1f, 2.0f, -1.0f, 2.0f, 1.5f, 0.0f, 1.9f, -3.0f}; }

}  // namespace

TEST_CASE("logprobs: equal the naive softmax, top entries sorted with ties to the lowest id") {
  for (float t : {0.0f, 0.5f, 1.0f, 1.7f}) {
    sampling_params p;
    p.temperature = t;
    auto ref = naive_logprobs(row(), p, {});
    auto lp = compute_logprobs(row(), p, {}, 4, 5);
    CHECK(lp.token == 4);
    CHECK(lp.logprob == doctest::Approx(ref[4]).epsilon(1e-5));
    REQUIRE(lp.top.size() == 5);
    // 2.0 at ids 1 and 3 (tie: 1 first), then 1.9 (6), 1.5 (4), 0.1 (0).
    const int32_t want[] = {1, 3, 6, 4, 0};
    for (size_t i = 0; i < 5; ++i) {
      CHECK(lp.top[i].token == want[i]);
      CHECK(lp.top[i].logprob == doctest::Approx(ref[size_t(want[i])]).epsilon(1e-5));
    }
    double total = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) total += std::exp(double(compute_logprobs(row(), p, {}, int32_t(i), 0).logprob));
    CHECK(total == doctest::Approx(1.0).epsilon(1e-5));
  }
}

TEST_CASE("logprobs: at temperature 0 the first top entry is the sampler's greedy choice, also under bias and penalties") {
  sampling_params p;
  p.temperature = 0.0f;
  p.logit_bias = {{1, -100.0f}};
  p.frequency_penalty = 1.0f;
  std::vector<int32_t> gen = {3, 3};
  token_history h{{}, gen};
  sampler s(p);
  const int32_t greedy = s.sample(row(), h);
  CHECK(greedy == 6);  // 1 is biased away, 3 penalized by 2.0 below 1.9
  auto lp = compute_logprobs(row(), p, h, greedy, 3);
  REQUIRE(!lp.top.empty());
  CHECK(lp.top[0].token == greedy);
  CHECK(lp.top[0].logprob == lp.logprob);
  auto ref = naive_logprobs(row(), p, h);
  CHECK(lp.logprob == doctest::Approx(ref[6]).epsilon(1e-5));
  // Without the processing the raw distribution would differ: the processed one is reported.
  auto raw = compute_logprobs(row(), sampling_params{}, {}, 6, 0);
  CHECK(raw.logprob != doctest::Approx(lp.logprob));
}

TEST_CASE("logprobs: top_n is clamped to 20 and the vocabulary, 0 gives none, an invalid choice gives no token") {
  std::vector<float> big(100);
  for (size_t i = 0; i < big.size(); ++i) big[i] = float(i % 7);
  CHECK(compute_logprobs(big, {}, {}, 0, 50).top.size() == 20);
  CHECK(compute_logprobs(row(), {}, {}, 0, 50).top.size() == 8);
  CHECK(compute_logprobs(row(), {}, {}, 0, 0).top.empty());
  CHECK(compute_logprobs(row(), {}, {}, -1, 1).token == -1);
  // Large logits stay finite (log-sum-exp around the maximum).
  std::vector<float> huge = {1000.0f, 999.0f};
  auto lp = compute_logprobs(huge, {}, {}, 1, 2);
  CHECK(std::isfinite(lp.logprob));
  CHECK(lp.logprob == doctest::Approx(-1.0 - std::log1p(std::exp(-1.0))).epsilon(1e-5));
}
