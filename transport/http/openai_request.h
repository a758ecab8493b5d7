#pragma once
/// Typed access to the fields of an OpenAI request body (wrong types are 400s naming the
/// field) and the parameters both POST routes share.
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "transport/http/generation.h"
#include "transport/http/json.h"

namespace tandem::openai {

/// Field `k` of object `o`; null when absent or JSON null.
const json::value* field(const json::value& o, std::string_view k);
/// Throws the 400 invalid_type naming `name`, what it must be and what it is.
[[noreturn]] void wrong_type(std::string_view name, std::string_view want, const json::value& v);
std::optional<double> get_number(const json::value& o, std::string_view k);
std::optional<int64_t> get_int(const json::value& o, std::string_view k);
std::optional<bool> get_bool(const json::value& o, std::string_view k);

int32_t clamp_i32(int64_t v);

/// What both POST routes accept.
struct parsed_request {
  transport::generation_params gen;
  bool stream = false;
  bool include_usage = false;
  bool max_tokens_set = false;  ///< else the default is what is left of the context
  std::vector<int32_t> prompt;
  int32_t logprobs = -1;      ///< top log-probabilities per token; -1 = none
  bool echo = false;          ///< completions: the prompt's text before the completion
  bool parse_tools = false;   ///< chat with tools (tool_choice not "none"): calls parsed from the reply
};

/// Sampling, max_tokens, stop, stream and model fields of `body` into `r`; throws http_error.
void parse_common(const json::value& body, parsed_request& r, bool chat);

/// logprobs/top_logprobs (chat: a boolean and a count; completions: a count), echo, and
/// whether tool calls are parsed; throws http_error naming the field.
void parse_output_options(const json::value& body, parsed_request& r, bool chat);

}  // namespace tandem::openai
