// tool_choice through the HTTP front end against the fake serving_api: a forced choice sends
// the call's grammar with the request and reads the (grammar-shaped) bare {name, arguments}
// reply as a call whatever the template's format; "none" keeps the tools out of the prompt.
#include <doctest/doctest.h>

#include "kernels/base/json.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// A Hermes-style template (its own calls would be <tool_call> blocks) that shows the tools.
front_end_options hermes_template() {
  auto o = server_fixture::options();
  o.chat_template =
      "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is not none else '' }}<|im_end|>\n"
      "{%- endfor %}{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
      "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
      "{#- calls are written as <tool_call>{...}</tool_call> #}";
  return o;
}

constexpr const char* k_tools =
    R"("tools":[{"type":"function","function":{"name":"get","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},
                {"type":"function","function":{"name":"put","parameters":{"type":"object"}}}])";

std::string chat_body(const std::string& extra) {
  return std::string(R"({"messages":[{"role":"user","content":"weather?"}],)") + k_tools + "," + extra + "}";
}

std::string prompt_text(const completion_request& r) {
  std::string s;
  for (int32_t id : r.prompt)
    if (id >= 3 && id < 259) s += char(id - 3);
  return s;
}

}  // namespace

TEST_CASE("tool_choice http: a named function sends the call's grammar and the reply becomes tool_calls") {
  server_fixture s(hermes_template());
  s.api.context_tokens = 2048;
  s.api.set({.output = R"({"name": "get", "arguments": {"city": "Paris"}})", .chunk = 4});
  auto r = post(s.http_port, "/v1/chat/completions",
                chat_body(R"("tool_choice":{"type":"function","function":{"name":"get"}})"));
  INFO(r.body);
  REQUIRE(r.status == 200);
  REQUIRE(s.api.submitted().size() == 1);
  const grammar_spec g = s.api.submitted()[0].sampling.grammar;  // submitted() is a copy
  REQUIRE(g.kind == grammar_kind::json_schema);
  auto schema = json::parse(g.source);
  CHECK(schema.find("properties")->find("name")->find("const")->s == "get");
  CHECK(prompt_text(s.api.submitted()[0]).find("<tools>") != std::string::npos);
  auto v = json::parse(r.body);
  auto& c = v.find("choices")->arr.at(0);
  CHECK(c.find("finish_reason")->s == "tool_calls");
  CHECK(c.find("message")->find("content")->k == json::kind::null);
  auto& calls = c.find("message")->find("tool_calls")->arr;
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].find("function")->find("name")->s == "get");
  CHECK(calls[0].find("function")->find("arguments")->s == R"({"city":"Paris"})");

  // Streamed: one delta.tool_calls entry, no content, finish_reason tool_calls.
  auto st = post(s.http_port, "/v1/chat/completions", chat_body(R"("tool_choice":"required","stream":true)"));
  REQUIRE(st.status == 200);
  bool ok = false;
  std::string content, name, args, finish;
  for (auto& e : sse_events(st.body, ok)) {
    auto ch = json::parse(e);
    auto& c0 = ch.find("choices")->arr.at(0);
    auto& d = *c0.find("delta");
    if (auto* t = d.find("content"); t && t->k == json::kind::string) content += t->s;
    if (auto* tc = d.find("tool_calls"))
      for (auto& x : tc->arr) {
        CHECK(x.find("index")->i == 0);
        name += x.find("function")->find("name")->s;
        args += x.find("function")->find("arguments")->s;
      }
    if (auto* f = c0.find("finish_reason"); f && f->k == json::kind::string) finish = f->s;
  }
  CHECK(ok);
  CHECK(content == "");
  CHECK(name == "get");
  CHECK(args == R"({"city":"Paris"})");
  CHECK(finish == "tool_calls");
  // required: the anyOf over both tools went with the request.
  REQUIRE(s.api.submitted().size() == 2);
  auto any = json::parse(s.api.submitted()[1].sampling.grammar.source);
  REQUIRE(any.find("anyOf"));
  CHECK(any.find("anyOf")->arr.size() == 2);
}

TEST_CASE("tool_choice http: none leaves the tools out of the prompt and parses nothing, and errors name the field") {
  server_fixture s(hermes_template());
  s.api.context_tokens = 2048;
  const std::string call = R"(<tool_call>{"name": "get", "arguments": {}}</tool_call>)";
  s.api.set({.output = call});
  auto none = post(s.http_port, "/v1/chat/completions", chat_body(R"("tool_choice":"none")"));
  INFO(none.body);
  REQUIRE(none.status == 200);
  CHECK(json::parse(none.body).find("choices")->arr.at(0).find("message")->find("content")->s == call);
  REQUIRE(s.api.submitted().size() == 1);
  CHECK(prompt_text(s.api.submitted()[0]).find("<tools>") == std::string::npos);
  CHECK(!s.api.submitted()[0].sampling.grammar.active());
  auto with = post(s.http_port, "/v1/chat/completions", chat_body(R"("tool_choice":"auto")"));
  REQUIRE(with.status == 200);
  CHECK(prompt_text(s.api.submitted()[1]).find("<tools>") != std::string::npos);

  auto bad = post(s.http_port, "/v1/chat/completions",
                  std::string(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required",)") +
                      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"n":{"type":"number","minimum":0}}}}}]})");
  CHECK(bad.status == 422);
  CHECK(bad.body.find(R"("param":"tools[0].function.parameters")") != std::string::npos);
  CHECK(bad.body.find("'minimum'") != std::string::npos);
  auto unknown = post(s.http_port, "/v1/chat/completions",
                      chat_body(R"("tool_choice":{"type":"function","function":{"name":"nope"}})"));
  CHECK(unknown.status == 422);
  CHECK(unknown.body.find(R"("param":"tool_choice")") != std::string::npos);
  auto both = post(s.http_port, "/v1/chat/completions",
                   chat_body(R"("tool_choice":"required","response_format":{"type":"json_object"})"));
  CHECK(both.status == 422);
  CHECK(both.body.find(R"("param":"tool_choice")") != std::string::npos);
  // Completions still refuses a forcing tool_choice (it has no tools).
  auto comp = post(s.http_port, "/v1/completions", R"({"prompt":"x","tool_choice":"required"})");
  CHECK(comp.status == 422);
  CHECK(comp.body.find(R"("param":"tool_choice")") != std::string::npos);
  CHECK(s.api.submitted().size() == 2);
}
