// libFuzzer target: the Jinja interpreter (transport/chat) on arbitrary templates, since a
// chat template comes from the model file or --chat-template-file: lexing, parsing and
// rendering against a conversation with tools and tool calls must never crash, hang or grow
// without bound; every failure is a jinja::error. Seeded with shared/chat-templates.
#include <cstdint>
#include <string_view>

#include "transport/chat/jinja.h"

namespace {

const tandem::jinja::value& context() {
  static const tandem::jinja::value ctx = tandem::jinja::from_json(R"({
    "messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "abc123def", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2.5, true, null]}}}]},
      {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "21"},
      {"role": "assistant", "content": "It is 21 \u00b0C."},
      {"role": "user", "content": "Thanks \"friend\" </think>"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["a", "b"]}},
        "required": ["city"]}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "documents": null})");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Small bounds keep each input fast; the limits themselves are what is being tested.
  tandem::jinja::limits lim;
  lim.max_steps = 200000;
  lim.max_output_bytes = 1 << 20;
  lim.max_list_items = 1 << 14;
  lim.max_depth = 128;
  tandem::jinja::environment env;
  env.now = [] { return std::time_t{1721995200}; };
  try {
    tandem::jinja::template_ t(std::string_view(reinterpret_cast<const char*>(data), size), lim);
    (void)t.render(context(), env);
  } catch (const tandem::jinja::error&) {
  }
  return 0;
}
