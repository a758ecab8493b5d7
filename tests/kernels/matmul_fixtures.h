#pragma once
// Inputs of the matmul tests: seeded random floats and a 2-D tensor view over encoded rows.
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/tensor.h"

namespace tandem::test {

/// `n` floats uniform in [-scale, scale] from `seed`.
inline std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// A [rows][cols] tensor of type `t` over `bytes`.
inline tensor_view view_of(ggml_type t, const std::vector<uint8_t>& bytes, int64_t rows, int64_t cols) {
  tensor_view v;
  v.type = t;
  v.ne[0] = cols;
  v.ne[1] = rows;
  v.n_dims = 2;
  v.data = bytes.data();
  v.nbytes = bytes.size();
  return v;
}

}  // namespace tandem::test
