#include "kernels/model/rope_scaling.h"

#include <cmath>

namespace tandem {

namespace {

/// HF's yarn_get_mscale.
float get_mscale(float scale, float mscale) { return scale <= 1.0f ? 1.0f : 0.1f * mscale * std::log(scale) + 1.0f; }

}  // namespace

float yarn_attn_factor(const yarn_scaling& y, bool deepseek2) {
  if (!y.on()) return y.attn_factor;
  const float factor = y.factor;
  float a;
  if (y.log_mul != 0.0f) {
    // DeepSeek-V2's config has mscale == mscale_all_dim, so the quotient is 1 there.
    const float mscale = deepseek2 && y.log_mul != 1.0f ? y.log_mul : 1.0f;
    a = get_mscale(factor, mscale) / get_mscale(factor, y.log_mul);
  } else {
    a = get_mscale(factor, 1.0f);
  }
  a *= 1.0f / (1.0f + 0.1f * std::log(factor));  // cancels what rope_yarn multiplies in
  return a * y.attn_factor;
}

float yarn_rope_magnitude(const yarn_scaling& y, bool deepseek2) {
  const float a = yarn_attn_factor(y, deepseek2);
  if (!y.on()) return a;
  return a * (1.0f + 0.1f * std::log(1.0f / (1.0f / y.factor)));
}

}  // namespace tandem
