// Operators of the Jinja evaluator with Python's semantics (bool counts as int, `/` is true
// division, `//` and `%` floor). Integers are 64-bit: where Python would grow a big integer
// we fail with "integer overflow" instead.
#include <cmath>

#include <fmt/format.h>

#include "transport/chat/jinja_eval.h"
#include "transport/chat/jinja_strings.h"

namespace tandem::jinja {

namespace {

int64_t int_of(const value& v) { return v.k == vkind::boolean ? v.b : v.i; }

[[noreturn]] void unsupported(const std::string& op, const value& a, const value& b) {
  for (const value* v : {&a, &b})
    if (v->undefined()) type_fail(v->s.empty() ? "an undefined value was used in an operation" : fmt::format("'{}' is undefined", v->s));
  type_fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
}

int64_t add(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) type_fail("integer overflow");
  return r;
}
int64_t sub(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) type_fail("integer overflow");
  return r;
}
int64_t mul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) type_fail("integer overflow");
  return r;
}

}  // namespace

value evaluator::binary(const std::string& op, const value& a, const value& b) {
  if (op == "~") {
    std::string l = to_str(a), r = to_str(b);
    check_size(l.size() + r.size());
    step((l.size() + r.size()) / 256);
    return value::string(l + r);
  }
  const bool nums = a.is_number() && b.is_number();
  const bool ints = nums && a.k != vkind::real && b.k != vkind::real;
  if (op == "+") {
    if (ints) return value::integer(add(int_of(a), int_of(b)));
    if (nums) return value::real(a.as_double() + b.as_double());
    if (a.k == vkind::string && b.k == vkind::string) {
      const bool safe = a.safe || b.safe;
      std::string l = safe && !a.safe ? html_escape(a.s) : a.s, r = safe && !b.safe ? html_escape(b.s) : b.s;
      check_size(l.size() + r.size());
      step((l.size() + r.size()) / 256);
      value out = value::string(l + r);
      out.safe = safe;
      return out;
    }
    if (a.k == vkind::list && b.k == vkind::list && a.tuple == b.tuple) {
      if (a.l->size() + b.l->size() > lim_.max_list_items)
        throw op_error{error_kind::limit, fmt::format("a list would exceed {} items", lim_.max_list_items)};
      step((a.l->size() + b.l->size()) / 64);
      std::vector<value> xs(*a.l);
      xs.insert(xs.end(), b.l->begin(), b.l->end());
      return value::list(std::move(xs), a.tuple);
    }
    unsupported(op, a, b);
  }
  if (op == "-") {
    if (ints) return value::integer(sub(int_of(a), int_of(b)));
    if (nums) return value::real(a.as_double() - b.as_double());
    unsupported(op, a, b);
  }
  if (op == "*") {
    if (ints) return value::integer(mul(int_of(a), int_of(b)));
    if (nums) return value::real(a.as_double() * b.as_double());
    const value* seq = a.k == vkind::string || a.k == vkind::list ? &a : &b;
    const value* cnt = seq == &a ? &b : &a;
    if ((seq->k == vkind::string || seq->k == vkind::list) && (cnt->k == vkind::integer || cnt->k == vkind::boolean)) {
      const int64_t n = std::max<int64_t>(0, int_of(*cnt));
      if (seq->k == vkind::string) {
        if (n > 0 && seq->s.size() > lim_.max_output_bytes / static_cast<uint64_t>(n)) check_size(lim_.max_output_bytes + 1);
        step(seq->s.size() * static_cast<uint64_t>(n) / 256);
        std::string out;
        for (int64_t i = 0; i < n; ++i) out += seq->s;
        return value::string(std::move(out));
      }
      if (n > 0 && seq->l->size() > lim_.max_list_items / static_cast<uint64_t>(n))
        throw op_error{error_kind::limit, fmt::format("a list would exceed {} items", lim_.max_list_items)};
      step(seq->l->size() * static_cast<uint64_t>(n) / 64);
      std::vector<value> xs;
      for (int64_t i = 0; i < n; ++i) xs.insert(xs.end(), seq->l->begin(), seq->l->end());
      return value::list(std::move(xs), seq->tuple);
    }
    unsupported(op, a, b);
  }
  if (op == "/" || op == "//" || op == "%") {
    if (!nums) {
      if (op == "%" && a.k == vkind::string) type_fail("printf-style string formatting ('%') is not supported; use '~' or '+'");
      unsupported(op, a, b);
    }
    if (b.as_double() == 0) type_fail(op == "%" ? "integer modulo by zero" : "division by zero");
    if (op == "/") return value::real(a.as_double() / b.as_double());
    if (ints) {
      const int64_t x = int_of(a), y = int_of(b);
      if (x == INT64_MIN && y == -1) type_fail("integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return value::integer(op == "//" ? q : m);
    }
    const double x = a.as_double(), y = b.as_double();
    if (op == "//") return value::real(std::floor(x / y));
    double m = std::fmod(x, y);
    if (m != 0 && ((m < 0) != (y < 0))) m += y;
    return value::real(m);
  }
  if (op == "**") {
    if (!nums) unsupported(op, a, b);
    if (ints && int_of(b) >= 0) {
      int64_t base = int_of(a), e = int_of(b), acc = 1;
      while (e > 0) {
        if (e & 1) acc = mul(acc, base);
        e >>= 1;
        if (e > 0) base = mul(base, base);
      }
      return value::integer(acc);
    }
    return value::real(std::pow(a.as_double(), b.as_double()));
  }
  type_fail(fmt::format("unknown operator '{}'", op));
}

bool evaluator::compare(const std::string& op, const value& a, const value& b) {
  if (op == "==") return equal(a, b);
  if (op == "!=") return !equal(a, b);
  if (op == "in" || op == "notin") {
    bool found = false;
    if (b.k == vkind::string) {
      if (a.k != vkind::string) type_fail(fmt::format("'in <string>' requires string as left operand, not {}", type_name(a)));
      found = b.s.find(a.s) != std::string::npos;
    } else if (b.k == vkind::list) {
      step(b.l->size() / 64);
      for (auto& x : *b.l) found = found || equal(x, a);
    } else if (b.k == vkind::dict) {
      found = a.k == vkind::string && b.m->find(a.s) != nullptr;
    } else if (!b.undefined()) {
      type_fail(fmt::format("argument of type '{}' is not iterable", type_name(b)));
    }
    return op == "in" ? found : !found;
  }
  if (op == "<") return less(a, b);
  if (op == ">") return less(b, a);
  if (op == "<=") return !less(b, a);
  if (op == ">=") return !less(a, b);
  type_fail(fmt::format("unknown comparison '{}'", op));
}

}  // namespace tandem::jinja
