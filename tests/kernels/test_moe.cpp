// MoE routing against hand-computed cases, and expert slices of a stacked tensor against the
// same matrices stored on their own.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"

using namespace tandem;

TEST_CASE("moe: softmax routing picks the top experts with their probabilities") {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f,   // row 0
                                     0.0f, 0.0f, 4.0f, 4.0f};  // row 1: a tie between 2 and 3
  cpu::moe_routing r{.n_expert = 4, .n_used = 2};
  std::vector<int32_t> ex(4);
  std::vector<float> w(4);
  cpu::moe_route(logits.data(), 2, r, ex.data(), w.data());
  const double z0 = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.5);
  CHECK(ex[0] == 1);
  CHECK(ex[1] == 2);
  CHECK(w[0] == doctest::Approx(std::exp(3.0) / z0));
  CHECK(w[1] == doctest::Approx(std::exp(2.0) / z0));
  CHECK(ex[2] == 2);  // equal scores: the lower id first
  CHECK(ex[3] == 3);
  // Normalised and scaled: the chosen weights sum to the scale.
  r.norm_weights = true;
  r.weights_scale = 2.5f;
  cpu::moe_route(logits.data(), 2, r, ex.data(), w.data());
  CHECK(w[0] + w[1] == doctest::Approx(2.5));
  CHECK(w[0] / w[1] == doctest::Approx(std::exp(1.0)));
}

TEST_CASE("moe: sigmoid routing with a selection bias chooses by score, weighs by probability") {
  const std::vector<float> logits = {2.0f, 1.0f, 0.0f};
  const std::vector<float> bias = {0.0f, 0.0f, 1.0f};  // lifts expert 2 above expert 1 for choosing only
  cpu::moe_routing r{.n_expert = 3, .n_used = 2, .gating = cpu::moe_gating::sigmoid, .selection_bias = bias.data()};
  std::vector<int32_t> ex(2);
  std::vector<float> w(2);
  cpu::moe_route(logits.data(), 1, r, ex.data(), w.data());
  CHECK(ex[0] == 2);  // 0.5 + 1
  CHECK(ex[1] == 0);  // 0.88
  CHECK(w[0] == doctest::Approx(0.5));
  CHECK(w[1] == doctest::Approx(1.0 / (1.0 + std::exp(-2.0))));
}

TEST_CASE("moe: invalid routing rules are refused") {
  const float l[2] = {0, 0};
  int32_t ex[2];
  float w[2];
  CHECK_THROWS_WITH(cpu::moe_route(l, 1, cpu::moe_routing{.n_expert = 2, .n_used = 3}, ex, w),
                    doctest::Contains("3 experts used of 2"));
  CHECK_THROWS_WITH(cpu::moe_route(l, 1, cpu::moe_routing{.n_expert = 2, .n_used = 1, .gating = cpu::moe_gating(7)}, ex, w),
                    doctest::Contains("gating function 7"));
}

TEST_CASE("moe: an expert slice multiplies like the matrix stored alone") {
  const int64_t cols = 64, rows = 5, n_expert = 3;
  for (ggml_type t : {ggml_type::f32, ggml_type::f16}) {
    CAPTURE(to_string(t));
    std::vector<uint8_t> stacked;
    std::vector<std::vector<uint8_t>> alone(n_expert);
    for (int64_t e = 0; e < n_expert; ++e)
      for (int64_t i = 0; i < cols * rows; ++i) {
        const float f = std::sin(float(e * 1000 + i)) * 0.5f;
        uint8_t b[4];
        size_t nb = 4;
        if (t == ggml_type::f32) std::memcpy(b, &f, 4);
        else {
          const uint16_t h = cpu::fp32_to_fp16(f);
          std::memcpy(b, &h, 2);
          nb = 2;
        }
        stacked.insert(stacked.end(), b, b + nb);
        alone[size_t(e)].insert(alone[size_t(e)].end(), b, b + nb);
      }
    tensor_view s{.type = t, .ne = {cols, rows, n_expert, 1}, .n_dims = 3, .data = stacked.data(), .nbytes = stacked.size()};
    std::vector<float> x(size_t(cols * 2));
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(float(i));
    std::vector<float> scratch, y1(size_t(rows * 2)), y2(size_t(rows * 2));
    for (int64_t e = 0; e < n_expert; ++e) {
      tensor_view a{.type = t, .ne = {cols, rows, 1, 1}, .n_dims = 2, .data = alone[size_t(e)].data(),
                    .nbytes = alone[size_t(e)].size()};
      cpu::matmul(cpu::expert_slice(s, e), x.data(), 2, y1.data(), scratch);
      cpu::matmul(a, x.data(), 2, y2.data(), scratch);
      CHECK(std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float)) == 0);
    }
    CHECK_THROWS_WITH(cpu::expert_slice(s, 3), doctest::Contains("expert 3 is outside"));
  }
}
