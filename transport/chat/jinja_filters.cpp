// Jinja filters as jinja2 3.1 defines them, with Hugging Face's `tojson` (json.dumps with
// ensure_ascii=False; separators ", "/": " or ","/": " with an indent).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "transport/chat/jinja_eval.h"
#include "transport/chat/jinja_strings.h"

namespace tandem::jinja {

namespace {

const value& arg(const call_args& a, size_t i, std::string_view name) { return a.get(i, name); }

bool flag(const value& v, bool dflt) { return v.undefined() ? dflt : v.truthy(); }

value generator(std::vector<value> xs) {
  value v = value::list(std::move(xs));
  v.generator = true;
  return v;
}

/// Resolves "a.b.0" on `item` as jinja2's make_attrgetter does (item lookup, then attribute).
value attribute_of(evaluator& ev, const value& item, const std::string& path) {
  value cur = item;
  size_t i = 0;
  for (;;) {
    const size_t dot = path.find('.', i);
    std::string part = path.substr(i, dot == std::string::npos ? std::string::npos : dot - i);
    value key = value::string(part);
    if (!part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }) && part.size() < 18)
      key = value::integer(std::stoll(part));
    cur = ev.get_item(cur, key);
    if (dot == std::string::npos) return cur;
    i = dot + 1;
  }
}

std::string attr_name(const value& v) {
  if (v.k != vkind::string) type_fail("attribute= must be a string");
  return v.s;
}

/// select/reject/selectattr/rejectattr: `attr` set for the *attr forms.
value select(evaluator& ev, const value& seq, const call_args& a, bool want, bool by_attr) {
  size_t first = 0;
  std::string attr;
  if (by_attr) {
    attr = attr_name(arg(a, 0, "attribute"));
    first = 1;
  }
  std::string test;
  call_args rest;
  if (a.pos.size() > first) {
    if (a.pos[first].k != vkind::string) type_fail("the test name must be a string");
    test = a.pos[first].s;
    rest.pos.assign(a.pos.begin() + static_cast<long>(first) + 1, a.pos.end());
  }
  std::vector<value> out;
  if (!seq.truthy()) return generator({});  // jinja2: `if value:` before iterating
  for (auto& item : iterate(seq)) {
    ev.step();
    value subject = by_attr ? attribute_of(ev, item, attr) : item;
    const bool ok = test.empty() ? subject.truthy() : ev.test(test, subject, rest);
    if (ok == want) out.push_back(item);
  }
  return generator(std::move(out));
}

std::string sort_key_str(const value& v, bool case_sensitive) {
  return case_sensitive ? v.s : py_lower(v.s);
}

/// Ordering of sort/dictsort/unique keys: strings compare case-insensitively by default.
bool key_less(const value& a, const value& b, bool case_sensitive) {
  if (a.k == vkind::string && b.k == vkind::string) return sort_key_str(a, case_sensitive) < sort_key_str(b, case_sensitive);
  return less(a, b);
}

std::string indent(const std::string& s, const std::string& pad, bool first, bool blank) {
  // jinja2 appends a newline, then splitlines(): a trailing newline survives, with no pad.
  std::vector<std::string> lines;
  const std::string t = s + "\n";
  size_t i = 0;
  while (i < t.size()) {
    size_t j = i;
    while (j < t.size() && t[j] != '\n' && t[j] != '\r' && t[j] != '\v' && t[j] != '\f' && !(t[j] >= '\x1c' && t[j] <= '\x1e')) ++j;
    lines.push_back(t.substr(i, j - i));
    if (j < t.size() && t[j] == '\r' && j + 1 < t.size() && t[j + 1] == '\n') ++j;
    i = j + 1;
  }
  std::string rv;
  if (blank) {
    for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + pad : "") + lines[k];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t k = 1; k < lines.size(); ++k) rv += "\n" + (lines[k].empty() ? "" : pad + lines[k]);
  }
  return first ? pad + rv : rv;
}

value to_int(const value& v, const value& dflt) {
  const value d = dflt.undefined() ? value::integer(0) : dflt;
  switch (v.k) {
    case vkind::integer: return v;
    case vkind::boolean: return value::integer(v.b);
    case vkind::real:
      if (!std::isfinite(v.d) || std::fabs(v.d) >= 9.2e18) return d;
      return value::integer(static_cast<int64_t>(v.d));
    case vkind::string: {
      std::string t = py_strip(v.s, nullptr, true, true);
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      if (t.empty()) return d;
      char* end = nullptr;
      errno = 0;
      const long long x = std::strtoll(t.c_str(), &end, 10);
      if (errno == 0 && *end == '\0') return value::integer(x);
      errno = 0;
      const double f = std::strtod(t.c_str(), &end);
      if (errno == 0 && *end == '\0' && std::isfinite(f) && std::fabs(f) < 9.2e18) return value::integer(static_cast<int64_t>(f));
      return d;
    }
    default: return d;
  }
}

value to_float(const value& v, const value& dflt) {
  const value d = dflt.undefined() ? value::real(0) : dflt;
  if (v.is_number()) return value::real(v.as_double());
  if (v.k == vkind::string) {
    std::string t = py_strip(v.s, nullptr, true, true);
    char* end = nullptr;
    const double f = std::strtod(t.c_str(), &end);
    if (!t.empty() && *end == '\0') return value::real(f);
  }
  return d;
}

}  // namespace

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

std::string jinja_title(const std::string& s) {
  std::string out = s;
  bool at_start = true;
  for (char& c : out) {
    if (py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<') {
      at_start = true;
    } else if (at_start) {
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
      at_start = false;
    } else if (c >= 'A' && c <= 'Z') {
      c = static_cast<char>(c - 'A' + 'a');
    }
  }
  return out;
}

}  // namespace

value builtin_filter(evaluator& ev, std::string_view name, const value& v, const call_args& a) {
  auto str_result = [&](std::string s) {
    ev.check_size(s.size());
    ev.step(s.size() / 256);
    return value::string(std::move(s));
  };
  if (name == "default" || name == "d") {
    const bool boolean = flag(arg(a, 1, "boolean"), false);
    if (v.undefined() || (boolean && !v.truthy())) {
      const value& dv = arg(a, 0, "default_value");
      return dv.undefined() ? value::string("") : dv;
    }
    return v;
  }
  if (name == "safe") {
    value out = value::string(to_str(v));
    out.safe = true;
    return out;
  }
  if (name == "string") return str_result(to_str(v));
  if (name == "tojson") {
    const value& ind = arg(a, 1, "indent");
    const value& seps = arg(a, 2, "separators");
    if (flag(arg(a, 3, "sort_keys"), false)) type_fail("tojson: sort_keys is not supported");
    int width = -1;
    if (ind.k == vkind::integer) width = static_cast<int>(std::clamp<int64_t>(ind.i, 0, 64));
    else if (!ind.undefined() && ind.k != vkind::none) type_fail("tojson: indent must be an integer");
    std::string isep = width >= 0 ? "," : ", ", ksep = ": ";
    if (seps.k == vkind::list && seps.l->size() == 2 && (*seps.l)[0].k == vkind::string && (*seps.l)[1].k == vkind::string) {
      isep = (*seps.l)[0].s;
      ksep = (*seps.l)[1].s;
    }
    return str_result(to_json(v, width, isep, ksep));
  }
  if (name == "trim") {
    const value& chars = arg(a, 0, "chars");
    return value::string(py_strip(to_str(v), chars.k == vkind::string ? &chars.s : nullptr, true, true));
  }
  if (name == "upper") return value::string(py_upper(to_str(v)));
  if (name == "lower") return value::string(py_lower(to_str(v)));
  if (name == "capitalize") return value::string(py_capitalize(to_str(v)));
  if (name == "title") return value::string(jinja_title(to_str(v)));
  if (name == "escape" || name == "e") {
    if (v.k == vkind::string && v.safe) return v;
    value out = str_result(html_escape(to_str(v)));
    out.safe = true;
    return out;
  }
  if (name == "length" || name == "count") {
    switch (v.k) {
      case vkind::string: return value::integer(static_cast<int64_t>(utf8_length(v.s)));
      case vkind::list:
        if (v.generator) break;
        return value::integer(static_cast<int64_t>(v.l->size()));
      case vkind::dict: return value::integer(static_cast<int64_t>(v.m->items.size()));
      case vkind::undefined: return value::integer(0);
      default: break;
    }
    type_fail(fmt::format("object of type '{}' has no len()", type_name(v)));
  }
  if (name == "replace") {
    const value& o = arg(a, 0, "old");
    const value& n = arg(a, 1, "new");
    const value& c = arg(a, 2, "count");
    if (o.k != vkind::string || n.k != vkind::string) type_fail("replace needs two strings");
    return str_result(py_replace(to_str(v), o.s, n.s, c.k == vkind::integer ? static_cast<long>(c.i) : -1,
                                 ev.lim().max_output_bytes));
  }
  if (name == "indent") {
    const value& w = arg(a, 0, "width");
    std::string pad = w.k == vkind::string ? w.s : std::string(static_cast<size_t>(std::clamp<int64_t>(w.undefined() ? 4 : to_int(w, {}).i, 0, 256)), ' ');
    const std::string s = to_str(v);
    ev.check_size(s.size() * (pad.size() + 1) + pad.size());
    return str_result(indent(s, pad, flag(arg(a, 1, "first"), false), flag(arg(a, 2, "blank"), false)));
  }
  if (name == "join") {
    const value& sep = arg(a, 0, "d");
    const value& attr = arg(a, 1, "attribute");
    std::string out;
    bool first = true;
    for (auto& item : iterate(v)) {
      ev.step();
      if (!first) out += sep.undefined() ? "" : to_str(sep);
      first = false;
      out += to_str(attr.undefined() ? item : attribute_of(ev, item, attr_name(attr)));
      ev.check_size(out.size());
    }
    return str_result(std::move(out));
  }
  if (name == "first" || name == "last") {
    auto items = iterate(v);
    if (items.empty()) return value();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") return value::list(iterate(v));
  if (name == "reverse") {
    if (v.k == vkind::string) {
      auto items = iterate(v);
      std::string out;
      for (auto it = items.rbegin(); it != items.rend(); ++it) out += it->s;
      return value::string(std::move(out));
    }
    auto items = iterate(v);
    std::reverse(items.begin(), items.end());
    return value::list(std::move(items));
  }
  if (name == "items") {
    if (v.undefined()) return value::list({});
    if (v.k != vkind::dict || v.m->is_namespace) type_fail(fmt::format("items: expected a mapping, got {}", type_name(v)));
    std::vector<value> xs;
    for (auto& [k, x] : v.m->items) xs.push_back(value::list({value::string(k), x}, true));
    return value::list(std::move(xs));
  }
  if (name == "dictsort") {
    if (v.k != vkind::dict || v.m->is_namespace) type_fail(fmt::format("dictsort: expected a mapping, got {}", type_name(v)));
    const bool cs = flag(arg(a, 0, "case_sensitive"), false);
    const value& by = arg(a, 1, "by");
    const bool by_value = by.k == vkind::string && by.s == "value";
    const bool rev = flag(arg(a, 2, "reverse"), false);
    std::vector<value> xs;
    for (auto& [k, x] : v.m->items) xs.push_back(value::list({value::string(k), x}, true));
    std::stable_sort(xs.begin(), xs.end(), [&](const value& p, const value& q) {
      const value& x = (*p.l)[by_value ? 1 : 0];
      const value& y = (*q.l)[by_value ? 1 : 0];
      return rev ? key_less(y, x, cs) : key_less(x, y, cs);
    });
    return value::list(std::move(xs));
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const size_t off = name == "sort" ? 1 : 0;  // sort(reverse, case_sensitive, attribute)
    const bool rev = name == "sort" && flag(arg(a, 0, "reverse"), false);
    const bool cs = flag(arg(a, off, "case_sensitive"), false);
    const value& attr = arg(a, off + 1, "attribute");
    auto items = iterate(v);
    ev.step(items.size());
    auto key = [&](const value& x) { return attr.undefined() ? x : attribute_of(ev, x, attr_name(attr)); };
    if (name == "unique") {
      std::vector<value> out, seen;
      for (auto& x : items) {
        value k = key(x);
        if (k.k == vkind::string && !cs) k.s = py_lower(k.s);
        bool dup = false;
        for (auto& s : seen) dup = dup || equal(s, k);
        ev.step(seen.size() / 64);
        if (!dup) {
          seen.push_back(k);
          out.push_back(x);
        }
      }
      return generator(std::move(out));
    }
    if (name == "sort") {
      std::stable_sort(items.begin(), items.end(),
                       [&](const value& x, const value& y) { return rev ? key_less(key(y), key(x), cs) : key_less(key(x), key(y), cs); });
      return value::list(std::move(items));
    }
    if (items.empty()) return value();
    value best = items[0];
    for (auto& x : items)
      if (name == "min" ? key_less(key(x), key(best), cs) : key_less(key(best), key(x), cs)) best = x;
    return best;
  }
  if (name == "map") {
    std::vector<value> out;
    const value& attr = arg(a, 99, "attribute");
    std::string f;
    call_args rest;
    if (attr.undefined()) {
      if (a.pos.empty() || a.pos[0].k != vkind::string) type_fail("map needs a filter name or attribute=");
      f = a.pos[0].s;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
    }
    if (!v.truthy()) return generator({});
    for (auto& item : iterate(v)) {
      ev.step();
      if (!attr.undefined()) {
        value x = attribute_of(ev, item, attr_name(attr));
        const value& dflt = arg(a, 99, "default");
        out.push_back(x.undefined() && !dflt.undefined() ? dflt : x);
      } else {
        out.push_back(ev.filter(f, item, rest));
      }
    }
    return generator(std::move(out));
  }
  if (name == "select" || name == "reject") return select(ev, v, a, name == "select", false);
  if (name == "selectattr" || name == "rejectattr") return select(ev, v, a, name == "selectattr", true);
  if (name == "attr") return ev.get_attr(v, attr_name(arg(a, 0, "name")));
  if (name == "int") return to_int(v, arg(a, 0, "default"));
  if (name == "float") return to_float(v, arg(a, 0, "default"));
  if (name == "abs") {
    if (v.k == vkind::real) return value::real(std::fabs(v.d));
    if (v.k == vkind::integer && v.i != INT64_MIN) return value::integer(v.i < 0 ? -v.i : v.i);
    if (v.k == vkind::boolean) return value::integer(v.b);
    type_fail(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
  }
  if (name == "round") {
    if (!v.is_number()) type_fail("round needs a number");
    const value& p = arg(a, 0, "precision");
    const int prec = p.k == vkind::integer ? static_cast<int>(std::clamp<int64_t>(p.i, 0, 15)) : 0;
    const double scale = std::pow(10.0, prec);
    return value::real(std::nearbyint(v.as_double() * scale) / scale);
  }
  if (name == "sum") {
    value acc = arg(a, 1, "start").undefined() ? value::integer(0) : arg(a, 1, "start");
    const value& attr = arg(a, 0, "attribute");
    for (auto& x : iterate(v)) {
      const value item = attr.undefined() ? x : attribute_of(ev, x, attr_name(attr));
      if (!item.is_number() || !acc.is_number()) type_fail("sum needs numbers");
      acc = (acc.k == vkind::real || item.k == vkind::real) ? value::real(acc.as_double() + item.as_double())
                                                            : value::integer(static_cast<int64_t>(acc.as_double() + item.as_double()));
    }
    return acc;
  }
  type_fail(fmt::format("no filter named '{}'", name));
}

}  // namespace tandem::jinja
