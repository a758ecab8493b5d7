#pragma once
/// `tool_choice` on /v1/chat/completions: "auto" (the model may call a tool; calls are parsed
/// from its text in the template's format), "none" (the tools are left out of the prompt and
/// nothing is parsed), "required" (the output is constrained to one call of any offered tool)
/// and {"type": "function", "function": {"name": N}} (constrained to one call of N).
///
/// A forced choice is grammar-constrained decoding (kernels/grammar) of the JSON object
/// `{"name": <the tool's name>, "arguments": <its parameters schema>}` (an anyOf of those for
/// "required"), which the front end then reads with the llama3_json tool-call parser (a bare
/// {name, arguments} object) whatever the template's own format is, so the call is always
/// schema-valid and always parsed.
#include <optional>
#include <string>

#include "actors/common/limits.h"
#include "kernels/grammar/grammar_spec.h"
#include "transport/http/json.h"
#include "transport/http/request_params.h"

namespace tandem::transport {

enum class tool_choice_mode { auto_choice, none, required, named };

struct tool_choice {
  tool_choice_mode mode = tool_choice_mode::auto_choice;
  std::string name;  ///< the function of a named choice
  /// The output is constrained to a call (required or named).
  bool forced() const { return mode == tool_choice_mode::required || mode == tool_choice_mode::named; }
};

/// Reads `tool_choice` (with `tools`) of a chat request into `out`; a forced choice sets
/// `grammar` to the call's schema, compiled here so that a parameters schema with a keyword the
/// compiler refuses is a 422 naming `tools[i].function.parameters` and the keyword. Errors:
/// a wrong JSON type is 400, a forced choice without tools, an unknown function name or a
/// forced choice together with response_format (`grammar` already active) is 422, all naming
/// `tool_choice`.
std::optional<field_error> parse_tool_choice(const json::value& body, tool_choice& out, grammar_spec& grammar,
                                             const limits& lim);

/// The JSON schema (text) of one call of tool `index` of `tools` (an array of OpenAI tool
/// objects, already checked by parse_tool_choice): {"type":"object","properties":{"name":
/// {"const":N},"arguments":{"$ref":"#/$defs/tool<index>"}},...} with the tool's parameters
/// under $defs (their own local $refs rewritten to point there). `all` gives the anyOf over
/// every tool instead.
std::string tool_call_schema(const json::value& tools, size_t index, bool all);

}  // namespace tandem::transport
