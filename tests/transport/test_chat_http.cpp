// /v1/chat/completions through a chat template (transport/chat/chat_prompt.h) against the
// fake serving_api: the override template renders the messages, role tool and tool calls are
// accepted, refusals and malformed tool calls are 4xx naming the problem.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// ChatML with tool calls and a refusal for role "developer", small enough to check by hand.
constexpr const char* k_template =
    "{%- for m in messages %}"
    "{%- if m.role == 'developer' %}{{ raise_exception('developer messages are not supported') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content if m.content is not none else '' }}"
    "{%- for c in m.tool_calls | default([]) %}<call>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{%- if m.tool_call_id is defined %} (for {{ m.tool_call_id }}){% endif %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

front_end_options with_template() {
  auto o = server_fixture::options();
  o.chat_template = k_template;
  return o;
}

}  // namespace

TEST_CASE("chat http: an override template renders messages, tool calls, tool results and tools") {
  server_fixture s(with_template());
  s.api.context_tokens = 1024;  // one byte per token: the prompt is about 200
  auto r = post(s.http_port, "/v1/chat/completions", R"({"messages":[
      {"role":"system","content":"sys"},
      {"role":"user","content":[{"type":"text","text":"weather?"}]},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get","arguments":"{\"city\":\"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"21"}],
    "tools":[{"type":"function","function":{"name":"get","parameters":{}}}],"max_tokens":3})");
  INFO(r.body);
  REQUIRE(r.status == 200);
  const std::string want =
      "<|im_start|>system\nsys<|im_end|><|im_start|>user\nweather?<|im_end|>"
      "<|im_start|>assistant\n<call>get{\"city\": \"Paris\"}</call><|im_end|>"
      "<|im_start|>tool\n21 (for c1)<|im_end|>tools: get\n<|im_start|>assistant\n";
  REQUIRE(s.api.submitted().size() == 1);
  const std::vector<int32_t> prompt = s.api.submitted()[0].prompt;
  CHECK(fake_tokenizer().decode(prompt) == want);
  CHECK(prompt == fake_tokenizer().encode(want, true, true));
}

TEST_CASE("chat http: a template's refusal is 422 with its message, malformed tool calls are 400") {
  server_fixture s(with_template());
  auto r = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"developer","content":"x"}]})");
  CHECK(r.status == 422);
  CHECK(r.body.find("developer messages are not supported") != std::string::npos);
  auto bad = post(s.http_port, "/v1/chat/completions",
                  R"({"messages":[{"role":"assistant","tool_calls":[{"type":"function","function":{"arguments":"{}"}}]}]})");
  CHECK(bad.status == 400);
  CHECK(bad.body.find("function.name is required") != std::string::npos);
  auto tools = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"tools":{}})");
  CHECK(tools.status == 400);
  CHECK(tools.body.find("'tools' must be an array") != std::string::npos);
  auto robot = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"robot","content":"x"}]})");
  CHECK(robot.status == 422);
  CHECK(robot.body.find("robot\\\" is not supported") != std::string::npos);
}

TEST_CASE("chat http: without a template, tool messages and tools get 422 naming --chat-template-file") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/chat/completions",
                R"({"messages":[{"role":"user","content":"x"},{"role":"tool","tool_call_id":"a","content":"1"}]})");
  CHECK(r.status == 422);
  CHECK(r.body.find("--chat-template-file") != std::string::npos);
  auto t = post(s.http_port, "/v1/chat/completions",
                R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]})");
  CHECK(t.status == 422);
  CHECK(t.body.find("--chat-template-file") != std::string::npos);
}
