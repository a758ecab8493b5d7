#include "transport/http/response_format.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/grammar/json_schema.h"

namespace tandem::transport {

namespace {

void write_value(json::writer& w, const json::value& v) {
  switch (v.k) {
    case json::kind::null:
      w.null();
      break;
    case json::kind::boolean:
      w.boolean(v.b);
      break;
    case json::kind::number:
      if (v.is_int)
        w.num(v.i);
      else
        w.real(v.num);
      break;
    case json::kind::string:
      w.str(v.s);
      break;
    case json::kind::array:
      w.begin_array();
      for (const auto& e : v.arr) write_value(w, e);
      w.end_array();
      break;
    case json::kind::object:
      w.begin_object();
      for (const auto& m : v.obj) {
        w.key(m.first);
        write_value(w, m.second);
      }
      w.end_object();
      break;
  }
}

field_error type_error(const std::string& param, std::string_view want, const json::value& got) {
  return {400, param, fmt::format("'{}' must be {}, got {}", param, want, json::kind_name(got.k)), "invalid_type"};
}

/// Compiles `schema` (to check it) and stores it as the spec.
std::optional<field_error> take_schema(const std::string& param, const json::value& schema, grammar_spec& out,
                                       const limits& lim) {
  if (schema.k != json::kind::object && schema.k != json::kind::boolean)
    return type_error(param, "a JSON schema (an object)", schema);
  std::string text = to_json_text(schema);
  if (int64_t(text.size()) > int64_t(lim.max_grammar_bytes))
    return field_error{422, param,
                       fmt::format("'{}' is {} bytes; at most {} are allowed (limits.max_grammar_bytes)", param,
                                   text.size(), lim.max_grammar_bytes),
                       "invalid_value"};
  try {
    grammar::compile_json_schema(text);
  } catch (const tandem::error& e) {
    return field_error{422, param, fmt::format("'{}': {}", param, e.what()), "invalid_value"};
  }
  out.kind = grammar_kind::json_schema;
  out.source = std::move(text);
  return std::nullopt;
}

}  // namespace

std::string to_json_text(const json::value& v) {
  json::writer w;
  write_value(w, v);
  return w.take();
}

std::optional<field_error> parse_response_format(const json::value& body, bool chat, grammar_spec& out,
                                                 const limits& lim) {
  const json::value* rf = body.find("response_format");
  const json::value* top = chat ? nullptr : body.find("json_schema");
  if (top && top->k != json::kind::null) {
    if (rf && rf->k != json::kind::null)
      return field_error{422, "json_schema", "send either 'json_schema' or 'response_format', not both",
                         "invalid_value"};
    return take_schema("json_schema", *top, out, lim);
  }
  if (!rf || rf->k == json::kind::null) return std::nullopt;
  const std::string param = "response_format";
  if (rf->k != json::kind::object) return type_error(param, "an object such as {\"type\": \"json_object\"}", *rf);
  const json::value* type = rf->find("type");
  if (!type || type->k != json::kind::string)
    return field_error{400, param, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"",
                       "invalid_type"};
  if (type->s == "text") return std::nullopt;
  if (type->s == "json_object") {
    if (const json::value* s = rf->find("schema"); s && s->k != json::kind::null)
      return take_schema("response_format.schema", *s, out, lim);
    out.kind = grammar_kind::json_object;
    out.source.clear();
    return std::nullopt;
  }
  if (type->s == "json_schema") {
    const json::value* js = rf->find("json_schema");
    if (!js || js->k != json::kind::object)
      return field_error{400, "response_format.json_schema",
                         "'response_format.json_schema' must be an object {\"name\", \"schema\", \"strict\"}",
                         "invalid_type"};
    if (const json::value* st = js->find("strict"); st && st->k != json::kind::boolean && st->k != json::kind::null)
      return type_error("response_format.json_schema.strict", "a boolean", *st);
    const json::value* schema = js->find("schema");
    // OpenAI: a json_schema without a schema asks for any JSON object.
    if (!schema || schema->k == json::kind::null) {
      out.kind = grammar_kind::json_object;
      out.source.clear();
      return std::nullopt;
    }
    return take_schema("response_format.json_schema.schema", *schema, out, lim);
  }
  return field_error{422, "response_format.type",
                     fmt::format("response_format type '{}' is not supported; use \"text\", \"json_object\" or "
                                 "\"json_schema\"",
                                 type->s),
                     "invalid_value"};
}

}  // namespace tandem::transport
