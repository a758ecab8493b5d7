#include "actors/config/toml.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <set>

namespace tandem::toml {

const char* type_name(value_type t) {
  switch (t) {
    case value_type::string: return "string";
    case value_type::integer: return "integer";
    case value_type::floating: return "float";
    case value_type::boolean: return "boolean";
    case value_type::array: return "array";
    case value_type::table: return "table";
  }
  return "value";
}

const value* value::find(std::string_view key) const {
  if (type != value_type::table) return nullptr;
  for (const auto& e : entries)
    if (e.key == key) return &e.val;
  return nullptr;
}

namespace {

std::string quote(const std::string& s) {
  std::string r = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    if (c == '\n') {
      r += "\\n";
      continue;
    }
    r += c;
  }
  return r + "\"";
}

}  // namespace

std::string value::to_source() const {
  switch (type) {
    case value_type::string: return quote(str);
    case value_type::integer: return std::to_string(integer);
    case value_type::floating: return fmt::format("{}", floating);
    case value_type::boolean: return boolean ? "true" : "false";
    case value_type::array: {
      std::string r = "[";
      for (size_t i = 0; i < items.size(); ++i) r += (i ? ", " : "") + items[i].to_source();
      return r + "]";
    }
    case value_type::table: return "{table}";
  }
  return "";
}

parse_error::parse_error(const std::string& source, position pos, const std::string& why)
    : tandem::error(error_kind::failed, fmt::format("{}:{}:{}: {}", source, pos.line, pos.column, why)), pos_(pos) {}

namespace {

bool is_bare_key_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

class parser {
 public:
  parser(std::string_view text, std::string source) : text_(text), source_(std::move(source)) {}

  value run() {
    value root;
    root.type = value_type::table;
    root.pos = {1, 1};
    value* current = &root;
    while (true) {
      skip_blank_lines();
      if (eof()) break;
      if (peek() == '[') {
        current = header(root);
      } else {
        key_value(*current);
      }
      end_of_line();
    }
    return root;
  }

 private:
  // --- cursor
  bool eof() const { return i_ >= text_.size(); }
  char peek(size_t ahead = 0) const { return i_ + ahead < text_.size() ? text_[i_ + ahead] : '\0'; }
  position pos() const { return {line_, int32_t(i_ - line_start_) + 1}; }
  char next() {
    char c = text_[i_++];
    if (c == '\n') {
      ++line_;
      line_start_ = i_;
    }
    return c;
  }
  [[noreturn]] void fail(position p, const std::string& why) const { throw parse_error(source_, p, why); }
  [[noreturn]] void fail(const std::string& why) const { fail(pos(), why); }

  void skip_ws() {
    while (!eof() && (peek() == ' ' || peek() == '\t')) next();
  }
  void skip_comment() {
    if (peek() != '#') return;
    while (!eof() && peek() != '\n') {
      char c = peek();
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\r') || c == 0x7F)
        fail("control character in a comment; remove it");
      next();
    }
  }
  bool at_newline() const { return peek() == '\n' || (peek() == '\r' && peek(1) == '\n'); }
  void eat_newline() {
    if (peek() == '\r') next();
    next();
  }
  void skip_blank_lines() {
    while (true) {
      skip_ws();
      skip_comment();
      if (eof()) return;
      if (at_newline()) {
        eat_newline();
        continue;
      }
      if (peek() == '\r') fail("bare carriage return; use \\n or \\r\\n line endings");
      return;
    }
  }
  /// After a key/value pair or a header only a comment may follow on the line.
  void end_of_line() {
    skip_ws();
    skip_comment();
    if (eof()) return;
    if (!at_newline()) fail(fmt::format("unexpected '{}' after the value; put one key = value per line", peek()));
    eat_newline();
  }

  // --- keys
  std::string key_part() {
    if (peek() == '"') return basic_string();
    if (peek() == '\'') return literal_string();
    size_t start = i_;
    while (!eof() && is_bare_key_char(peek())) next();
    if (i_ == start) {
      if (eof() || at_newline()) fail("expected a key");
      fail(fmt::format("'{}' cannot start a key; bare keys use A-Z a-z 0-9 _ -, others need quotes", peek()));
    }
    return std::string(text_.substr(start, i_ - start));
  }

  /// A dotted path `a.b."c"` in a table header.
  std::vector<std::pair<std::string, position>> dotted_path() {
    std::vector<std::pair<std::string, position>> parts;
    while (true) {
      skip_ws();
      position p = pos();
      parts.emplace_back(key_part(), p);
      skip_ws();
      if (peek() != '.') return parts;
      next();
    }
  }

  static std::string join(const std::vector<std::pair<std::string, position>>& parts, size_t n) {
    std::string r;
    for (size_t k = 0; k < n; ++k) r += (k ? "." : "") + parts[k].first;
    return r;
  }

  /// Finds or creates the sub-table `name` of `t` while walking a header path.
  value* descend(value& t, const std::string& name, position p, const std::string& path) {
    for (auto& e : t.entries) {
      if (e.key != name) continue;
      if (e.val.type == value_type::table) return &e.val;
      if (e.val.type == value_type::array && e.val.from_array_of_tables) return &e.val.items.back();
      fail(p, fmt::format("'{}' is already a {} (line {}), not a table", path, type_name(e.val.type), e.key_pos.line));
    }
    table_entry e;
    e.key = name;
    e.key_pos = p;
    e.val.type = value_type::table;
    e.val.pos = p;
    t.entries.push_back(std::move(e));
    return &t.entries.back().val;
  }

  /// `[a.b]` or `[[a.b]]`; returns the table that the following key/values fill.
  value* header(value& root) {
    position start = pos();
    next();
    bool array = peek() == '[';
    if (array) next();
    auto parts = dotted_path();
    if (peek() != ']') fail(fmt::format("expected ']' to close the table header, got '{}'", peek()));
    next();
    if (array) {
      if (peek() != ']') fail("expected ']]' to close the array-of-tables header");
      next();
    }
    // Paths of tables include the index of each array-of-tables element they pass through,
    // so `[node.x]` under the second `[[node]]` is a different table than under the first.
    value* t = &root;
    std::string ident;
    for (size_t k = 0; k + 1 < parts.size(); ++k) {
      t = descend(*t, parts[k].first, parts[k].second, join(parts, k + 1));
      ident += "." + parts[k].first;
      if (const value* v = find_entry(root, ident); v && v->type == value_type::array)
        ident += "#" + std::to_string(v->items.size() - 1);
    }
    const std::string& last = parts.back().first;
    position last_pos = parts.back().second;
    std::string path = join(parts, parts.size());
    for (auto& e : t->entries) {
      if (e.key != last) continue;
      if (array) {
        if (e.val.type != value_type::array || !e.val.from_array_of_tables)
          fail(last_pos, fmt::format("[[{}]]: '{}' is already a {} (line {}); an array of tables cannot extend it",
                                     path, path, e.val.type == value_type::table ? "table" : type_name(e.val.type),
                                     e.key_pos.line));
        value elt;
        elt.type = value_type::table;
        elt.pos = start;
        elt.from_array_of_tables = true;
        e.val.items.push_back(std::move(elt));
        return &e.val.items.back();
      }
      if (e.val.type != value_type::table)
        fail(last_pos, fmt::format("[{}]: '{}' is already {} (line {}){}", path, path,
                                   e.val.from_array_of_tables ? "an array of tables" : std::string("a ") + type_name(e.val.type),
                                   e.key_pos.line, e.val.from_array_of_tables ? fmt::format("; write [[{}]]", path) : ""));
      if (!defined_.insert(ident + "." + last).second)
        fail(start, fmt::format("table [{}] is defined twice (first at line {}); merge the two", path, e.key_pos.line));
      return &e.val;
    }
    table_entry e;
    e.key = last;
    e.key_pos = last_pos;
    e.val.pos = start;
    if (array) {
      e.val.type = value_type::array;
      e.val.from_array_of_tables = true;
      value elt;
      elt.type = value_type::table;
      elt.pos = start;
      elt.from_array_of_tables = true;
      e.val.items.push_back(std::move(elt));
      t->entries.push_back(std::move(e));
      return &t->entries.back().val.items.back();
    }
    e.val.type = value_type::table;
    defined_.insert(ident + "." + last);
    t->entries.push_back(std::move(e));
    return &t->entries.back().val;
  }

  /// Follows an identity path like ".a.b" (array elements are not entered); for header bookkeeping.
  static const value* find_entry(const value& root, const std::string& ident) {
    const value* t = &root;
    size_t k = 1;
    while (t && k <= ident.size()) {
      size_t dot = ident.find('.', k);
      std::string part = ident.substr(k, dot == std::string::npos ? std::string::npos : dot - k);
      if (auto hash = part.find('#'); hash != std::string::npos) {
        const value* arr = t->find(part.substr(0, hash));
        if (!arr || arr->type != value_type::array) return nullptr;
        size_t idx = std::stoul(part.substr(hash + 1));
        t = idx < arr->items.size() ? &arr->items[idx] : nullptr;
      } else {
        t = t->find(part);
      }
      if (dot == std::string::npos) break;
      k = dot + 1;
    }
    return t;
  }

  void key_value(value& table) {
    position kp = pos();
    std::string key = key_part();
    skip_ws();
    if (peek() == '.')
      fail(fmt::format("dotted key '{}.…' is not supported; put the keys under a [{}] table header", key, key));
    if (peek() != '=') fail(fmt::format("expected '=' after key '{}'", key));
    next();
    skip_ws();
    if (eof() || at_newline()) fail(fmt::format("key '{}' has no value", key));
    for (const auto& e : table.entries)
      if (e.key == key)
        fail(kp, fmt::format("key '{}' is defined twice (first at line {}); keep one", key, e.key_pos.line));
    table_entry e;
    e.key = std::move(key);
    e.key_pos = kp;
    e.val = parse_value(0);
    table.entries.push_back(std::move(e));
  }

  // --- values
  value parse_value(int depth) {
    if (depth > 16) fail("arrays nested deeper than 16 levels");
    value v;
    v.pos = pos();
    char c = peek();
    if (c == '"') {
      v.type = value_type::string;
      v.str = basic_string();
    } else if (c == '\'') {
      v.type = value_type::string;
      v.str = literal_string();
    } else if (c == '[') {
      v.type = value_type::array;
      array(v, depth);
    } else if (c == '{') {
      fail("inline tables { ... } are not supported; use a [table] header");
    } else if (text_.substr(i_, 4) == "true" && !is_bare_key_char(peek(4))) {
      v.type = value_type::boolean;
      v.boolean = true;
      i_ += 4;
    } else if (text_.substr(i_, 5) == "false" && !is_bare_key_char(peek(5))) {
      v.type = value_type::boolean;
      i_ += 5;
    } else {
      number(v);
    }
    return v;
  }

  void array(value& v, int depth) {
    next();  // '['
    while (true) {
      skip_blank_lines();
      if (eof()) fail(v.pos, "array is not closed; add ']'");
      if (peek() == ']') {
        next();
        return;
      }
      v.items.push_back(parse_value(depth + 1));
      skip_blank_lines();
      if (peek() == ',') {
        next();
        continue;
      }
      if (peek() == ']') {
        next();
        return;
      }
      if (eof()) fail(v.pos, "array is not closed; add ']'");
      fail(fmt::format("expected ',' or ']' in the array, got '{}'", peek()));
    }
  }

  std::string basic_string() {
    position start = pos();
    if (text_.substr(i_, 3) == "\"\"\"") fail("multi-line strings \"\"\" are not supported; use one line with \\n");
    next();
    std::string out;
    while (true) {
      if (eof() || at_newline() || peek() == '\r') fail(start, "string is not closed on its line; add '\"'");
      char c = next();
      if (c == '"') return out;
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7F)
        fail("control character in a string; escape it");
      if (c != '\\') {
        out += c;
        continue;
      }
      position esc = pos();
      if (eof()) fail(start, "string is not closed; add '\"'");
      char e = next();
      switch (e) {
        case 'b': out += '\b'; break;
        case 't': out += '\t'; break;
        case 'n': out += '\n'; break;
        case 'f': out += '\f'; break;
        case 'r': out += '\r'; break;
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case 'u':
        case 'U': {
          int n = e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int k = 0; k < n; ++k) {
            char h = peek();
            int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10 : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
            if (d < 0) fail(fmt::format("\\{} needs {} hex digits", e, n));
            cp = cp * 16 + uint32_t(d);
            next();
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail(esc, "escape is not a Unicode scalar value");
          append_utf8(out, cp);
          break;
        }
        default: fail(esc, fmt::format("unknown escape '\\{}'; use \\\\ for a backslash", e));
      }
    }
  }

  std::string literal_string() {
    position start = pos();
    if (text_.substr(i_, 3) == "'''") fail("multi-line strings ''' are not supported");
    next();
    size_t from = i_;
    while (true) {
      if (eof() || at_newline() || peek() == '\r') fail(start, "string is not closed on its line; add \"'\"");
      char c = peek();
      if (c == '\'') break;
      if ((static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7F) fail("control character in a string");
      next();
    }
    std::string out(text_.substr(from, i_ - from));
    next();
    return out;
  }

  void number(value& v) {
    size_t start = i_;
    while (!eof() && (is_bare_key_char(peek()) || peek() == '+' || peek() == '.' || peek() == ':')) next();
    std::string tok(text_.substr(start, i_ - start));
    if (tok.empty()) fail(v.pos, fmt::format("'{}' does not start a value (string, number, boolean or array)", peek()));
    std::string body = (tok[0] == '+' || tok[0] == '-') ? tok.substr(1) : tok;
    bool neg = tok[0] == '-';
    if (body == "inf" || body == "nan") {
      v.type = value_type::floating;
      v.floating = body == "inf" ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
      if (neg) v.floating = -v.floating;
      return;
    }
    if (tok.find(':') != std::string::npos ||
        (tok.size() >= 10 && tok[4] == '-' && tok[0] >= '0' && tok[0] <= '9'))
      fail(v.pos, fmt::format("'{}': dates and times are not supported; use a string", tok));
    auto bad = [&](const char* why) -> void {
      fail(v.pos, fmt::format("'{}' is not a value: {}; strings need quotes", tok, why));
    };
    if (body.empty() || !(body[0] >= '0' && body[0] <= '9')) bad("a number starts with a digit");
    // Underscores only between digits.
    std::string digits;
    for (size_t k = 0; k < body.size(); ++k) {
      if (body[k] == '_') {
        auto digit = [&](size_t j) { return j < body.size() && std::isxdigit(static_cast<unsigned char>(body[j])); };
        if (k == 0 || !digit(k - 1) || !digit(k + 1)) bad("'_' must sit between digits");
        continue;
      }
      digits += body[k];
    }
    if (digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'o' || digits[1] == 'b')) {
      if (tok[0] == '+' || tok[0] == '-') bad("hex/octal/binary integers take no sign");
      int base = digits[1] == 'x' ? 16 : digits[1] == 'o' ? 8 : 2;
      uint64_t u = 0;
      auto [p, ec] = std::from_chars(digits.data() + 2, digits.data() + digits.size(), u, base);
      if (ec == std::errc::result_out_of_range || u > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(v.pos, fmt::format("'{}' does not fit a 64-bit integer", tok));
      if (ec != std::errc() || p != digits.data() + digits.size()) bad("bad digit for its base");
      v.type = value_type::integer;
      v.integer = int64_t(u);
      return;
    }
    bool is_float = digits.find_first_of(".eE") != std::string::npos;
    for (char ch : digits)
      if (!(std::isdigit(static_cast<unsigned char>(ch)) || ch == '.' || ch == 'e' || ch == 'E' || ch == '+' || ch == '-'))
        bad("unexpected character");
    size_t int_end = digits.find_first_of(".eE");
    std::string int_part = digits.substr(0, int_end);
    if (int_part.size() > 1 && int_part[0] == '0') bad("leading zeros are not allowed");
    std::string full = (neg ? "-" : "") + digits;
    if (!is_float) {
      int64_t r = 0;
      auto [p, ec] = std::from_chars(full.data(), full.data() + full.size(), r);
      if (ec == std::errc::result_out_of_range) fail(v.pos, fmt::format("'{}' does not fit a 64-bit integer", tok));
      if (ec != std::errc() || p != full.data() + full.size()) bad("not an integer");
      v.type = value_type::integer;
      v.integer = r;
      return;
    }
    if (int_end != std::string::npos && digits[int_end] == '.') {
      if (int_end + 1 >= digits.size() || !std::isdigit(static_cast<unsigned char>(digits[int_end + 1])))
        bad("a '.' must be followed by digits");
    }
    double d = 0;
    auto [p, ec] = std::from_chars(full.data(), full.data() + full.size(), d);
    if (ec != std::errc() || p != full.data() + full.size()) bad("not a number");
    if (!std::isfinite(d)) fail(v.pos, fmt::format("'{}' overflows a double", tok));
    v.type = value_type::floating;
    v.floating = d;
  }

  std::string_view text_;
  std::string source_;
  size_t i_ = 0;
  int32_t line_ = 1;
  size_t line_start_ = 0;
  std::set<std::string> defined_;  ///< identities of tables defined by a [header]
};

}  // namespace

value parse(std::string_view text, const std::string& source_name) {
  // A BOM at the start is allowed by TOML; skip it so columns stay right.
  if (text.substr(0, 3) == "\xEF\xBB\xBF") text.remove_prefix(3);
  return parser(text, source_name).run();
}

}  // namespace tandem::toml
