#include "transport/http/tool_choice.h"

#include <fmt/format.h>

#include "kernels/base/error.h"
#include "kernels/grammar/json_schema.h"
#include "transport/http/response_format.h"

namespace tandem::transport {
namespace {

const json::value* present(const json::value& o, std::string_view k) {
  const json::value* v = o.find(k);
  return v && v->k != json::kind::null ? v : nullptr;
}

field_error choice_error(unsigned status, std::string message, std::string code = "invalid_value") {
  return {status, "tool_choice", std::move(message), std::move(code)};
}

/// The parameters schema of a tool; a function without one takes no arguments.
json::value parameters_of(const json::value& tool) {
  if (const json::value* p = present(*present(tool, "function"), "parameters")) return *p;
  return json::parse(R"({"type":"object","properties":{},"additionalProperties":false})");
}

/// Points the local $refs of a tool's parameters (written against the parameters as root) at
/// where they now live: "#/..." becomes "#/$defs/tool<i>/...". Values that are data, not
/// schemas (enum, const, default, examples), are left alone; `names` marks a map from names to
/// schemas (properties, $defs), whose keys are not keywords.
void rebase_refs(json::value& v, const std::string& base, bool names = false) {
  if (v.k == json::kind::array) {
    for (auto& e : v.arr) rebase_refs(e, base);
    return;
  }
  if (v.k != json::kind::object) return;
  for (auto& m : v.obj) {
    if (names) {
      rebase_refs(m.second, base);
      continue;
    }
    if (m.first == "enum" || m.first == "const" || m.first == "default" || m.first == "examples") continue;
    if (m.first == "$ref" && m.second.k == json::kind::string && m.second.s.starts_with('#'))
      m.second.s = base + m.second.s.substr(1);
    else
      rebase_refs(m.second, base, m.first == "properties" || m.first == "$defs" || m.first == "definitions");
  }
}

/// Checks that every entry of `tools` is {"type": "function", "function": {"name": ..., ...}}.
std::optional<field_error> check_tools(const json::value& tools) {
  for (size_t i = 0; i < tools.arr.size(); ++i) {
    const json::value& t = tools.arr[i];
    const std::string at = fmt::format("tools[{}]", i);
    const json::value* type = t.k == json::kind::object ? present(t, "type") : nullptr;
    const json::value* fn = t.k == json::kind::object ? present(t, "function") : nullptr;
    if (!fn || fn->k != json::kind::object || (type && (type->k != json::kind::string || type->s != "function")))
      return field_error{400, at, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                              "\"parameters\": {{...}}}}}}", at), "invalid_type"};
    const json::value* name = present(*fn, "name");
    if (!name || name->k != json::kind::string || name->s.empty())
      return field_error{400, at + ".function.name", fmt::format("'{}.function.name' must be a non-empty string", at),
                         "invalid_type"};
    const json::value* params = present(*fn, "parameters");
    if (params && params->k != json::kind::object)
      return field_error{400, at + ".function.parameters",
                         fmt::format("'{}.function.parameters' must be a JSON schema object, got {}", at,
                                     json::kind_name(params->k)),
                         "invalid_type"};
  }
  return std::nullopt;
}

/// The members of a call object of the function `name` (tool `index`), into an open object.
void write_call_members(json::writer& w, const std::string& name, size_t index) {
  w.key("type").str("object").key("properties").begin_object();
  w.key("name").begin_object().key("const").str(name).end_object();
  w.key("arguments").begin_object().key("$ref").str(fmt::format("#/$defs/tool{}", index)).end_object();
  w.end_object().key("required").begin_array().str("name").str("arguments").end_array();
  w.key("additionalProperties").boolean(false);
}

const std::string& tool_name(const json::value& tool) { return present(*present(tool, "function"), "name")->s; }

}  // namespace

std::string tool_call_schema(const json::value& tools, size_t index, bool all) {
  const size_t first = all ? 0 : index, last = all ? tools.arr.size() : index + 1;
  json::writer w;
  w.begin_object();
  if (all) {
    w.key("anyOf").begin_array();
    for (size_t i = first; i < last; ++i) {
      w.begin_object();
      write_call_members(w, tool_name(tools.arr[i]), i);
      w.end_object();
    }
    w.end_array();
  } else {
    write_call_members(w, tool_name(tools.arr[index]), index);
  }
  // The parameters next to the call, where its "arguments" $ref points.
  w.key("$defs").begin_object();
  for (size_t i = first; i < last; ++i) {
    json::value p = parameters_of(tools.arr[i]);
    rebase_refs(p, fmt::format("#/$defs/tool{}", i));
    w.key(fmt::format("tool{}", i)).raw(to_json_text(p));
  }
  w.end_object().end_object();
  return w.take();
}

std::optional<field_error> parse_tool_choice(const json::value& body, tool_choice& out, grammar_spec& grammar,
                                             const limits& lim) {
  out = {};
  const json::value* choice = present(body, "tool_choice");
  if (!choice) return std::nullopt;
  if (choice->k == json::kind::string) {
    if (choice->s == "auto") return std::nullopt;
    if (choice->s == "none") out.mode = tool_choice_mode::none;
    else if (choice->s == "required") out.mode = tool_choice_mode::required;
    else
      return choice_error(422, fmt::format("tool_choice '{}' is not supported; use \"auto\", \"none\", \"required\" or "
                                           "{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", choice->s));
  } else if (choice->k == json::kind::object) {
    const json::value* type = present(*choice, "type");
    const json::value* fn = present(*choice, "function");
    const json::value* name = fn && fn->k == json::kind::object ? present(*fn, "name") : nullptr;
    if (!type || type->k != json::kind::string || type->s != "function" || !name || name->k != json::kind::string)
      return choice_error(400, "'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          "invalid_type");
    out.mode = tool_choice_mode::named;
    out.name = name->s;
  } else {
    return choice_error(400, fmt::format("'tool_choice' must be a string or an object, got {}", json::kind_name(choice->k)),
                        "invalid_type");
  }
  if (!out.forced()) return std::nullopt;

  const json::value* tools = present(body, "tools");
  if (!tools || tools->k != json::kind::array || tools->arr.empty())
    return choice_error(422, "tool_choice forces a tool call but the request has no tools; send 'tools' or use "
                             "tool_choice \"auto\"/\"none\"");
  if (grammar.active())
    return choice_error(422, "tool_choice forces a tool call, which constrains the output as response_format does; "
                             "send one of them");
  if (auto e = check_tools(*tools)) return e;
  size_t index = 0;
  if (out.mode == tool_choice_mode::named) {
    std::string names;
    for (; index < tools->arr.size(); ++index) {
      const std::string& n = tool_name(tools->arr[index]);
      if (n == out.name) break;
      names += (names.empty() ? "" : ", ") + n;
    }
    if (index == tools->arr.size())
      return choice_error(422, fmt::format("tool_choice names function '{}', which is not in tools ({})", out.name, names));
  }
  // Each constrained tool's parameters alone first, so an error names the tool and keyword.
  const bool all = out.mode == tool_choice_mode::required;
  for (size_t i = all ? 0 : index; i < (all ? tools->arr.size() : index + 1); ++i) {
    const std::string param = fmt::format("tools[{}].function.parameters", i);
    try {
      grammar::compile_json_schema(to_json_text(parameters_of(tools->arr[i])));
    } catch (const tandem::error& e) {
      return field_error{422, param, fmt::format("'{}' cannot constrain a forced tool call (tool_choice): {}", param,
                                                 e.what()),
                         "invalid_value"};
    }
  }
  std::string text = tool_call_schema(*tools, index, all);
  if (int64_t(text.size()) > int64_t(lim.max_grammar_bytes))
    return field_error{422, "tools",
                       fmt::format("the tool-call schema of tool_choice is {} bytes; at most {} are allowed "
                                   "(limits.max_grammar_bytes): send fewer or smaller tools",
                                   text.size(), lim.max_grammar_bytes),
                       "invalid_value"};
  try {
    grammar::compile_json_schema(text);
  } catch (const tandem::error& e) {
    return choice_error(422, fmt::format("the tool-call schema of tool_choice does not compile: {}", e.what()));
  }
  grammar.kind = grammar_kind::json_schema;
  grammar.source = std::move(text);
  return std::nullopt;
}

}  // namespace tandem::transport
