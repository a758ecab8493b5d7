#pragma once
/// The expression half of the Jinja parser (jinja_parser.cpp has the statements): token
/// helpers shared by both and jinja2's expression grammar, where filters and tests bind
/// tighter than arithmetic and `not` looser than comparisons.
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "transport/chat/jinja_ast.h"
#include "transport/chat/jinja_lexer.h"

namespace tandem::jinja {

class expr_parser {
 public:
  expr_parser(const std::vector<token>& t, int max_depth) : t_(t), max_depth_(max_depth) {}

 protected:
  /// Bounds recursion: deeply nested input must fail cleanly, not overflow the stack.
  struct guard {
    explicit guard(expr_parser& p) : p_(p) {
      if (++p_.depth_ > p_.max_depth_)
        throw error(error_kind::limit, fmt::format("template syntax error at line {}, column {}: nesting deeper than {} levels",
                                                   p_.cur().line, p_.cur().col, p_.max_depth_));
    }
    ~guard() { --p_.depth_; }
    expr_parser& p_;
  };

  const token& cur() const { return t_[pos_]; }
  const token& peek(size_t n = 1) const { return t_[std::min(pos_ + n, t_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < t_.size()) ++pos_;
  }

  [[noreturn]] void fail(const token& at, const std::string& what) const {
    throw error(error_kind::syntax, fmt::format("template syntax error at line {}, column {}: {}", at.line, at.col, what));
  }

  std::string describe(const token& x) const {
    switch (x.t) {
      case tok::eof: return "end of template";
      case tok::text: return "text";
      case tok::var_end: return "'}}'";
      case tok::block_end: return "'%}'";
      case tok::var_begin: return "'{{'";
      case tok::block_begin: return "'{%'";
      default: return "'" + x.s + "'";
    }
  }

  bool is_op(std::string_view o) const { return cur().t == tok::op && cur().s == o; }
  bool is_name(std::string_view n) const { return cur().t == tok::name && cur().s == n; }
  bool accept_op(std::string_view o) {
    if (!is_op(o)) return false;
    next();
    return true;
  }
  bool accept_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  void expect_op(std::string_view o) {
    if (!accept_op(o)) fail(cur(), fmt::format("expected '{}', got {}", o, describe(cur())));
  }
  std::string expect_name() {
    if (cur().t != tok::name) fail(cur(), fmt::format("expected a name, got {}", describe(cur())));
    std::string s = cur().s;
    next();
    return s;
  }
  void expect_block_end() {
    if (cur().t != tok::block_end) fail(cur(), fmt::format("expected '%}}', got {}", describe(cur())));
    next();
  }

  expr_ptr node(eop op, const token& at) {
    auto e = std::make_unique<expr>();
    e->op = op;
    e->line = at.line;
    e->col = at.col;
    return e;
  }


  // ---- expressions (jinja_parser_expr.cpp) ----
  expr_ptr parse_tuple(bool condexpr);
  expr_ptr parse_expression(bool condexpr);
  expr_ptr binary(eop op, expr_ptr l, expr_ptr r, const token& at, std::string name = "");
  expr_ptr parse_or();
  /// One left-associative level of the binary-operator table (jinja_parser_expr.cpp).
  expr_ptr parse_binary(size_t level);
  expr_ptr parse_not();
  expr_ptr parse_compare();
  expr_ptr parse_unary(bool with_filter);
  expr_ptr parse_primary();
  void parse_call_args(expr& call);
  /// `callee(args)`: a call node at `at`.
  expr_ptr parse_call(expr_ptr callee, const token& at);
  expr_ptr parse_postfix(expr_ptr n);
  expr_ptr parse_subscript(expr_ptr obj, const token& at);
  std::string dotted_name();
  expr_ptr parse_filters(expr_ptr n, bool inline_first = false);
  expr_ptr parse_filter_expr(expr_ptr n);

  const std::vector<token>& t_;
  size_t pos_ = 0;
  int depth_ = 0;
  int max_depth_;
};

}  // namespace tandem::jinja
