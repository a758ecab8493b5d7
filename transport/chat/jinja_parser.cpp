#include "transport/chat/jinja_parser.h"

#include <fmt/format.h>

#include "transport/chat/jinja_parser_base.h"

namespace tandem::jinja {

namespace {

class parser : public expr_parser {
 public:
  using expr_parser::expr_parser;

  block run() {
    block b = subparse({});
    if (cur().t != tok::eof) fail(cur(), fmt::format("unexpected '{{% {} %}}'", cur().s));
    return b;
  }

 private:
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

};

}  // namespace

block parse(const std::vector<token>& tokens, int max_depth) { return parser(tokens, max_depth).run(); }

}  // namespace tandem::jinja
