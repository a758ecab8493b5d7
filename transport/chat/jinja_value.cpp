#include "transport/chat/jinja_value.h"

#include <charconv>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "kernels/base/json.h"

namespace tandem::jinja {

namespace {

/// Nesting bound for repr/json/equality: namespaces may contain themselves.
constexpr int max_nesting = 128;

void check_depth(int depth) {
  if (depth > max_nesting)
    throw op_error{error_kind::limit, fmt::format("a value nests deeper than {} levels (or contains itself)", max_nesting)};
}

std::string repr_string(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) out += std::string("\\") + q;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out += static_cast<char>(c);
  }
  out += q;
  return out;
}

std::string repr_at(const value& v, int depth);

std::string repr_seq(const value& v, int depth) {
  std::string out = v.tuple ? "(" : "[";
  for (size_t i = 0; i < v.l->size(); ++i) {
    if (i) out += ", ";
    out += repr_at((*v.l)[i], depth + 1);
  }
  if (v.tuple && v.l->size() == 1) out += ",";
  out += v.tuple ? ")" : "]";
  return out;
}

std::string repr_at(const value& v, int depth) {
  check_depth(depth);
  switch (v.k) {
    case vkind::string: return repr_string(v.s);
    case vkind::list: return repr_seq(v, depth);
    case vkind::dict: {
      if (v.m->is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (auto& [key, x] : v.m->items) {
        if (!first) out += ", ";
        first = false;
        out += repr_string(key) + ": " + repr_at(x, depth + 1);
      }
      return out + "}";
    }
    default: return to_str(v);
  }
}

/// json.dumps writes DEL (0x7f) raw where the HTTP writer escapes it; `tojson` follows Python.
/// Python's other rules (NaN/Infinity, separators, indent) are json_at's own.
constexpr bool python_escapes_del = false;

void json_at(std::string& out, const value& v, int indent, std::string_view isep, std::string_view ksep, int depth) {
  check_depth(depth);
  auto newline = [&](int level) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent) * static_cast<size_t>(level), ' ');
  };
  switch (v.k) {
    case vkind::none: out += "null"; return;
    case vkind::boolean: out += v.b ? "true" : "false"; return;
    case vkind::integer: out += std::to_string(v.i); return;
    case vkind::real:
      if (std::isnan(v.d)) out += "NaN";
      else if (std::isinf(v.d)) out += v.d > 0 ? "Infinity" : "-Infinity";
      else out += repr_double(v.d);
      return;
    case vkind::string: json::append_quoted(out, v.s, python_escapes_del); return;
    case vkind::list: {
      if (v.generator) break;
      if (v.l->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t i = 0; i < v.l->size(); ++i) {
        if (i) out += isep;
        newline(depth + 1);
        json_at(out, (*v.l)[i], indent, isep, ksep, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case vkind::dict: {
      if (v.m->is_namespace) break;
      if (v.m->items.empty()) { out += "{}"; return; }
      out += '{';
      bool first = true;
      for (auto& [key, x] : v.m->items) {
        if (!first) out += isep;
        first = false;
        newline(depth + 1);
        json::append_quoted(out, key, python_escapes_del);
        out += ksep;
        json_at(out, x, indent, isep, ksep, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default: break;
  }
  type_fail(fmt::format("tojson: a value of type {} is not JSON serializable", type_name(v)));
}

bool equal_at(const value& a, const value& b, int depth) {
  check_depth(depth);
  if (a.is_number() && b.is_number()) {
    if (a.k == vkind::real || b.k == vkind::real) return a.as_double() == b.as_double();
    return (a.k == vkind::boolean ? a.b : a.i) == (b.k == vkind::boolean ? b.b : b.i);
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case vkind::undefined:
    case vkind::none: return true;
    case vkind::string: return a.s == b.s;
    case vkind::list:
      if (a.tuple != b.tuple || a.l->size() != b.l->size()) return false;
      for (size_t i = 0; i < a.l->size(); ++i)
        if (!equal_at((*a.l)[i], (*b.l)[i], depth + 1)) return false;
      return true;
    case vkind::dict:
      if (a.m == b.m) return true;
      if (a.m->is_namespace || b.m->is_namespace || a.m->items.size() != b.m->items.size()) return false;
      for (auto& [key, x] : a.m->items) {
        const value* y = b.m->find(key);
        if (!y || !equal_at(x, *y, depth + 1)) return false;
      }
      return true;
    case vkind::func: return a.f == b.f;
    default: return false;
  }
}

}  // namespace

void type_fail(std::string message) { throw op_error{error_kind::render, std::move(message)}; }

std::string_view to_string(error_kind k) {
  switch (k) {
    case error_kind::syntax: return "syntax";
    case error_kind::render: return "render";
    case error_kind::raised: return "raised";
    case error_kind::limit: return "limit";
  }
  return "render";
}

value value::list(std::vector<value> xs, bool is_tuple) {
  value v;
  v.k = vkind::list;
  v.tuple = is_tuple;
  v.l = std::make_shared<std::vector<value>>(std::move(xs));
  return v;
}

value value::make_dict() {
  value v;
  v.k = vkind::dict;
  v.m = std::make_shared<dict>();
  return v;
}

bool value::truthy() const {
  switch (k) {
    case vkind::undefined:
    case vkind::none: return false;
    case vkind::boolean: return b;
    case vkind::integer: return i != 0;
    case vkind::real: return d != 0;
    case vkind::string: return !s.empty();
    case vkind::list: return generator || !l->empty();
    case vkind::dict: return m->is_namespace || !m->items.empty();
    case vkind::func: return true;
  }
  return false;
}

const value* dict::find(std::string_view key) const {
  for (auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void dict::set(const std::string& key, value v) {
  for (auto& [k, x] : items)
    if (k == key) {
      x = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

const value& call_args::get(size_t idx, std::string_view name) const {
  static const value undef;
  if (idx < pos.size()) return pos[idx];
  for (auto& [k, v] : kw)
    if (k == name) return v;
  return undef;
}

std::string repr_double(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Shortest round-trip digits, then Python's layout: fixed for 1e-4 <= |d| < 1e16.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out += digits + std::string(static_cast<size_t>(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(exp + 1)) + "." + digits.substr(static_cast<size_t>(exp + 1));
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  return out;
}

std::string to_str(const value& v) {
  switch (v.k) {
    case vkind::undefined: return "";
    case vkind::none: return "None";
    case vkind::boolean: return v.b ? "True" : "False";
    case vkind::integer: return std::to_string(v.i);
    case vkind::real: return repr_double(v.d);
    case vkind::string: return v.s;
    case vkind::list:
      if (v.generator) return "<generator object>";
      return repr_at(v, 0);
    case vkind::dict: return repr_at(v, 0);
    case vkind::func: return "<function " + v.f->name + ">";
  }
  return "";
}

std::string repr(const value& v) { return repr_at(v, 0); }

std::string to_json(const value& v, int indent, std::string_view item_sep, std::string_view key_sep) {
  std::string out;
  json_at(out, v, indent, item_sep, key_sep, 0);
  return out;
}

bool equal(const value& a, const value& b) { return equal_at(a, b, 0); }

bool less(const value& a, const value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.k == vkind::string && b.k == vkind::string) return a.s < b.s;  // UTF-8 order = code point order
  if (a.k == vkind::list && b.k == vkind::list) {
    const size_t n = std::min(a.l->size(), b.l->size());
    for (size_t i = 0; i < n; ++i) {
      if (equal((*a.l)[i], (*b.l)[i])) continue;
      return less((*a.l)[i], (*b.l)[i]);
    }
    return a.l->size() < b.l->size();
  }
  type_fail(fmt::format("'<' is not supported between instances of '{}' and '{}'", type_name(a), type_name(b)));
}

std::string_view type_name(const value& v) {
  switch (v.k) {
    case vkind::undefined: return "undefined";
    case vkind::none: return "NoneType";
    case vkind::boolean: return "bool";
    case vkind::integer: return "int";
    case vkind::real: return "float";
    case vkind::string: return "str";
    case vkind::list: return v.generator ? "generator" : v.tuple ? "tuple" : "list";
    case vkind::dict: return v.m->is_namespace ? "Namespace" : "dict";
    case vkind::func: return "function";
  }
  return "?";
}

std::vector<size_t> utf8_offsets(std::string_view s) {
  std::vector<size_t> offs;
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) offs.push_back(i);
  return offs;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s)
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;
  return n;
}

}  // namespace tandem::jinja
