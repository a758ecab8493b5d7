#pragma once
/// Block sizes of every ggml tensor type, so the GGUF reader can validate the byte size of
/// tensors Tandem cannot compute with (q4_K, iq2_xs, ...) instead of rejecting the file.
#include <cstdint>
#include <string_view>

namespace tandem::gguf {

struct type_traits {
  std::string_view name;
  int64_t block_size = 0;  ///< elements per block; 0 = unknown type
  uint64_t type_size = 0;  ///< bytes per block
};

/// Traits of ggml type id `t` (block_size 0 if the id is unknown or was removed from ggml).
constexpr type_traits traits(uint32_t t) {
  switch (t) {
    case 0: return {"f32", 1, 4};
    case 1: return {"f16", 1, 2};
    case 2: return {"q4_0", 32, 18};
    case 3: return {"q4_1", 32, 20};
    case 6: return {"q5_0", 32, 22};
    case 7: return {"q5_1", 32, 24};
    case 8: return {"q8_0", 32, 34};
    case 9: return {"q8_1", 32, 36};
    case 10: return {"q2_K", 256, 84};
    case 11: return {"q3_K", 256, 110};
    case 12: return {"q4_K", 256, 144};
    case 13: return {"q5_K", 256, 176};
    case 14: return {"q6_K", 256, 210};
    case 15: return {"q8_K", 256, 292};
    case 16: return {"iq2_xxs", 256, 66};
    case 17: return {"iq2_xs", 256, 74};
    case 18: return {"iq3_xxs", 256, 98};
    case 19: return {"iq1_s", 256, 50};
    case 20: return {"iq4_nl", 32, 18};
    case 21: return {"iq3_s", 256, 110};
    case 22: return {"iq2_s", 256, 82};
    case 23: return {"iq4_xs", 256, 136};
    case 24: return {"i8", 1, 1};
    case 25: return {"i16", 1, 2};
    case 26: return {"i32", 1, 4};
    case 27: return {"i64", 1, 8};
    case 28: return {"f64", 1, 8};
    case 29: return {"iq1_m", 256, 56};
    case 30: return {"bf16", 1, 2};
    case 34: return {"tq1_0", 256, 54};
    case 35: return {"tq2_0", 256, 66};
    case 39: return {"mxfp4", 32, 17};
    default: return {"unknown", 0, 0};
  }
}

/// Name of ggml type id `t` ("q4_K", ...; "unknown" if unknown).
constexpr std::string_view type_name(uint32_t t) { return traits(t).name; }

}  // namespace tandem::gguf
