#include "transport/chat/jinja_lexer.h"

#include "kernels/base/utf8.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include <fmt/format.h>

#include "transport/chat/jinja_value.h"

namespace tandem::jinja {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

class lexer {
 public:
  lexer(std::string_view source, size_t max_tokens) : max_tokens_(max_tokens) {
    // jinja2 splits on \r\n, \r and \n, rejoins with \n and drops one trailing newline.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t tag = find_tag(pos_);
      std::string text = src_.substr(pos_, tag - pos_);
      if (tag == src_.size()) {
        emit_text(std::move(text), pos_);
        break;
      }
      const char type = src_[tag + 1];
      const char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (sign == '-') {
        while (!text.empty() && is_space(text.back())) text.pop_back();
      } else if (sign != '+' && type != '{') {
        // lstrip_blocks: a block or comment tag preceded on its line only by blanks.
        const size_t l = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l > 0 || line_starting) && l < text.size() &&
            std::all_of(text.begin() + static_cast<long>(l), text.end(), is_space))
          text.resize(l);
      }
      emit_text(std::move(text), pos_);
      size_t p = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (type == '#') {
        const size_t end = src_.find("#}", p);
        if (end == std::string::npos) fail(tag, "missing end of comment tag '#}'");
        const char before = end > p ? src_[end - 1] : '\0';
        pos_ = end + 2;
        if (before == '-') skip_space();
        else if (before != '+' && pos_ < src_.size() && src_[pos_] == '\n') ++pos_;
        line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
        continue;
      }
      push({type == '{' ? tok::var_begin : tok::block_begin, "", 0, 0}, tag);
      pos_ = p;
      line_starting = lex_tag(type == '{', tag);
    }
    push({tok::eof, "", 0, 0}, src_.size());
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i)
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    return src_.size();
  }

  [[noreturn]] void fail(size_t at, const std::string& what) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), at);
    const size_t ls = it == line_starts_.begin() ? 0 : *(it - 1);
    throw error(error_kind::syntax, fmt::format("template syntax error at line {}, column {}: {}",
                                                (it - line_starts_.begin()) + 1, at - ls + 1, what));
  }

  void push(token t, size_t at) {
    if (out_.size() >= max_tokens_)
      throw error(error_kind::limit, fmt::format("the template has more than {} tokens", max_tokens_));
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), at);
    const size_t ls = it == line_starts_.begin() ? 0 : *(it - 1);
    t.line = static_cast<int>(it - line_starts_.begin()) + 1;
    t.col = static_cast<int>(at - ls) + 1;
    out_.push_back(std::move(t));
  }

  void emit_text(std::string text, size_t at) {
    if (!text.empty()) push({tok::text, std::move(text), 0, 0}, at);
  }

  void skip_space() {
    while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
  }

  bool starts(std::string_view s) const { return src_.compare(pos_, s.size(), s) == 0; }

  /// Lexes the inside of a {{ }} or {% %} tag up to and including its end; returns whether
  /// what it consumed ended with a newline (jinja2's line_starting for the next lstrip).
  bool lex_tag(bool var, size_t tag) {
    std::vector<char> balance;
    const std::string_view end = var ? "}}" : "%}";
    for (;;) {
      skip_space();
      if (pos_ >= src_.size()) fail(tag, var ? "unclosed '{{'; add '}}'" : "unclosed '{%'; add '%}'");
      if (balance.empty()) {
        const size_t start = pos_;
        if (src_[pos_] == '-' && src_.compare(pos_ + 1, 2, end) == 0) {
          pos_ += 3;
          skip_space();
        } else if (!var && src_[pos_] == '+' && src_.compare(pos_ + 1, 2, end) == 0) {
          pos_ += 3;
        } else if (starts(end)) {
          pos_ += 2;
          if (!var && pos_ < src_.size() && src_[pos_] == '\n') ++pos_;  // trim_blocks
        }
        if (pos_ != start) {
          push({var ? tok::var_end : tok::block_end, "", 0, 0}, start);
          return src_[pos_ - 1] == '\n';
        }
      }
      lex_one(balance);
    }
  }

  void lex_one(std::vector<char>& balance) {
    const size_t start = pos_;
    const char c = src_[pos_];
    if (is_name_start(c)) {
      while (pos_ < src_.size() && is_name_char(src_[pos_])) ++pos_;
      push({tok::name, src_.substr(start, pos_ - start), 0, 0}, start);
      return;
    }
    if (is_digit(c)) return lex_number(start);
    if (c == '\'' || c == '"') return lex_string(start, c);
    static const std::string_view two[] = {"//", "**", "==", "!=", "<=", ">="};
    for (auto op : two)
      if (starts(op)) {
        pos_ += 2;
        push({tok::op, std::string(op), 0, 0}, start);
        return;
      }
    if (std::string_view("+-*/%~[](){}<>=.:|,;").find(c) == std::string_view::npos)
      fail(start, fmt::format("unexpected character '{}'", c));
    if (c == '(' || c == '[' || c == '{') {
      if (balance.size() >= 256) fail(start, "brackets nest too deeply");
      balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) fail(start, fmt::format("unexpected '{}'", c));
      if (balance.back() != c) fail(start, fmt::format("unexpected '{}', expected '{}'", c, balance.back()));
      balance.pop_back();
    }
    ++pos_;
    push({tok::op, std::string(1, c), 0, 0}, start);
  }

  void digits() {
    while (pos_ < src_.size() && (is_digit(src_[pos_]) || (src_[pos_] == '_' && pos_ + 1 < src_.size() && is_digit(src_[pos_ + 1]))))
      ++pos_;
  }

  void lex_number(size_t start) {
    digits();
    bool real = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
      real = true;
      ++pos_;
      digits();
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t p = pos_ + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && is_digit(src_[p])) {
        real = true;
        pos_ = p;
        digits();
      }
    }
    std::string text;
    for (size_t i = start; i < pos_; ++i)
      if (src_[i] != '_') text += src_[i];
    token t{real ? tok::real : tok::integer, text, 0, 0};
    if (real) {
      t.d = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.i = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail(start, "integer literal out of range");
    }
    push(std::move(t), start);
  }

  void lex_string(size_t start, char q) {
    std::string out;
    ++pos_;
    for (;;) {
      if (pos_ >= src_.size()) fail(start, "unterminated string literal");
      const char c = src_[pos_++];
      if (c == q) break;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= src_.size()) fail(start, "unterminated string literal");
      const char e = src_[pos_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case 'a': out += '\a'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '\n': break;
        case 'x':
        case 'u':
        case 'U': {
          const size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (pos_ + n > src_.size()) fail(start, "truncated \\x/\\u escape");
          uint32_t cp = 0;
          for (size_t k = 0; k < n; ++k) {
            const char h = src_[pos_ + k];
            const int v = is_digit(h) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
            if (v < 0) fail(start, "bad hex digit in a \\x/\\u escape");
            cp = cp * 16 + static_cast<uint32_t>(v);
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) fail(start, "escape names an invalid code point");
          pos_ += n;
          append_utf8(out, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && pos_ < src_.size() && src_[pos_] >= '0' && src_[pos_] <= '7'; ++k)
              cp = cp * 8 + static_cast<uint32_t>(src_[pos_++] - '0');
            append_utf8(out, cp);
          } else {
            out += '\\';  // Python keeps unknown escapes as written
            out += e;
          }
      }
    }
    push({tok::string, std::move(out), 0, 0}, start);
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  size_t pos_ = 0;
  size_t max_tokens_;
  std::vector<token> out_;
};

}  // namespace

std::vector<token> lex(std::string_view source, size_t max_tokens) { return lexer(source, max_tokens).run(); }

}  // namespace tandem::jinja
