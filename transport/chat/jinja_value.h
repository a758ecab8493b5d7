#pragma once
/// Values of the Jinja interpreter (transport/chat/jinja.h) with Python's semantics where
/// templates can observe them: str()/repr() of lists and dicts, truthiness, equality,
/// ordering, and HF's `tojson` (json.dumps with ensure_ascii=False). Lists and dicts are
/// shared by reference as in Python; only namespaces are mutable (the sandbox is immutable).
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::jinja {

/// What went wrong while parsing or rendering a template.
enum class error_kind : uint8_t {
  syntax,     ///< the template does not parse
  render,     ///< a type error, an undefined variable used as a value, a bad call
  raised,     ///< the template called raise_exception(msg)
  limit,      ///< a bound (output, steps, depth, sizes) was hit
};

/// Lower-case name of an error kind.
std::string_view to_string(error_kind k);

/// A template error; what() names the line and column when known.
class error : public std::runtime_error {
 public:
  error(error_kind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  error_kind kind() const noexcept { return kind_; }

 private:
  error_kind kind_;
};

/// An error raised by an operation that does not know where in the template it is; the
/// evaluator turns it into an error naming the line and column of the expression.
struct op_error {
  error_kind kind;
  std::string message;
};

/// Throws op_error(render, message).
[[noreturn]] void type_fail(std::string message);

struct value;
struct dict;
struct callable;
using list_ptr = std::shared_ptr<std::vector<value>>;
using dict_ptr = std::shared_ptr<dict>;
using func_ptr = std::shared_ptr<callable>;

enum class vkind : uint8_t { undefined, none, boolean, integer, real, string, list, dict, func };

/// One value. Strings are UTF-8 bytes; lengths and slices count code points.
struct value {
  vkind k = vkind::undefined;
  bool b = false;
  bool tuple = false;  ///< a list written as a tuple (repr uses parentheses)
  /// A list that jinja2 would hold as a lazy generator (map, select, ...): no len(), no
  /// index, no JSON, always true; `| list` makes it a list.
  bool generator = false;
  /// A string marked safe (jinja2's Markup, from `| safe`): `+` with a plain string
  /// HTML-escapes the plain one, as Markup.__add__ does even with autoescape off.
  bool safe = false;
  int64_t i = 0;
  double d = 0;
  std::string s;
  list_ptr l;
  dict_ptr m;
  func_ptr f;

  value() = default;
  static value none() { value v; v.k = vkind::none; return v; }
  static value boolean(bool x) { value v; v.k = vkind::boolean; v.b = x; return v; }
  static value integer(int64_t x) { value v; v.k = vkind::integer; v.i = x; return v; }
  static value real(double x) { value v; v.k = vkind::real; v.d = x; return v; }
  static value string(std::string x) { value v; v.k = vkind::string; v.s = std::move(x); return v; }
  static value list(std::vector<value> xs, bool is_tuple = false);
  static value make_dict();
  static value func(func_ptr f) { value v; v.k = vkind::func; v.f = std::move(f); return v; }

  bool undefined() const { return k == vkind::undefined; }
  bool is_number() const { return k == vkind::integer || k == vkind::real || k == vkind::boolean; }
  /// Python truthiness.
  bool truthy() const;
  /// The value as a number (bool counts as int, as in Python).
  double as_double() const { return k == vkind::real ? d : static_cast<double>(k == vkind::boolean ? b : i); }
};

/// An ordered dict with string keys (Python dicts keep insertion order). A namespace() is a
/// dict whose entries are its attributes and may be assigned to.
struct dict {
  std::vector<std::pair<std::string, value>> items;
  bool is_namespace = false;
  const value* find(std::string_view key) const;
  void set(const std::string& key, value v);
};

/// Positional and keyword arguments of a call.
struct call_args {
  std::vector<value> pos;
  std::vector<std::pair<std::string, value>> kw;
  /// Argument `name` at position `idx` or as keyword, or undefined.
  const value& get(size_t idx, std::string_view name) const;
};

class evaluator;

/// A function value: a global (namespace, range, raise_exception, ...), a macro, or a
/// method bound to its subject.
struct callable {
  std::string name;
  std::function<value(evaluator&, const call_args&)> fn;
};

/// Python's str(v) (what {{ v }} prints): strings as is, None as "None", lists/dicts as repr.
std::string to_str(const value& v);
/// Python's repr(v).
std::string repr(const value& v);
/// Python's repr of a float ("1.0", "1e-05", "inf").
std::string repr_double(double d);
/// json.dumps(v, ensure_ascii=False, indent=indent, separators=seps), indent < 0 = none.
/// Throws op_error for undefined, functions and namespaces.
std::string to_json(const value& v, int indent, std::string_view item_sep, std::string_view key_sep);
/// Python ==.
bool equal(const value& a, const value& b);
/// Python <, for numbers, strings and lists; throws op_error otherwise.
bool less(const value& a, const value& b);
/// Lower-case type name for errors ("str", "int", "list", "dict", "undefined").
std::string_view type_name(const value& v);

/// UTF-8 helpers: the byte offsets of each code point, and the number of code points.
std::vector<size_t> utf8_offsets(std::string_view s);
size_t utf8_length(std::string_view s);

}  // namespace tandem::jinja
