#include "transport/chat/jinja.h"

#include <fmt/format.h>

#include "transport/chat/jinja_eval.h"
#include "transport/chat/jinja_lexer.h"
#include "transport/chat/jinja_parser.h"
#include "kernels/base/json.h"

namespace tandem::jinja {

template_::template_(std::string_view source, limits lim) : lim_(lim) {
  if (source.size() > lim_.max_template_bytes)
    throw error(error_kind::limit, fmt::format("the template is {} bytes; the limit is {}", source.size(), lim_.max_template_bytes));
  body_ = parse(lex(source, lim_.max_tokens), lim_.max_depth);
}

std::string template_::render(const value& context, const environment& env) const {
  evaluator ev(lim_, env);
  try {
    return ev.render(body_, context);
  } catch (const op_error& e) {
    // Only errors outside any statement (none in practice) arrive here without a position.
    throw error(e.kind, "template error: " + e.message);
  }
}

namespace {

value convert(const json::value& j) {
  switch (j.k) {
    case json::kind::null: return value::none();
    case json::kind::boolean: return value::boolean(j.b);
    case json::kind::number: return j.is_int ? value::integer(j.i) : value::real(j.num);
    case json::kind::string: return value::string(j.s);
    case json::kind::array: {
      std::vector<value> xs;
      for (auto& x : j.arr) xs.push_back(convert(x));
      return value::list(std::move(xs));
    }
    case json::kind::object: {
      value d = value::make_dict();
      for (auto& m : j.obj) d.m->set(m.first, convert(m.second));
      return d;
    }
  }
  return value();
}

}  // namespace

value from_json(const json::value& j) { return convert(j); }

value from_json(std::string_view text) {
  try {
    return convert(json::parse(text));
  } catch (const json::parse_error& e) {
    throw error(error_kind::render, fmt::format("bad JSON for a template value: {}", e.what()));
  }
}

}  // namespace tandem::jinja
