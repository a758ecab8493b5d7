#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <string_view>

#include "transport/chat/jinja_parser_base.h"

namespace tandem::jinja {

/// A comma-separated list becomes a tuple (`{{ a, b }}`, `for x in a, b`).
expr_ptr expr_parser::parse_tuple(bool condexpr) {
  const token at = cur();
  auto first = parse_expression(condexpr);
  if (!is_op(",")) return first;
  auto t = node(eop::tuple, at);
  t->args.push_back(std::move(first));
  while (accept_op(",")) {
    if (cur().t == tok::block_end || cur().t == tok::var_end || is_op(")")) break;
    t->args.push_back(parse_expression(condexpr));
  }
  return t;
}

expr_ptr expr_parser::parse_expression(bool condexpr) {
  guard g(*this);
  if (!condexpr) return parse_or();
  auto e = parse_or();
  while (is_name("if")) {
    const token at = cur();
    next();
    auto c = node(eop::cond, at);
    auto test = parse_or();
    expr_ptr other;
    if (accept_name("else")) other = parse_expression(true);
    c->args.push_back(std::move(e));
    c->args.push_back(std::move(test));
    c->args.push_back(std::move(other));
    e = std::move(c);
  }
  return e;
}

expr_ptr expr_parser::binary(eop op, expr_ptr l, expr_ptr r, const token& at, std::string name) {
  auto b = node(op, at);
  b->name = std::move(name);
  b->args.push_back(std::move(l));
  b->args.push_back(std::move(r));
  return b;
}

namespace {

/// What the operands of a binary level are.
enum class operand : uint8_t { next_level, not_expr, unary };

/// A left-associative binary level: its operators are names (`or`) or symbols (`+`).
struct binary_level {
  eop op;
  bool words;
  std::array<std::string_view, 4> names;  ///< empty entries unused
  operand operands;
};

/// Jinja's binary operators, loosest first. `and` binds `not` expressions, below which come
/// the comparisons (parse_compare); their operands start again at `math_level`.
constexpr binary_level binary_levels[] = {
    {eop::or_, true, {"or"}, operand::next_level},
    {eop::and_, true, {"and"}, operand::not_expr},
    {eop::binary, false, {"+", "-"}, operand::next_level},
    {eop::binary, false, {"~"}, operand::next_level},
    {eop::binary, false, {"*", "/", "//", "%"}, operand::next_level},
    {eop::binary, false, {"**"}, operand::unary},
};
constexpr size_t math_level = 2;

}  // namespace

expr_ptr expr_parser::parse_or() { return parse_binary(0); }

expr_ptr expr_parser::parse_binary(size_t level) {
  const binary_level& lv = binary_levels[level];
  auto parse_operand = [&] {
    switch (lv.operands) {
      case operand::not_expr: return parse_not();
      case operand::unary: return parse_unary(true);
      case operand::next_level: break;
    }
    return parse_binary(level + 1);
  };
  auto at_operator = [&] {
    for (std::string_view n : lv.names)
      if (!n.empty() && (lv.words ? is_name(n) : is_op(n))) return true;
    return false;
  };
  auto l = parse_operand();
  while (at_operator()) {
    const token at = cur();
    next();
    // The arithmetic nodes carry their operator; `or` and `and` have their own node kinds.
    l = binary(lv.op, std::move(l), parse_operand(), at, lv.op == eop::binary ? at.s : std::string());
  }
  return l;
}

expr_ptr expr_parser::parse_not() {
  if (is_name("not")) {
    guard g(*this);
    auto n = node(eop::not_, cur());
    next();
    n->args.push_back(parse_not());
    return n;
  }
  return parse_compare();
}

expr_ptr expr_parser::parse_compare() {
  const token at = cur();
  auto first = parse_binary(math_level);
  expr_ptr cmp;
  for (;;) {
    std::string op;
    if (cur().t == tok::op && (cur().s == "==" || cur().s == "!=" || cur().s == "<" || cur().s == "<=" ||
                               cur().s == ">" || cur().s == ">=")) {
      op = cur().s;
      next();
    } else if (is_name("in")) {
      op = "in";
      next();
    } else if (is_name("not") && peek().t == tok::name && peek().s == "in") {
      op = "notin";
      next();
      next();
    } else {
      break;
    }
    if (!cmp) {
      cmp = node(eop::compare, at);
      cmp->args.push_back(std::move(first));
    }
    cmp->ops.push_back(op);
    cmp->args.push_back(parse_binary(math_level));
  }
  return cmp ? std::move(cmp) : std::move(first);
}

expr_ptr expr_parser::parse_unary(bool with_filter) {
  guard g(*this);
  const token at = cur();
  expr_ptr n;
  if (is_op("-") || is_op("+")) {
    next();
    n = node(at.s == "-" ? eop::neg : eop::pos, at);
    n->args.push_back(parse_unary(false));
  } else {
    n = parse_primary();
  }
  n = parse_postfix(std::move(n));
  if (with_filter) n = parse_filter_expr(std::move(n));
  return n;
}

expr_ptr expr_parser::parse_primary() {
  const token at = cur();
  switch (at.t) {
    case tok::name: {
      next();
      auto n = node(eop::literal, at);
      if (at.s == "true" || at.s == "True") n->lit = value::boolean(true);
      else if (at.s == "false" || at.s == "False") n->lit = value::boolean(false);
      else if (at.s == "none" || at.s == "None") n->lit = value::none();
      else {
        n->op = eop::name;
        n->name = at.s;
      }
      return n;
    }
    case tok::string: {
      std::string s;
      while (cur().t == tok::string) {
        s += cur().s;
        next();
      }
      auto n = node(eop::literal, at);
      n->lit = value::string(std::move(s));
      return n;
    }
    case tok::integer:
    case tok::real: {
      next();
      auto n = node(eop::literal, at);
      n->lit = at.t == tok::integer ? value::integer(at.i) : value::real(at.d);
      return n;
    }
    case tok::op:
      if (at.s == "(") {
        next();
        if (accept_op(")")) return node(eop::tuple, at);
        auto first = parse_expression(true);
        if (accept_op(")")) return first;
        auto t = node(eop::tuple, at);
        t->args.push_back(std::move(first));
        while (accept_op(",")) {
          if (is_op(")")) break;
          t->args.push_back(parse_expression(true));
        }
        expect_op(")");
        return t;
      }
      if (at.s == "[" || at.s == "{") {
        next();
        const bool dict = at.s == "{";
        const std::string_view close = dict ? "}" : "]";
        auto l = node(dict ? eop::dict : eop::list, at);
        // Comma-separated items (a dict's are `key: value`), a trailing comma allowed.
        while (!is_op(close)) {
          if (!l->args.empty()) expect_op(",");
          if (is_op(close)) break;
          l->args.push_back(parse_expression(true));
          if (!dict) continue;
          expect_op(":");
          l->args.push_back(parse_expression(true));
        }
        expect_op(close);
        return l;
      }
      break;
    default: break;
  }
  fail(at, fmt::format("unexpected {} in an expression", describe(at)));
}

void expr_parser::parse_call_args(expr& call) {
  expect_op("(");
  while (!is_op(")")) {
    if (call.args.size() > 1 || !call.kwargs.empty()) expect_op(",");
    if (is_op(")")) break;
    if (cur().t == tok::name && peek().t == tok::op && peek().s == "=") {
      std::string k = cur().s;
      next();
      next();
      call.kwargs.emplace_back(std::move(k), parse_expression(true));
    } else {
      if (!call.kwargs.empty()) fail(cur(), "a positional argument follows a keyword argument");
      call.args.push_back(parse_expression(true));
    }
  }
  expect_op(")");
}

expr_ptr expr_parser::parse_call(expr_ptr callee, const token& at) {
  auto c = node(eop::call, at);
  c->args.push_back(std::move(callee));
  parse_call_args(*c);
  return c;
}

expr_ptr expr_parser::parse_postfix(expr_ptr n) {
  for (;;) {
    const token at = cur();
    if (is_op(".")) {
      next();
      if (cur().t == tok::integer) {
        auto it = node(eop::item, at);
        auto idx = node(eop::literal, cur());
        idx->lit = value::integer(cur().i);
        next();
        it->args.push_back(std::move(n));
        it->args.push_back(std::move(idx));
        n = std::move(it);
      } else {
        auto a = node(eop::attr, at);
        a->name = expect_name();
        a->args.push_back(std::move(n));
        n = std::move(a);
      }
    } else if (is_op("[")) {
      next();
      n = parse_subscript(std::move(n), at);
      expect_op("]");
    } else if (is_op("(")) {
      n = parse_call(std::move(n), at);
    } else {
      return n;
    }
  }
}

expr_ptr expr_parser::parse_subscript(expr_ptr obj, const token& at) {
  expr_ptr parts[3];
  bool is_slice = false;
  if (!is_op(":")) parts[0] = parse_expression(true);
  if (accept_op(":")) {
    is_slice = true;
    if (!is_op("]") && !is_op(":")) parts[1] = parse_expression(true);
    if (accept_op(":") && !is_op("]")) parts[2] = parse_expression(true);
  }
  auto n = node(is_slice ? eop::slice : eop::item, at);
  n->args.push_back(std::move(obj));
  n->args.push_back(std::move(parts[0]));
  if (is_slice) {
    n->args.push_back(std::move(parts[1]));
    n->args.push_back(std::move(parts[2]));
  }
  return n;
}

std::string expr_parser::dotted_name() {
  std::string name = expect_name();
  while (is_op(".") && peek().t == tok::name) {
    next();
    name += "." + expect_name();
  }
  return name;
}

/// `| f(args) | g ...` over `n`; `inline_first`: the first filter has no leading '|'.
expr_ptr expr_parser::parse_filters(expr_ptr n, bool inline_first) {
  while (inline_first || is_op("|")) {
    const token at = cur();
    if (!inline_first) next();
    inline_first = false;
    auto f = node(eop::filter, at);
    f->name = dotted_name();
    f->args.push_back(std::move(n));
    if (is_op("(")) parse_call_args(*f);
    n = std::move(f);
  }
  return n;
}

expr_ptr expr_parser::parse_filter_expr(expr_ptr n) {
  for (;;) {
    const token at = cur();
    if (is_op("|")) {
      n = parse_filters(std::move(n));
    } else if (is_name("is")) {
      next();
      auto t = node(eop::test, at);
      t->negated = accept_name("not");
      t->name = dotted_name();
      t->args.push_back(std::move(n));
      if (is_op("(")) {
        parse_call_args(*t);
      } else if ((cur().t == tok::name || cur().t == tok::string || cur().t == tok::integer || cur().t == tok::real ||
                  is_op("(") || is_op("[") || is_op("{")) &&
                 !is_name("else") && !is_name("or") && !is_name("and")) {
        if (is_name("is")) fail(cur(), "tests cannot be chained with 'is'");
        t->args.push_back(parse_postfix(parse_primary()));
      }
      n = std::move(t);
    } else if (is_op("(")) {
      n = parse_call(std::move(n), at);
    } else {
      return n;
    }
  }
}

}  // namespace tandem::jinja
