#pragma once
/// UTF-8 helpers for the tokenizers (private to kernels/tokenizer).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::utf8 {

/// Length of the sequence a lead byte announces (1 for continuation/invalid bytes, as llama.cpp).
inline size_t seq_len(uint8_t b) {
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0) return 2;
  if ((b & 0xF0) == 0xE0) return 3;
  if ((b & 0xF8) == 0xF0) return 4;
  return 1;
}

inline std::string encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

/// Result of checking the sequence at s[i]: its length when valid (`ok`), else how many bytes
/// form the invalid maximal subpart, or `incomplete` when the input ends inside a valid prefix.
struct check_result {
  size_t len = 0;
  bool ok = false;
  bool incomplete = false;
  uint32_t cp = 0;
};

inline check_result check(std::string_view s, size_t i) {
  const uint8_t b = uint8_t(s[i]);
  if (b < 0x80) return {1, true, false, b};
  size_t len = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  uint32_t cp = 0;
  if (b >= 0xC2 && b <= 0xDF) { len = 2; cp = b & 0x1F; }
  else if (b == 0xE0) { len = 3; lo = 0xA0; cp = b & 0x0F; }
  else if (b == 0xED) { len = 3; hi = 0x9F; cp = b & 0x0F; }  // no surrogates
  else if (b >= 0xE1 && b <= 0xEF) { len = 3; cp = b & 0x0F; }
  else if (b == 0xF0) { len = 4; lo = 0x90; cp = b & 0x07; }
  else if (b >= 0xF1 && b <= 0xF3) { len = 4; cp = b & 0x07; }
  else if (b == 0xF4) { len = 4; hi = 0x8F; cp = b & 0x07; }
  else return {1, false, false, 0};
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return {k, false, true, 0};
    const uint8_t c = uint8_t(s[i + k]);
    if (c < lo || c > hi) return {k, false, false, 0};
    lo = 0x80;
    hi = 0xBF;
    cp = (cp << 6) | (c & 0x3F);
  }
  return {len, true, false, cp};
}

/// Decodes the code point at s[p]; returns its length, 0 if the bytes there are not valid UTF-8.
inline size_t decode(std::string_view s, size_t p, uint32_t& cp) {
  const check_result r = check(s, p);
  if (!r.ok) return 0;
  cp = r.cp;
  return r.len;
}

/// Appends the valid UTF-8 of `in` to `out`, replacing each invalid maximal subpart with U+FFFD.
/// Unless `final`, stops before an incomplete sequence at the end. Returns the bytes consumed.
inline size_t sanitize(std::string_view in, std::string& out, bool final) {
  size_t i = 0;
  while (i < in.size()) {
    const check_result r = check(in, i);
    if (r.ok) {
      out.append(in.substr(i, r.len));
    } else if (r.incomplete && !final) {
      return i;
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += r.len;
  }
  return i;
}

}  // namespace tandem::utf8
