#include <doctest/doctest.h>

#include <algorithm>
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
