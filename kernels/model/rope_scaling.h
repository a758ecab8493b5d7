#pragma once
/// RoPE context-extension parameters a model file declares (read by the architecture layer,
/// applied by the backends' RoPE tables).
#include <cstdint>

namespace tandem {

/// YaRN RoPE scaling (`<arch>.rope.scaling.type = yarn`), with llama.cpp's defaults for the
/// keys a file leaves out.
struct yarn_scaling {
  float factor = 0.0f;       ///< rope.scaling.factor (> 1); 0 = no YaRN
  int32_t orig_ctx = 0;      ///< rope.scaling.original_context_length: the trained context
  float beta_fast = 32.0f;   ///< rope.scaling.yarn_beta_fast: pairs turning faster keep their angle
  float beta_slow = 1.0f;    ///< rope.scaling.yarn_beta_slow: pairs turning slower are interpolated
  float log_mul = 0.0f;      ///< rope.scaling.yarn_log_multiplier (DeepSeek's mscale_all_dim)
  float attn_factor = 1.0f;  ///< rope.scaling.attn_factor
  bool on() const { return factor > 0.0f; }
};

/// The cos/sin magnitude llama.cpp's YaRN RoPE ends with for `y` (its context's attn_factor
/// times rope_yarn's own 1 + 0.1 ln(factor)): 1 + 0.1 ln(factor) for a plain YaRN model,
/// about 1 for DeepSeek (whose attention scale carries the correction instead), times
/// y.attn_factor. `deepseek2`: llama.cpp's special case for that architecture.
float yarn_rope_magnitude(const yarn_scaling& y, bool deepseek2);

/// llama.cpp's attn_factor for `y` before rope_yarn multiplies it (see yarn_rope_magnitude).
float yarn_attn_factor(const yarn_scaling& y, bool deepseek2);

}  // namespace tandem
