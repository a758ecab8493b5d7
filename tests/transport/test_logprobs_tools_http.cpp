// logprobs (chat and completions shapes, streaming and not), echo, and tool calls parsed out
// of the reply, through the HTTP front end against the fake serving_api (whose events carry
// log-probabilities when the request asks: the chosen token at -0.25, then id+1, id+2, ...).
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

using namespace tandem;
using namespace tandem::test;

namespace {

json::value parse_ok(const http_response& r) {
  INFO(r.body);
  REQUIRE(r.status == 200);
  return json::parse(r.body);
}

const json::value& choice0(const json::value& v) { return v.find("choices")->arr.at(0); }

std::vector<json::value> stream_chunks(const http_response& r) {
  INFO(r.body);
  REQUIRE(r.status == 200);
  bool ok = false;
  auto evs = sse_events(r.body, ok);
  CHECK(ok);
  std::vector<json::value> out;
  for (auto& e : evs) out.push_back(json::parse(e));
  return out;
}

/// A Hermes-style template: the reply's <tool_call> blocks are parsed.
front_end_options hermes_template() {
  auto o = server_fixture::options();
  o.chat_template =
      "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is not none else '' }}<|im_end|>\n"
      "{%- endfor %}{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
      "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
      "{#- calls are written as <tool_call>{...}</tool_call> #}";
  return o;
}

constexpr const char* k_tools = R"("tools":[{"type":"function","function":{"name":"get","parameters":{"type":"object"}}}])";

}  // namespace

TEST_CASE("logprobs http: chat logprobs/top_logprobs give content[] with token, logprob, bytes and top entries") {
  server_fixture s;
  s.api.set({.output = "Hi"});
  auto v = parse_ok(post(s.http_port, "/v1/chat/completions",
                         R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":2,"max_tokens":2,"ignore_eos":true})"));
  REQUIRE(s.api.submitted().size() == 1);
  CHECK(s.api.submitted()[0].logprobs == 2);
  auto& lp = *choice0(v).find("logprobs");
  REQUIRE(lp.k == json::kind::object);
  auto& content = lp.find("content")->arr;
  REQUIRE(content.size() == 2);
  CHECK(content[0].find("token")->s == "H");
  CHECK(content[0].find("logprob")->num == doctest::Approx(-0.25));
  REQUIRE(content[0].find("bytes")->arr.size() == 1);
  CHECK(content[0].find("bytes")->arr[0].i == 'H');
  auto& top = content[1].find("top_logprobs")->arr;
  REQUIRE(top.size() == 2);
  CHECK(top[0].find("token")->s == "i");
  CHECK(top[1].find("token")->s == "j");
  CHECK(top[1].find("logprob")->num == doctest::Approx(-1.25));
  // Not asked: null, and the engine is not asked either.
  auto plain = parse_ok(post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})"));
  CHECK(choice0(plain).find("logprobs")->k == json::kind::null);
  CHECK(s.api.submitted()[1].logprobs == -1);
}

TEST_CASE("logprobs http: completions logprobs N give tokens, token_logprobs, top_logprobs maps and text_offset") {
  server_fixture s;
  s.api.set({.output = "abc"});
  auto v = parse_ok(post(s.http_port, "/v1/completions", R"({"prompt":"p","logprobs":2,"max_tokens":3,"ignore_eos":true})"));
  auto& lp = *choice0(v).find("logprobs");
  REQUIRE(lp.k == json::kind::object);
  REQUIRE(lp.find("tokens")->arr.size() == 3);
  CHECK(lp.find("tokens")->arr[2].s == "c");
  CHECK(lp.find("token_logprobs")->arr[0].num == doctest::Approx(-0.25));
  CHECK(lp.find("text_offset")->arr[1].i == 1);
  auto& top0 = lp.find("top_logprobs")->arr[0];
  REQUIRE(top0.obj.size() == 2);
  CHECK(top0.find("b")->num == doctest::Approx(-1.25));
}

TEST_CASE("logprobs http: streamed chunks carry their tokens' logprobs, every token exactly once") {
  server_fixture s;
  s.api.set({.output = "Hello", .chunk = 2});
  auto chunks = stream_chunks(post(s.http_port, "/v1/chat/completions",
                                   R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"max_tokens":5,"ignore_eos":true,"stream":true})"));
  std::string tokens, text;
  for (auto& c : chunks) {
    auto& ch = choice0(c);
    if (auto* d = ch.find("delta")->find("content"); d && d->k == json::kind::string) text += d->s;
    auto* lp = ch.find("logprobs");
    REQUIRE(lp);
    if (lp->k == json::kind::null) continue;
    for (auto& e : lp->find("content")->arr) tokens += e.find("token")->s;
  }
  CHECK(text == "Hello");
  CHECK(tokens == "Hello");
  // Completions streaming: text_offset continues across chunks.
  auto cchunks = stream_chunks(post(s.http_port, "/v1/completions", R"({"prompt":"p","logprobs":0,"max_tokens":5,"ignore_eos":true,"stream":true})"));
  std::vector<int64_t> offsets;
  for (auto& c : cchunks)
    if (auto* lp = choice0(c).find("logprobs"); lp && lp->k == json::kind::object)
      for (auto& o : lp->find("text_offset")->arr) offsets.push_back(o.i);
  CHECK(offsets == std::vector<int64_t>{0, 1, 2, 3, 4});
}

TEST_CASE("logprobs http: a stop string keeps the logprobs of the tokens up to the one that completed it") {
  server_fixture s;
  s.api.set({.output = "abcdef"});
  auto v = parse_ok(post(s.http_port, "/v1/completions", R"({"prompt":"p","logprobs":0,"stop":"cd","max_tokens":6,"ignore_eos":true})"));
  CHECK(choice0(v).find("text")->s == "ab");
  CHECK(choice0(v).find("logprobs")->find("tokens")->arr.size() == 4);
}

TEST_CASE("logprobs http: bounds and combinations are 422 naming the parameter") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})");
  CHECK(r.status == 422);
  CHECK(r.body.find("\"param\":\"top_logprobs\"") != std::string::npos);
  r = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})");
  CHECK(r.status == 422);
  CHECK(r.body.find("0 to 20") != std::string::npos);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"x","logprobs":-1})");
  CHECK(r.status == 422);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"x","logprobs":1,"echo":true})");
  CHECK(r.status == 422);
  CHECK(r.body.find("\"param\":\"echo\"") != std::string::npos);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"x","suffix":"y"})");
  CHECK(r.status == 422);
  CHECK(r.body.find("\"param\":\"suffix\"") != std::string::npos);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"x","best_of":2})");
  CHECK(r.status == 422);
  CHECK(r.body.find("\"param\":\"best_of\"") != std::string::npos);
  CHECK(post(s.http_port, "/v1/completions", R"({"prompt":"x","best_of":1,"max_tokens":2})").status == 200);
  CHECK(s.api.submitted().size() == 1);
}

TEST_CASE("echo http: the prompt's text comes before the completion, streaming and not") {
  server_fixture s;
  s.api.set({.output = "Hi"});
  auto v = parse_ok(post(s.http_port, "/v1/completions", R"({"prompt":"Say: ","echo":true,"max_tokens":2,"ignore_eos":true})"));
  CHECK(choice0(v).find("text")->s == "Say: Hi");
  auto ids = parse_ok(post(s.http_port, "/v1/completions", R"({"prompt":[86,100],"echo":true,"max_tokens":2,"ignore_eos":true})"));
  CHECK(choice0(ids).find("text")->s == "Sa" + std::string("Hi"));
  auto chunks = stream_chunks(post(s.http_port, "/v1/completions", R"({"prompt":"Say: ","echo":true,"max_tokens":2,"ignore_eos":true,"stream":true})"));
  std::string text;
  for (auto& c : chunks) text += choice0(c).find("text")->s;
  CHECK(text == "Say: Hi");
}

TEST_CASE("tool calls http: a hermes reply becomes message.tool_calls with finish_reason tool_calls") {
  server_fixture s(hermes_template());
  s.api.context_tokens = 1024;
  s.api.set({.output = "<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", .chunk = 5});
  const std::string body = std::string(R"({"messages":[{"role":"user","content":"weather?"}],)") + k_tools + "}";
  auto v = parse_ok(post(s.http_port, "/v1/chat/completions", body));
  auto& c = choice0(v);
  CHECK(c.find("finish_reason")->s == "tool_calls");
  auto& msg = *c.find("message");
  CHECK(msg.find("content")->k == json::kind::null);
  REQUIRE(msg.find("tool_calls"));
  auto& calls = msg.find("tool_calls")->arr;
  REQUIRE(calls.size() == 1);
  CHECK(calls[0].find("type")->s == "function");
  CHECK(calls[0].find("id")->s.starts_with("call_"));
  CHECK(calls[0].find("function")->find("name")->s == "get");
  CHECK(calls[0].find("function")->find("arguments")->s == R"({"city":"Paris"})");

  // Streamed: no markup leaks into content; the call arrives as delta.tool_calls with index 0.
  auto chunks = stream_chunks(post(s.http_port, "/v1/chat/completions",
                                   std::string(R"({"messages":[{"role":"user","content":"weather?"}],"stream":true,)") + k_tools + "}"));
  std::string content, name, args, finish;
  for (auto& ch : chunks) {
    auto& c0 = choice0(ch);
    auto& d = *c0.find("delta");
    if (auto* t = d.find("content"); t && t->k == json::kind::string) content += t->s;
    if (auto* tc = d.find("tool_calls")) {
      for (auto& e : tc->arr) {
        CHECK(e.find("index")->i == 0);
        if (auto* f = e.find("function")) {
          if (auto* n = f->find("name")) name += n->s;
          if (auto* a = f->find("arguments")) args += a->s;
        }
      }
    }
    if (auto* f = c0.find("finish_reason"); f && f->k == json::kind::string) finish = f->s;
  }
  CHECK(content.find("tool_call") == std::string::npos);
  CHECK(name == "get");
  CHECK(args == R"({"city":"Paris"})");
  CHECK(finish == "tool_calls");
  CHECK(get(s.http_port, "/metrics").body.find("\ntandem_http_tool_calls_total 2\n") != std::string::npos);
}

TEST_CASE("tool calls http: text stays content, and tool_choice none or no tools leaves the reply alone") {
  server_fixture s(hermes_template());
  s.api.context_tokens = 1024;
  s.api.set({.output = "It is sunny."});
  auto v = parse_ok(post(s.http_port, "/v1/chat/completions",
                         std::string(R"({"messages":[{"role":"user","content":"weather?"}],)") + k_tools + "}"));
  CHECK(choice0(v).find("message")->find("content")->s == "It is sunny.");
  CHECK(choice0(v).find("message")->find("tool_calls") == nullptr);
  CHECK(choice0(v).find("finish_reason")->s == "stop");
  const std::string call = "<tool_call>{\"name\": \"get\", \"arguments\": {}}</tool_call>";
  s.api.set({.output = call});
  auto none = parse_ok(post(s.http_port, "/v1/chat/completions",
                            std::string(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"none",)") + k_tools + "}"));
  CHECK(choice0(none).find("message")->find("content")->s == call);
  auto no_tools = parse_ok(post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}]})"));
  CHECK(choice0(no_tools).find("message")->find("content")->s == call);
}
