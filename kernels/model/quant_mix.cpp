#include "kernels/model/quant_mix.h"

#include <cstdlib>

namespace tandem {

namespace {

// llama.cpp's use_more_bits: the first and last eighth of the layers and every third between.
bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

// The layer of "blk.<i>.<...>", -1 for other names.
int layer_of(const std::string& name) {
  if (name.rfind("blk.", 0) != 0) return -1;
  return std::atoi(name.c_str() + 4);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

ggml_type weight_type(ggml_type dtype, bool q4_k_m, const std::string& name, int64_t ne0, int n_layer,
                      bool has_output) {
  ggml_type t = dtype;
  if (q4_k_m) {
    t = ggml_type::q4_K;
    const int layer = layer_of(name);
    if (name == "output.weight" || (!has_output && name == "token_embd.weight")) t = ggml_type::q6_K;
    else if ((ends_with(name, ".attn_v.weight") || ends_with(name, ".ffn_down.weight")) && layer >= 0 &&
             use_more_bits(layer, n_layer))
      t = ggml_type::q6_K;
  }
  const int64_t block = block_elems(t);
  if (block > 1 && ne0 % block != 0) t = ne0 % q8_0_block == 0 ? ggml_type::q8_0 : ggml_type::f16;
  return t;
}

uint32_t llama_file_type(ggml_type dtype, bool q4_k_m) {
  if (q4_k_m) return 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M
  switch (dtype) {
    case ggml_type::f16: return 1;    // MOSTLY_F16
    case ggml_type::q4_0: return 2;   // MOSTLY_Q4_0
    case ggml_type::q8_0: return 7;   // MOSTLY_Q8_0
    case ggml_type::q4_K: return 14;  // MOSTLY_Q4_K_S
    case ggml_type::q5_K: return 16;  // MOSTLY_Q5_K_S
    case ggml_type::q6_K: return 18;  // MOSTLY_Q6_K
    case ggml_type::bf16: return 32;  // MOSTLY_BF16
    default: return 0;                // ALL_F32
  }
}

}  // namespace tandem
