#pragma once
/// Scalar IEEE half (fp16) and bfloat16 <-> fp32 conversions, round-to-nearest-even,
/// bit-exact with ggml's reference converters (used by the GGUF writer and make-model).
#include <cstdint>
#include <cstring>

namespace tandem::gguf {

/// fp32 -> IEEE half bits (round to nearest even; overflow becomes infinity, NaN stays NaN).
inline uint16_t fp32_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN: keep NaN quiet and non-zero
    return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u | ((abs >> 13) & 0x3ffu) : 0u));
  }
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {  // result is subnormal (or zero) in half
    if (abs < 0x33000000u) return uint16_t(sign);  // below half of the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
  // normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry into exponent is correct
  return uint16_t(sign | h);
}

/// IEEE half bits -> fp32 (exact).
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t x;
  if (exp == 0) {
    if (mant == 0) {
      x = sign;
    } else {  // subnormal: normalize
      uint32_t e = 113;  // 127 - 15 + 1
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --e;
      }
      x = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    x = sign | 0x7f800000u | (mant << 13);
  } else {
    x = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

/// fp32 -> bfloat16 bits (round to nearest even, NaN stays quiet NaN; as ggml).
inline uint16_t fp32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 64u);
  return uint16_t((x + (0x7fffu + ((x >> 16) & 1u))) >> 16);
}

/// bfloat16 bits -> fp32 (exact).
inline float bf16_to_fp32(uint16_t b) {
  const uint32_t x = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

}  // namespace tandem::gguf
