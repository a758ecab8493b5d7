#include "transport/chat/jinja_parser.h"

#include <fmt/format.h>

namespace tandem::jinja {

namespace {

class parser {
 public:
  parser(const std::vector<token>& t, int max_depth) : t_(t), max_depth_(max_depth) {}

  block run() {
    block b = subparse({});
    if (cur().t != tok::eof) fail(cur(), fmt::format("unexpected '{{% {} %}}'", cur().s));
    return b;
  }

 private:
  /// Bounds recursion: deeply nested input must fail cleanly, not overflow the stack.
  struct guard {
    explicit guard(parser& p) : p_(p) {
      if (++p_.depth_ > p_.max_depth_)
        throw error(error_kind::limit, fmt::format("template syntax error at line {}, column {}: nesting deeper than {} levels",
                                                   p_.cur().line, p_.cur().col, p_.max_depth_));
    }
    ~guard() { --p_.depth_; }
    parser& p_;
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

  // ---- statements ----

  /// Parses until a block tag named in `ends` (left current: its name token) or eof.
  block subparse(std::initializer_list<std::string_view> ends) {
    guard g(*this);
    block out;
    for (;;) {
      const token& x = cur();
      if (x.t == tok::eof) {
        if (ends.size()) fail(x, fmt::format("unexpected end of template; expected '{{% {} %}}'", *(ends.end() - 1)));
        return out;
      }
      if (x.t == tok::text) {
        auto s = std::make_unique<stmt>();
        s->op = sop::text;
        s->name = x.s;
        out.push_back(std::move(s));
        next();
      } else if (x.t == tok::var_begin) {
        next();
        auto s = std::make_unique<stmt>();
        s->op = sop::output;
        s->line = x.line;
        s->col = x.col;
        s->e.push_back(parse_tuple(true));
        if (cur().t != tok::var_end) fail(cur(), fmt::format("expected '}}}}', got {}", describe(cur())));
        next();
        out.push_back(std::move(s));
      } else if (x.t == tok::block_begin) {
        next();
        if (cur().t != tok::name) fail(cur(), "expected a tag name after '{%'");
        for (auto e : ends)
          if (cur().s == e) return out;
        out.push_back(parse_statement());
      } else {
        fail(x, fmt::format("unexpected {}", describe(x)));
      }
    }
  }

  stmt_ptr make_stmt(sop op, const token& at) {
    auto s = std::make_unique<stmt>();
    s->op = op;
    s->line = at.line;
    s->col = at.col;
    return s;
  }

  stmt_ptr parse_statement() {
    const token at = cur();
    const std::string tag = cur().s;
    next();
    if (tag == "if") return parse_if(at);
    if (tag == "for") return parse_for(at);
    if (tag == "set") return parse_set(at);
    if (tag == "macro") return parse_macro(at);
    if (tag == "filter") return parse_filter_block(at);
    if (tag == "break" || tag == "continue") {
      expect_block_end();
      return make_stmt(tag == "break" ? sop::break_ : sop::continue_, at);
    }
    fail(at, fmt::format("unknown or unsupported tag '{}'", tag));
  }

  stmt_ptr parse_if(const token& at) {
    auto s = make_stmt(sop::if_, at);
    s->e.push_back(parse_tuple(true));
    expect_block_end();
    for (;;) {
      s->bodies.push_back(subparse({"elif", "else", "endif"}));
      const std::string t = cur().s;
      next();
      if (t == "elif") {
        s->e.push_back(parse_tuple(true));
        expect_block_end();
      } else if (t == "else") {
        expect_block_end();
        s->bodies.push_back(subparse({"endif"}));
        next();
        expect_block_end();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> names;
    const bool paren = accept_op("(");
    do {
      names.push_back(expect_name());
    } while (accept_op(","));
    if (paren) expect_op(")");
    return names;
  }

  stmt_ptr parse_for(const token& at) {
    auto s = make_stmt(sop::for_, at);
    s->names = parse_targets();
    if (!accept_name("in")) fail(cur(), "expected 'in' in the for tag");
    s->e.push_back(parse_tuple(false));
    if (accept_name("if")) s->e.push_back(parse_expression(true));
    else s->e.push_back(nullptr);
    if (is_name("recursive")) fail(cur(), "recursive loops are not supported");
    expect_block_end();
    s->bodies.push_back(subparse({"else", "endfor"}));
    if (cur().s == "else") {
      next();
      expect_block_end();
      s->bodies.push_back(subparse({"endfor"}));
    } else {
      s->bodies.emplace_back();
    }
    next();
    expect_block_end();
    return s;
  }

  stmt_ptr parse_set(const token& at) {
    const token name_tok = cur();
    std::string first = expect_name();
    if (cur().t == tok::block_end || is_op("|")) {
      // Block form: {% set x %}...{% endset %}, optionally with filters.
      auto s = make_stmt(sop::set_block, at);
      s->names.push_back(first);
      if (is_op("|")) s->e.push_back(parse_filters(node(eop::placeholder, at)));
      else s->e.push_back(nullptr);
      expect_block_end();
      s->bodies.push_back(subparse({"endset"}));
      next();
      expect_block_end();
      return s;
    }
    auto s = make_stmt(sop::set, at);
    expr_ptr target;
    if (accept_op(".")) {
      target = node(eop::attr, name_tok);
      auto obj = node(eop::name, name_tok);
      obj->name = first;
      target->args.push_back(std::move(obj));
      target->name = expect_name();
    } else if (is_op(",")) {
      target = node(eop::tuple, name_tok);
      auto n = node(eop::name, name_tok);
      n->name = first;
      target->args.push_back(std::move(n));
      while (accept_op(",")) {
        auto m = node(eop::name, cur());
        m->name = expect_name();
        target->args.push_back(std::move(m));
      }
    } else {
      target = node(eop::name, name_tok);
      target->name = first;
    }
    expect_op("=");
    s->e.push_back(parse_tuple(true));
    s->e.push_back(std::move(target));
    expect_block_end();
    return s;
  }

  stmt_ptr parse_macro(const token& at) {
    auto s = make_stmt(sop::macro, at);
    s->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->names.empty()) expect_op(",");
      if (is_op(")")) break;
      s->names.push_back(expect_name());
      if (accept_op("=")) s->e.push_back(parse_expression(true));
      else s->e.push_back(nullptr);
    }
    expect_op(")");
    expect_block_end();
    s->bodies.push_back(subparse({"endmacro"}));
    next();
    if (cur().t == tok::name) next();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  stmt_ptr parse_filter_block(const token& at) {
    auto s = make_stmt(sop::filter_block, at);
    s->e.push_back(parse_filters(node(eop::placeholder, at), true));
    expect_block_end();
    s->bodies.push_back(subparse({"endfilter"}));
    next();
    expect_block_end();
    return s;
  }

  // ---- expressions ----

  /// A comma-separated list becomes a tuple (`{{ a, b }}`, `for x in a, b`).
  expr_ptr parse_tuple(bool condexpr) {
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

  expr_ptr parse_expression(bool condexpr) {
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

  expr_ptr binary(eop op, expr_ptr l, expr_ptr r, const token& at, std::string name = "") {
    auto b = node(op, at);
    b->name = std::move(name);
    b->args.push_back(std::move(l));
    b->args.push_back(std::move(r));
    return b;
  }

  expr_ptr parse_or() {
    auto l = parse_and();
    while (is_name("or")) {
      const token at = cur();
      next();
      l = binary(eop::or_, std::move(l), parse_and(), at);
    }
    return l;
  }

  expr_ptr parse_and() {
    auto l = parse_not();
    while (is_name("and")) {
      const token at = cur();
      next();
      l = binary(eop::and_, std::move(l), parse_not(), at);
    }
    return l;
  }

  expr_ptr parse_not() {
    if (is_name("not")) {
      guard g(*this);
      auto n = node(eop::not_, cur());
      next();
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  expr_ptr parse_compare() {
    const token at = cur();
    auto first = parse_math1();
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
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  expr_ptr parse_math1() {
    auto l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const token at = cur();
      next();
      l = binary(eop::binary, std::move(l), parse_concat(), at, at.s);
    }
    return l;
  }

  expr_ptr parse_concat() {
    auto l = parse_math2();
    while (is_op("~")) {
      const token at = cur();
      next();
      l = binary(eop::binary, std::move(l), parse_math2(), at, "~");
    }
    return l;
  }

  expr_ptr parse_math2() {
    auto l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const token at = cur();
      next();
      l = binary(eop::binary, std::move(l), parse_pow(), at, at.s);
    }
    return l;
  }

  expr_ptr parse_pow() {
    auto l = parse_unary(true);
    while (is_op("**")) {
      const token at = cur();
      next();
      l = binary(eop::binary, std::move(l), parse_unary(true), at, "**");
    }
    return l;
  }

  expr_ptr parse_unary(bool with_filter) {
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

  expr_ptr parse_primary() {
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
        if (at.s == "[") {
          next();
          auto l = node(eop::list, at);
          while (!is_op("]")) {
            if (!l->args.empty()) expect_op(",");
            if (is_op("]")) break;
            l->args.push_back(parse_expression(true));
          }
          expect_op("]");
          return l;
        }
        if (at.s == "{") {
          next();
          auto d = node(eop::dict, at);
          while (!is_op("}")) {
            if (!d->args.empty()) expect_op(",");
            if (is_op("}")) break;
            d->args.push_back(parse_expression(true));
            expect_op(":");
            d->args.push_back(parse_expression(true));
          }
          expect_op("}");
          return d;
        }
        break;
      default: break;
    }
    fail(at, fmt::format("unexpected {} in an expression", describe(at)));
  }

  void parse_call_args(expr& call) {
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

  expr_ptr parse_postfix(expr_ptr n) {
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
        auto c = node(eop::call, at);
        c->args.push_back(std::move(n));
        parse_call_args(*c);
        n = std::move(c);
      } else {
        return n;
      }
    }
  }

  expr_ptr parse_subscript(expr_ptr obj, const token& at) {
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

  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".") && peek().t == tok::name) {
      next();
      name += "." + expect_name();
    }
    return name;
  }

  /// `| f(args) | g ...` over `n`; `inline_first`: the first filter has no leading '|'.
  expr_ptr parse_filters(expr_ptr n, bool inline_first = false) {
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

  expr_ptr parse_filter_expr(expr_ptr n) {
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
        auto c = node(eop::call, at);
        c->args.push_back(std::move(n));
        parse_call_args(*c);
        n = std::move(c);
      } else {
        return n;
      }
    }
  }

  const std::vector<token>& t_;
  size_t pos_ = 0;
  int depth_ = 0;
  int max_depth_;
};

}  // namespace

block parse(const std::vector<token>& tokens, int max_depth) { return parser(tokens, max_depth).run(); }

}  // namespace tandem::jinja
