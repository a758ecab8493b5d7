#include <doctest/doctest.h>

#include <algorithm>
#include <span>
#include <vector>

#include "kernels/model/sampler.h"

using namespace tandem;

namespace {
std::vector<float> logits_row() { return {0.1f, 2.0f, -1.0f, 2.0f, 1.5f, 0.0f, 1.9f, -3.0f}; }
}  // namespace

TEST_CASE("sampler: validate names the parameter, the value and the range") {
  CHECK(sampling_params{}.validate().empty());
  sampling_params p;
  p.temperature = 2.5f;
  CHECK(p.validate().find("temperature 2.5") != std::string::npos);
  CHECK(p.validate().find("[0, 2]") != std::string::npos);
  p = {};
  p.top_k = -1;
  CHECK(p.validate().find("top_k -1") != std::string::npos);
  p = {};
  p.top_p = 0.0f;
  CHECK(p.validate().find("top_p 0") != std::string::npos);
  CHECK(p.validate().find("(0, 1]") != std::string::npos);
  CHECK_THROWS(sampler(p));
}

TEST_CASE("sampler: temperature 0 is argmax with ties to the lowest id") {
  sampling_params p;
  p.temperature = 0.0f;
  sampler s(p);
  const auto l = logits_row();
  for (int i = 0; i < 5; ++i) CHECK(s.sample(l) == 1);
}

TEST_CASE("sampler: the same seed gives the same tokens, top_k=1 is greedy, top_k/top_p restrict") {
  const auto l = logits_row();
  sampling_params p;
  p.temperature = 1.0f;
  p.seed = 42;
  sampler a(p), b(p);
  std::vector<int32_t> ta, tb;
  for (int i = 0; i < 200; ++i) {
    ta.push_back(a.sample(l));
    tb.push_back(b.sample(l));
  }
  CHECK(ta == tb);
  // Full softmax at T=1 visits more than the top token.
  CHECK(std::count(ta.begin(), ta.end(), 1) < 200);
  p.seed = 43;
  sampler c(p);
  std::vector<int32_t> tc;
  for (int i = 0; i < 200; ++i) tc.push_back(c.sample(l));
  CHECK(tc != ta);

  p.top_k = 1;
  sampler g(p);
  for (int i = 0; i < 20; ++i) CHECK(g.sample(l) == 1);

  p.top_k = 3;  // ids 1, 3, 6 (2.0, 2.0, 1.9)
  sampler k3(p);
  for (int i = 0; i < 200; ++i) {
    const int32_t t = k3.sample(l);
    REQUIRE((t == 1 || t == 3 || t == 6));
  }
  p.top_k = 0;
  p.top_p = 0.3f;  // the first-ranked token alone has ~0.26 mass, two reach past 0.3
  sampler tp(p);
  for (int i = 0; i < 200; ++i) {
    const int32_t t = tp.sample(l);
    REQUIRE((t == 1 || t == 3));
  }
}

namespace {
/// Greedy decode of a "model" whose logits never change: it prefers 3 (2.0), then 6 (1.9),
/// 1 (1.8), 4 (1.5), so without penalties it repeats 3 forever.
std::vector<int32_t> greedy_run(const sampling_params& p, std::span<const int32_t> prompt, int steps) {
  const std::vector<float> row = {0.1f, 1.8f, -1.0f, 2.0f, 1.5f, 0.0f, 1.9f, -3.0f};
  std::vector<int32_t> out;
  for (int i = 0; i < steps; ++i) {
    sampler s(p);
    out.push_back(s.sample(row, {prompt, out}));
  }
  return out;
}
}  // namespace

TEST_CASE("sampler: validate bounds the penalties, min_p and logit_bias") {
  sampling_params p;
  p.presence_penalty = 2.5f;
  CHECK(p.validate().find("presence_penalty 2.5") != std::string::npos);
  p = {};
  p.frequency_penalty = -3.0f;
  CHECK(p.validate().find("[-2, 2]") != std::string::npos);
  p = {};
  p.repetition_penalty = 0.0f;
  CHECK(p.validate().find("repetition_penalty") != std::string::npos);
  p = {};
  p.min_p = 1.5f;
  CHECK(p.validate().find("min_p") != std::string::npos);
  p = {};
  p.logit_bias = {{3, -101.0f}};
  CHECK(p.validate().find("[-100, 100]") != std::string::npos);
  CHECK_THROWS(sampler(p));
}

TEST_CASE("sampler: penalties change a repetitive greedy output") {
  sampling_params p;
  p.temperature = 0.0f;
  const std::vector<int32_t> prompt = {3, 3, 5};
  CHECK(greedy_run(p, prompt, 6) == std::vector<int32_t>{3, 3, 3, 3, 3, 3});
  p.frequency_penalty = 0.5f;  // 3 falls below 6 (1.9) after one occurrence, 6 below 1 after one
  CHECK(greedy_run(p, prompt, 3) == std::vector<int32_t>{3, 6, 1});
  p = {};
  p.temperature = 0.0f;
  p.presence_penalty = 0.15f;  // 2.0 - 0.15 < 1.9, and 1.85 > 1.8: penalized once, not per count
  CHECK(greedy_run(p, prompt, 4) == std::vector<int32_t>{3, 6, 3, 3});
  p = {};
  p.temperature = 0.0f;
  p.repetition_penalty = 1.2f;  // 3 is in the prompt: 2.0 / 1.2 < 1.9 from the first token
  CHECK(greedy_run(p, prompt, 1) == std::vector<int32_t>{6});
}

TEST_CASE("sampler: a logit_bias of -100 on the greedy token changes it") {
  sampling_params p;
  p.temperature = 0.0f;
  CHECK(greedy_run(p, {}, 1)[0] == 3);
  p.logit_bias = {{3, -100.0f}};
  CHECK(greedy_run(p, {}, 1)[0] == 6);
  p.logit_bias = {{7, 100.0f}};
  CHECK(greedy_run(p, {}, 1)[0] == 7);
}

TEST_CASE("sampler: min_p cuts the tail") {
  const std::vector<float> row = {0.1f, 1.8f, -1.0f, 2.0f, 1.5f, 0.0f, 1.9f, -3.0f};
  // min_p 0.5 keeps l >= 2.0 + ln(0.5) = 1.307: tokens 1, 3, 4, 6.
  auto draws = [&](float min_p) {
    std::vector<int> hits(row.size());
    for (uint64_t seed = 0; seed < 3000; ++seed) {
      sampling_params p;
      p.min_p = min_p;
      p.seed = seed;
      ++hits[size_t(sampler(p).sample(row))];
    }
    return hits;
  };
  auto cut = draws(0.5f);
  for (int id : {0, 2, 5, 7}) CHECK(cut[size_t(id)] == 0);
  for (int id : {1, 3, 4, 6}) CHECK(cut[size_t(id)] > 0);
  auto all = draws(0.0f);
  CHECK(all[0] > 0);
  CHECK(all[5] > 0);
}
