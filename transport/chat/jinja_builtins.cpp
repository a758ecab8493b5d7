// Jinja tests, str/dict methods, global functions and the Python string operations they
// share with the filters (jinja_filters.cpp).
#include <ctime>

#include <fmt/format.h>

#include "transport/chat/jinja_eval.h"
#include "transport/chat/jinja_strings.h"

namespace tandem::jinja {

// ---- Python string operations ----

bool py_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= '\x1c' && c <= '\x1f');
}

std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  auto strip_me = [&](char c) { return chars ? chars->find(c) != std::string::npos : py_space(c); };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && strip_me(s[b])) ++b;
  if (right)
    while (e > b && strip_me(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

std::string py_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

std::string py_upper(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out = py_lower(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 'a' + 'A');
  return out;
}

std::string py_title(std::string_view s) {
  std::string out(s);
  bool prev_letter = false;
  for (char& c : out) {
    const bool lower = c >= 'a' && c <= 'z', upper = c >= 'A' && c <= 'Z';
    if (lower && !prev_letter) c = static_cast<char>(c - 'a' + 'A');
    else if (upper && prev_letter) c = static_cast<char>(c - 'A' + 'a');
    prev_letter = lower || upper || (static_cast<unsigned char>(c) >= 0x80);
  }
  return out;
}

std::vector<std::string> py_split(std::string_view s, const std::string* sep, long maxsplit) {
  std::vector<std::string> out;
  if (!sep) {
    size_t i = 0;
    while (i < s.size()) {
      while (i < s.size() && py_space(s[i])) ++i;
      if (i >= s.size()) break;
      if (maxsplit >= 0 && static_cast<long>(out.size()) >= maxsplit) {
        out.push_back(py_strip(s.substr(i), nullptr, false, true));
        break;
      }
      size_t j = i;
      while (j < s.size() && !py_space(s[j])) ++j;
      out.emplace_back(s.substr(i, j - i));
      i = j;
    }
    return out;
  }
  if (sep->empty()) type_fail("split: empty separator");
  size_t i = 0;
  for (;;) {
    const size_t j = s.find(*sep, i);
    if (j == std::string_view::npos || (maxsplit >= 0 && static_cast<long>(out.size()) >= maxsplit)) {
      out.emplace_back(s.substr(i));
      return out;
    }
    out.emplace_back(s.substr(i, j - i));
    i = j + sep->size();
  }
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view repl, long count, size_t max_bytes) {
  std::string out;
  auto add = [&](std::string_view piece) {
    if (out.size() + piece.size() > max_bytes)
      throw op_error{error_kind::limit, fmt::format("replace: the result would exceed {} bytes", max_bytes)};
    out += piece;
  };
  long done = 0;
  if (old.empty()) {
    // Python inserts `repl` before every code point and at the end.
    auto offs = utf8_offsets(s);
    for (size_t k = 0; k < offs.size(); ++k) {
      if (count < 0 || done < count) {
        add(repl);
        ++done;
      }
      const size_t end = k + 1 < offs.size() ? offs[k + 1] : s.size();
      add(s.substr(offs[k], end - offs[k]));
    }
    if (count < 0 || done < count) add(repl);
    return out;
  }
  size_t i = 0;
  for (;;) {
    const size_t j = (count < 0 || done < count) ? s.find(old, i) : std::string_view::npos;
    if (j == std::string_view::npos) {
      add(s.substr(i));
      return out;
    }
    add(s.substr(i, j - i));
    add(repl);
    ++done;
    i = j + old.size();
  }
}

// ---- iteration ----

std::vector<value> iterate(const value& v) {
  switch (v.k) {
    case vkind::list: return *v.l;
    case vkind::dict: {
      std::vector<value> keys;
      for (auto& [k, x] : v.m->items) keys.push_back(value::string(k));
      return keys;
    }
    case vkind::string: {
      std::vector<value> chars;
      auto offs = utf8_offsets(v.s);
      for (size_t k = 0; k < offs.size(); ++k) {
        const size_t end = k + 1 < offs.size() ? offs[k + 1] : v.s.size();
        chars.push_back(value::string(v.s.substr(offs[k], end - offs[k])));
      }
      return chars;
    }
    case vkind::undefined: return {};
    default: type_fail(fmt::format("'{}' object is not iterable", type_name(v)));
  }
}

// ---- tests ----

bool builtin_test(evaluator& ev, std::string_view name, const value& v, const call_args& a) {
  const value& arg = a.get(0, "value");
  if (name == "defined") return !v.undefined();
  if (name == "undefined") return v.undefined();
  if (name == "none") return v.k == vkind::none;
  if (name == "boolean") return v.k == vkind::boolean;
  if (name == "true") return v.k == vkind::boolean && v.b;
  if (name == "false") return v.k == vkind::boolean && !v.b;
  if (name == "integer") return v.k == vkind::integer;
  if (name == "float") return v.k == vkind::real;
  if (name == "number") return v.is_number();
  if (name == "string") return v.k == vkind::string;
  if (name == "mapping") return v.k == vkind::dict && !v.m->is_namespace;
  if (name == "iterable" || name == "sequence")
    return v.k == vkind::list || v.k == vkind::string || v.undefined() || (v.k == vkind::dict && !v.m->is_namespace);
  if (name == "callable") return v.k == vkind::func;
  if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return equal(v, arg);
  if (name == "ne" || name == "!=") return !equal(v, arg);
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, arg);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(arg, v);
  if (name == "le" || name == "<=") return !less(arg, v);
  if (name == "ge" || name == ">=") return !less(v, arg);
  if (name == "in") return ev.compare("in", v, arg);
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (v.k != vkind::integer && v.k != vkind::boolean) type_fail(fmt::format("test '{}' needs an integer", name));
    const int64_t x = v.k == vkind::boolean ? v.b : v.i;
    if (name == "odd") return x % 2 != 0;
    if (name == "even") return x % 2 == 0;
    if (arg.k != vkind::integer || arg.i == 0) type_fail("divisibleby needs a non-zero integer");
    return x % arg.i == 0;
  }
  if (name == "lower" || name == "upper") return v.k == vkind::string && (name == "lower" ? py_lower(v.s) : py_upper(v.s)) == v.s;
  type_fail(fmt::format("no test named '{}'", name));
}

// ---- methods ----

namespace {

value bound(const value& self, std::string name, std::function<value(const value&, const call_args&)> fn) {
  auto c = std::make_shared<callable>();
  c->name = std::move(name);
  c->fn = [self, fn = std::move(fn)](evaluator&, const call_args& a) { return fn(self, a); };
  return value::func(std::move(c));
}

const std::string* opt_str(const value& v, std::string_view what) {
  if (v.undefined() || v.k == vkind::none) return nullptr;
  if (v.k != vkind::string) type_fail(fmt::format("{} must be a string, not {}", what, type_name(v)));
  return &v.s;
}

long opt_int(const value& v, long dflt) {
  if (v.undefined() || v.k == vkind::none) return dflt;
  if (v.k != vkind::integer) type_fail(fmt::format("expected an integer, got {}", type_name(v)));
  return static_cast<long>(v.i);
}

value str_list(std::vector<std::string> parts) {
  std::vector<value> xs;
  for (auto& p : parts) xs.push_back(value::string(std::move(p)));
  return value::list(std::move(xs));
}

bool affix(const value& self, const value& arg, bool start) {
  std::vector<value> cands = arg.k == vkind::list ? *arg.l : std::vector<value>{arg};
  for (auto& c : cands) {
    if (c.k != vkind::string) type_fail(fmt::format("{}with arg must be str or a tuple of str", start ? "start" : "end"));
    if (c.s.size() <= self.s.size() &&
        (start ? self.s.compare(0, c.s.size(), c.s) == 0 : self.s.compare(self.s.size() - c.s.size(), c.s.size(), c.s) == 0))
      return true;
  }
  return false;
}

value string_method(const value& obj, const std::string& name) {
  using A = const call_args&;
  using V = const value&;
  if (name == "strip" || name == "lstrip" || name == "rstrip")
    return bound(obj, name, [name](V s, A a) {
      return value::string(py_strip(s.s, opt_str(a.get(0, "chars"), "strip chars"), name != "rstrip", name != "lstrip"));
    });
  if (name == "split")
    return bound(obj, name, [](V s, A a) {
      return str_list(py_split(s.s, opt_str(a.get(0, "sep"), "split separator"), opt_int(a.get(1, "maxsplit"), -1)));
    });
  if (name == "startswith" || name == "endswith")
    return bound(obj, name, [name](V s, A a) { return value::boolean(affix(s, a.get(0, "prefix"), name == "startswith")); });
  if (name == "upper") return bound(obj, name, [](V s, A) { return value::string(py_upper(s.s)); });
  if (name == "lower") return bound(obj, name, [](V s, A) { return value::string(py_lower(s.s)); });
  if (name == "title") return bound(obj, name, [](V s, A) { return value::string(py_title(s.s)); });
  if (name == "capitalize") return bound(obj, name, [](V s, A) { return value::string(py_capitalize(s.s)); });
  if (name == "replace")
    return bound(obj, name, [](V s, A a) {
      const std::string* o = opt_str(a.get(0, "old"), "replace old");
      const std::string* n = opt_str(a.get(1, "new"), "replace new");
      if (!o || !n) type_fail("replace() takes two strings");
      return value::string(py_replace(s.s, *o, *n, opt_int(a.get(2, "count"), -1), size_t{1} << 22));
    });
  if (name == "find")
    return bound(obj, name, [](V s, A a) {
      const std::string* sub = opt_str(a.get(0, "sub"), "find argument");
      if (!sub) type_fail("find() takes a string");
      const size_t at = s.s.find(*sub);
      return value::integer(at == std::string::npos ? -1 : static_cast<int64_t>(utf8_length(s.s.substr(0, at))));
    });
  if (name == "join")
    return bound(obj, name, [](V s, A a) {
      std::string out;
      auto items = iterate(a.get(0, "iterable"));
      for (size_t i = 0; i < items.size(); ++i) {
        if (items[i].k != vkind::string) type_fail("join(): sequence items must be strings");
        if (i) out += s.s;
        out += items[i].s;
        if (out.size() > (size_t{1} << 22)) throw op_error{error_kind::limit, "join: the result is too large"};
      }
      return value::string(std::move(out));
    });
  if (name == "isdigit" || name == "isspace" || name == "isalpha" || name == "isalnum")
    return bound(obj, name, [name](V s, A) {
      bool ok = !s.s.empty();
      for (char c : s.s) {
        const bool d = c >= '0' && c <= '9', al = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
        ok = ok && (name == "isdigit" ? d : name == "isspace" ? py_space(c) : name == "isalpha" ? al : (al || d));
      }
      return value::boolean(ok);
    });
  return value();
}

}  // namespace

value builtin_method(const value& obj, const std::string& name) {
  using A = const call_args&;
  using V = const value&;
  if (obj.k == vkind::string) {
    value m = string_method(obj, name);
    if (m.undefined()) m.s = name;
    return m;
  }
  if (obj.k != vkind::dict || obj.m->is_namespace) return value();
  if (name == "items")
    return bound(obj, name, [](V d, A) {
      std::vector<value> xs;
      for (auto& [k, v] : d.m->items) xs.push_back(value::list({value::string(k), v}, true));
      return value::list(std::move(xs));
    });
  if (name == "keys") return bound(obj, name, [](V d, A) { return value::list(iterate(d)); });
  if (name == "values")
    return bound(obj, name, [](V d, A) {
      std::vector<value> xs;
      for (auto& [k, v] : d.m->items) xs.push_back(v);
      return value::list(std::move(xs));
    });
  if (name == "get")
    return bound(obj, name, [](V d, A a) {
      const value& key = a.get(0, "key");
      const value* v = key.k == vkind::string ? d.m->find(key.s) : nullptr;
      if (v) return *v;
      const value& dflt = a.get(1, "default");
      return dflt.undefined() ? value::none() : dflt;
    });
  return value();
}

// ---- globals ----

std::unordered_map<std::string, value> builtin_globals() {
  std::unordered_map<std::string, value> g;
  auto add = [&](std::string name, std::function<value(evaluator&, const call_args&)> fn) {
    auto c = std::make_shared<callable>();
    c->name = name;
    c->fn = std::move(fn);
    g[name] = value::func(std::move(c));
  };
  add("raise_exception", [](evaluator&, const call_args& a) -> value {
    throw op_error{error_kind::raised, "raise_exception: " + to_str(a.get(0, "message"))};
  });
  add("strftime_now", [](evaluator& ev, const call_args& a) {
    const value& f = a.get(0, "format");
    if (f.k != vkind::string) type_fail("strftime_now needs a format string");
    const std::time_t t = ev.env().now();
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[512];
    const size_t n = f.s.size() < 128 ? std::strftime(buf, sizeof buf, f.s.c_str(), &tm) : 0;
    return value::string(std::string(buf, n));
  });
  add("namespace", [](evaluator& ev, const call_args& a) {
    value ns = ev.make_namespace();
    for (auto& p : a.pos) {
      if (p.k != vkind::dict) type_fail("namespace() takes keyword arguments or a dict");
      for (auto& [k, v] : p.m->items) ev.set_namespace_attr(ns, k, v);
    }
    for (auto& [k, v] : a.kw) ev.set_namespace_attr(ns, k, v);
    return ns;
  });
  add("dict", [](evaluator&, const call_args& a) {
    value d = value::make_dict();
    for (auto& [k, v] : a.kw) d.m->set(k, v);
    return d;
  });
  add("range", [](evaluator& ev, const call_args& a) {
    int64_t start = 0, stop = 0, st = 1;
    for (auto& p : a.pos)
      if (p.k != vkind::integer) type_fail("range() arguments must be integers");
    if (a.pos.size() == 1) stop = a.pos[0].i;
    else if (a.pos.size() >= 2) {
      start = a.pos[0].i;
      stop = a.pos[1].i;
      if (a.pos.size() >= 3) st = a.pos[2].i;
    } else {
      type_fail("range() takes 1 to 3 integers");
    }
    if (st == 0) type_fail("range() step must not be zero");
    std::vector<value> xs;
    for (int64_t i = start; st > 0 ? i < stop : i > stop; i += st) {
      if (xs.size() >= ev.lim().max_list_items)
        throw op_error{error_kind::limit, fmt::format("range() would exceed {} items", ev.lim().max_list_items)};
      xs.push_back(value::integer(i));
      if ((st > 0 && i > INT64_MAX - st) || (st < 0 && i < INT64_MIN - st)) break;
    }
    ev.step(xs.size() / 64);
    return value::list(std::move(xs));
  });
  return g;
}

}  // namespace tandem::jinja
