#include "kernels/base/json.h"

#include "kernels/base/utf8.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tandem::json {

std::string_view kind_name(kind k) {
  switch (k) {
    case kind::null: return "null";
    case kind::boolean: return "boolean";
    case kind::number: return "number";
    case kind::string: return "string";
    case kind::array: return "array";
    case kind::object: return "object";
  }
  return "null";
}

const value* value::find(std::string_view key) const {
  if (k != kind::object) return nullptr;
  for (auto& [n, v] : obj)
    if (n == key) return &v;
  return nullptr;
}

namespace {

/// Length of the UTF-8 sequence at s[i], or 0 if invalid there.
size_t utf8_len(std::string_view s, size_t i) {
  auto at = [&](size_t j) { return static_cast<unsigned char>(s[j]); };
  unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t j = 1; j < n; ++j) {
    if ((at(i + j) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (at(i + j) & 0x3F);
  }
  static constexpr uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

class parser {
 public:
  parser(std::string_view t, int max_depth) : t_(t), max_depth_(max_depth) {}

  value document() {
    value v = parse_value(0);
    skip_ws();
    if (p_ != t_.size()) fail("unexpected trailing characters after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw parse_error(what + " at byte offset " + std::to_string(p_));
  }
  void skip_ws() {
    while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t' || t_[p_] == '\n' || t_[p_] == '\r')) ++p_;
  }
  bool eat(char c) {
    skip_ws();
    if (p_ < t_.size() && t_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  void expect_word(std::string_view w) {
    if (t_.substr(p_, w.size()) != w) fail("invalid literal");
    p_ += w.size();
  }

  value parse_value(int depth) {
    if (depth > max_depth_) fail("JSON nested deeper than " + std::to_string(max_depth_) + " levels");
    skip_ws();
    if (p_ >= t_.size()) fail("unexpected end of input");
    value v;
    char c = t_[p_];
    if (c == '{') {
      ++p_;
      v.k = kind::object;
      if (eat('}')) return v;
      do {
        skip_ws();
        if (p_ >= t_.size() || t_[p_] != '"') fail("expected a string key");
        std::string key = parse_string();
        if (v.find(key)) fail("duplicate key \"" + key + "\"");
        if (!eat(':')) fail("expected ':' after an object key");
        v.obj.emplace_back(std::move(key), parse_value(depth + 1));
      } while (eat(','));
      if (!eat('}')) fail("expected ',' or '}' in an object");
    } else if (c == '[') {
      ++p_;
      v.k = kind::array;
      if (eat(']')) return v;
      do {
        v.arr.push_back(parse_value(depth + 1));
      } while (eat(','));
      if (!eat(']')) fail("expected ',' or ']' in an array");
    } else if (c == '"') {
      v.k = kind::string;
      v.s = parse_string();
    } else if (c == 't') {
      expect_word("true");
      v.k = kind::boolean;
      v.b = true;
    } else if (c == 'f') {
      expect_word("false");
      v.k = kind::boolean;
    } else if (c == 'n') {
      expect_word("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      parse_number(v);
    } else {
      fail(std::string("unexpected character '") + (c >= 0x20 && c < 0x7f ? std::string(1, c) : "?") + "'");
    }
    return v;
  }

  void parse_number(value& v) {
    size_t start = p_;
    auto digit = [&] { return p_ < t_.size() && t_[p_] >= '0' && t_[p_] <= '9'; };
    if (t_[p_] == '-') ++p_;
    if (!digit()) fail("invalid number");
    if (t_[p_] == '0') {
      ++p_;
      if (digit()) fail("invalid number: leading zero");
    } else {
      while (digit()) ++p_;
    }
    bool integral = true;
    if (p_ < t_.size() && t_[p_] == '.') {
      integral = false;
      ++p_;
      if (!digit()) fail("invalid number: digit expected after '.'");
      while (digit()) ++p_;
    }
    if (p_ < t_.size() && (t_[p_] == 'e' || t_[p_] == 'E')) {
      integral = false;
      ++p_;
      if (p_ < t_.size() && (t_[p_] == '+' || t_[p_] == '-')) ++p_;
      if (!digit()) fail("invalid number: digit expected in exponent");
      while (digit()) ++p_;
    }
    v.s.assign(t_.substr(start, p_ - start));
    v.k = kind::number;
    v.num = std::strtod(v.s.c_str(), nullptr);
    if (!std::isfinite(v.num)) fail("number out of range");
    if (integral) {
      errno = 0;
      char* end = nullptr;
      long long ll = std::strtoll(v.s.c_str(), &end, 10);
      if (errno == 0 && end && *end == '\0') {
        v.is_int = true;
        v.i = ll;
      }
    }
  }

  uint32_t hex4() {
    if (p_ + 4 > t_.size()) fail("truncated \\u escape");
    uint32_t r = 0;
    for (int j = 0; j < 4; ++j) {
      char c = t_[p_++];
      r <<= 4;
      if (c >= '0' && c <= '9') r |= c - '0';
      else if (c >= 'a' && c <= 'f') r |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') r |= c - 'A' + 10;
      else fail("invalid hex digit in \\u escape");
    }
    return r;
  }

  std::string parse_string() {
    ++p_;  // opening quote
    std::string out;
    while (true) {
      if (p_ >= t_.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(t_[p_]);
      if (c == '"') {
        ++p_;
        return out;
      }
      if (c < 0x20) fail("unescaped control character in a string");
      if (c == '\\') {
        ++p_;
        if (p_ >= t_.size()) fail("unterminated escape");
        char e = t_[p_++];
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
            if (cp >= 0xDC00 && cp <= 0xDFFF) fail("lone low surrogate in \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (t_.substr(p_, 2) != "\\u") fail("high surrogate not followed by a low surrogate");
              p_ += 2;
              uint32_t lo = hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) fail("high surrogate not followed by a low surrogate");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            append_utf8(out, cp);
            break;
          }
          default: fail("invalid escape");
        }
        continue;
      }
      size_t n = utf8_len(t_, p_);
      if (n == 0) fail("invalid UTF-8 in a string");
      out.append(t_.substr(p_, n));
      p_ += n;
    }
  }

  std::string_view t_;
  size_t p_ = 0;
  int max_depth_;
};

}  // namespace

value parse(std::string_view text, int max_depth) {
  if (!valid_utf8(text)) {
    // Name the first bad byte so the client can find it.
    size_t i = 0;
    while (i < text.size()) {
      size_t n = utf8_len(text, i);
      if (n == 0) break;
      i += n;
    }
    throw parse_error("request body is not valid UTF-8 at byte offset " + std::to_string(i));
  }
  return parser(text, max_depth).document();
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_len(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

void append_quoted(std::string& out, std::string_view s, bool escape_del) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (c == 0x7f && escape_del)) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

std::string quote(std::string_view s, bool escape_del) {
  std::string out;
  out.reserve(s.size() + 2);
  append_quoted(out, s, escape_del);
  return out;
}

namespace {

void dump_to(std::string& out, const value& v) {
  switch (v.k) {
    case kind::null: out += "null"; return;
    case kind::boolean: out += v.b ? "true" : "false"; return;
    case kind::number: out += v.s; return;
    case kind::string: append_quoted(out, v.s, false); return;
    case kind::array:
      out += '[';
      for (size_t i = 0; i < v.arr.size(); ++i) {
        if (i) out += ',';
        dump_to(out, v.arr[i]);
      }
      out += ']';
      return;
    case kind::object:
      out += '{';
      for (size_t i = 0; i < v.obj.size(); ++i) {
        if (i) out += ',';
        append_quoted(out, v.obj[i].first, false);
        out += ':';
        dump_to(out, v.obj[i].second);
      }
      out += '}';
      return;
  }
}

}  // namespace

std::string value::dump() const {
  std::string out;
  dump_to(out, *this);
  return out;
}

void writer::sep() {
  if (need_comma_) out_ += ',';
  need_comma_ = true;
}
writer& writer::begin_object() {
  sep();
  out_ += '{';
  need_comma_ = false;
  return *this;
}
writer& writer::end_object() {
  out_ += '}';
  need_comma_ = true;
  return *this;
}
writer& writer::begin_array() {
  sep();
  out_ += '[';
  need_comma_ = false;
  return *this;
}
writer& writer::end_array() {
  out_ += ']';
  need_comma_ = true;
  return *this;
}
writer& writer::key(std::string_view k) {
  sep();
  append_quoted(out_, k);
  out_ += ':';
  need_comma_ = false;
  return *this;
}
writer& writer::str(std::string_view v) {
  sep();
  append_quoted(out_, v);
  return *this;
}
writer& writer::num(int64_t v) {
  sep();
  out_ += std::to_string(v);
  return *this;
}
writer& writer::real(double v) {
  sep();
  if (!std::isfinite(v)) {
    out_ += "null";
    return *this;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  out_ += buf;
  return *this;
}
writer& writer::boolean(bool v) {
  sep();
  out_ += v ? "true" : "false";
  return *this;
}
writer& writer::null() {
  sep();
  out_ += "null";
  return *this;
}
writer& writer::raw(std::string_view json) {
  sep();
  out_ += json;
  return *this;
}

}  // namespace tandem::json
