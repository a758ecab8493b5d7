#pragma once
// Inputs of the matmul tests: seeded random floats, a 2-D tensor view over encoded rows, and
// q4_K / q5_K scale bytes.
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

/// Packs 8 six-bit scales and mins as ggml-common.h documents block_q4_K.scales: bytes 0-3 hold
/// sc0-3 (bits 0-5) and the top bits of sc4-7 (bits 6-7), bytes 4-7 the same for the mins,
/// bytes 8-11 the low 4 bits of sc4-7 (low nibble) and m4-7 (high nibble).
inline void pack_k4_scales(const int* sc, const int* m, uint8_t* out) {
  for (int j = 0; j < 4; ++j) {
    out[j] = uint8_t(sc[j] | (sc[j + 4] >> 4) << 6);
    out[j + 4] = uint8_t(m[j] | (m[j + 4] >> 4) << 6);
    out[j + 8] = uint8_t((sc[j + 4] & 0xF) | (m[j + 4] & 0xF) << 4);
  }
}

}  // namespace tandem::test
