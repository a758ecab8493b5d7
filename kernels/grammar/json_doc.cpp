#include "kernels/grammar/json_doc.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/base/utf8.h"

namespace tandem::grammar {

const json_doc* json_doc::find(std::string_view key) const {
  for (const auto& [k2, v] : obj)
    if (k2 == key) return &v;
  return nullptr;
}

std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = uint8_t(c);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20) out += fmt::format("\\u{:04x}", u);
    else out += c;
  }
  return out + "\"";
}

std::string json_doc::dump() const {
  switch (k) {
    case kind::null:
      return "null";
    case kind::boolean:
      return b ? "true" : "false";
    case kind::number:
      return s;
    case kind::string:
      return json_quote(s);
    case kind::array: {
      std::string out = "[";
      for (size_t i = 0; i < arr.size(); ++i) out += (i ? "," : "") + arr[i].dump();
      return out + "]";
    }
    case kind::object: {
      std::string out = "{";
      for (size_t i = 0; i < obj.size(); ++i) out += (i ? "," : "") + json_quote(obj[i].first) + ":" + obj[i].second.dump();
      return out + "}";
    }
  }
  return "null";
}

namespace {

struct parser {
  std::string_view t;
  size_t i = 0;
  int max_depth;
  [[noreturn]] void fail(std::string_view what) const {
    throw tandem::error(error_kind::failed, fmt::format("invalid JSON at offset {}: {}", i, what));
  }
  void ws() {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\t' || t[i] == '\n' || t[i] == '\r')) ++i;
  }
  bool eat(std::string_view lit) {
    if (t.substr(i, lit.size()) != lit) return false;
    i += lit.size();
    return true;
  }
  uint32_t hex4() {
    if (i + 4 > t.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = t[i++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }
  std::string str() {
    ++i;  // opening quote
    std::string out;
    while (true) {
      if (i >= t.size()) fail("unterminated string");
      char c = t[i++];
      if (c == '"') return out;
      if (uint8_t(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i >= t.size()) fail("unterminated escape");
      char e = t[i++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (!eat("\\u")) fail("lone surrogate");
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("lone surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
  json_doc value(int depth) {
    if (depth > max_depth) fail(fmt::format("nested deeper than {}", max_depth));
    ws();
    if (i >= t.size()) fail("unexpected end");
    json_doc d;
    char c = t[i];
    if (c == '{') {
      d.k = json_doc::kind::object;
      ++i;
      ws();
      if (eat("}")) return d;
      while (true) {
        ws();
        if (i >= t.size() || t[i] != '"') fail("expected a key string");
        std::string key = str();
        ws();
        if (!eat(":")) fail("expected ':'");
        d.obj.emplace_back(std::move(key), value(depth + 1));
        ws();
        if (eat(",")) continue;
        if (eat("}")) return d;
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      d.k = json_doc::kind::array;
      ++i;
      ws();
      if (eat("]")) return d;
      while (true) {
        d.arr.push_back(value(depth + 1));
        ws();
        if (eat(",")) continue;
        if (eat("]")) return d;
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') {
      d.k = json_doc::kind::string;
      d.s = str();
      return d;
    }
    if (eat("true")) return d.k = json_doc::kind::boolean, d.b = true, d;
    if (eat("false")) return d.k = json_doc::kind::boolean, d;
    if (eat("null")) return d;
    const size_t start = i;
    if (i < t.size() && t[i] == '-') ++i;
    auto digits = [&] {
      size_t s0 = i;
      while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i;
      return i > s0;
    };
    if (!digits()) fail("unexpected character");
    if (i < t.size() && t[i] == '.') {
      ++i;
      if (!digits()) fail("digits expected after '.'");
    }
    if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
      ++i;
      if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
      if (!digits()) fail("digits expected in exponent");
    }
    d.k = json_doc::kind::number;
    d.s = std::string(t.substr(start, i - start));
    return d;
  }
};

}  // namespace

json_doc json_doc::parse(std::string_view text, int max_depth) {
  parser p{text, 0, max_depth};
  json_doc d = p.value(0);
  p.ws();
  if (p.i != text.size()) p.fail("trailing characters");
  return d;
}

}  // namespace tandem::grammar
