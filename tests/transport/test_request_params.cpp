// The parameter policy of the OpenAI routes: honoured, advisory (ignored by design), refused;
// the model name; max_completion_tokens and the default max_tokens.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/request_params.h"

using namespace tandem;
using namespace tandem::test;
using transport::field_policy;

TEST_CASE("request params: fields are classified per route") {
  CHECK(transport::classify_field("temperature", false) == field_policy::honoured);
  CHECK(transport::classify_field("max_completion_tokens", false) == field_policy::honoured);
  CHECK(transport::classify_field("prompt", false) == field_policy::honoured);
  CHECK(transport::classify_field("prompt", true) == field_policy::unknown);
  CHECK(transport::classify_field("messages", true) == field_policy::honoured);
  CHECK(transport::classify_field("user", true) == field_policy::advisory);
  CHECK(transport::classify_field("metadata", false) == field_policy::advisory);
  CHECK(transport::classify_field("echo", false) == field_policy::honoured);
  CHECK(transport::classify_field("suffix", false) == field_policy::honoured);
  CHECK(transport::classify_field("echo", true) == field_policy::unknown);
  CHECK(transport::classify_field("top_logprobs", true) == field_policy::honoured);
  CHECK(transport::classify_field("best_of", false) == field_policy::refused);
  CHECK(transport::classify_field("presence_penalty", true) == field_policy::honoured);
  CHECK(transport::classify_field("logit_bias", false) == field_policy::honoured);
  CHECK(transport::classify_field("no_such_thing", true) == field_policy::unknown);
}

TEST_CASE("request params: neutral values of refused fields pass, others are named") {
  // What LangChain and friends send by default.
  auto defaults = json::parse(R"({"presence_penalty":0,"frequency_penalty":0,"logit_bias":{},"n":1,"logprobs":false,
    "top_logprobs":null,"response_format":{"type":"text"},"tools":[],"tool_choice":"none","parallel_tool_calls":true,
    "user":"u","store":false,"metadata":{"a":"b"},"service_tier":"auto","messages":[]})");
  CHECK_FALSE(transport::check_fields(defaults, true).has_value());
  auto e = transport::check_fields(json::parse(R"({"prompt":"a","best_of":2})"), false);
  REQUIRE(e.has_value());
  CHECK(e->param == "best_of");
  CHECK(e->message.find("send 1") != std::string::npos);
  // suffix is honoured where the model has FIM tokens (checked where parsed: test_fim_http).
  CHECK_FALSE(transport::check_fields(json::parse(R"({"prompt":"a","suffix":"b"})"), false).has_value());
  e = transport::check_fields(json::parse(R"({"prompt":"a","bogus":1})"), false);
  REQUIRE(e.has_value());
  CHECK(e->param == "bogus");
  CHECK(e->message.find("/v1/completions") != std::string::npos);
}

TEST_CASE("request params: default max_tokens is what is left of the context, bounded by max_new_tokens") {
  limits l;
  l.max_new_tokens = 64;
  CHECK(transport::default_max_tokens(100, 128, l) == 28);
  CHECK(transport::default_max_tokens(10, 128, l) == 64);
  CHECK(transport::default_max_tokens(128, 128, l) == 1);  // check_params then names the context
  CHECK(transport::default_max_tokens(500, 128, l) == 1);
}

TEST_CASE("request params: chat without max_tokens runs to the context, max_completion_tokens on both routes") {
  limits l;
  l.max_new_tokens = 64;
  server_fixture s(l);
  auto r = post(s.http_port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}]})");
  REQUIRE(r.status == 200);
  REQUIRE(s.api.submitted().size() == 1);
  CHECK(s.api.submitted()[0].max_tokens == 64);  // the fake context is 128; the prompt is short
  r = post(s.http_port, "/v1/completions", R"({"prompt":[)" + [] {
    std::string p;
    for (int i = 0; i < 100; ++i) p += (i ? "," : "") + std::to_string(65);
    return p;
  }() + "]}");
  REQUIRE(r.status == 200);
  CHECK(s.api.submitted()[1].max_tokens == 28);
  r = post(s.http_port, "/v1/completions", R"({"prompt":"a","max_completion_tokens":3})");
  REQUIRE(r.status == 200);
  CHECK(s.api.submitted()[2].max_tokens == 3);
  r = post(s.http_port, "/v1/chat/completions",
           R"({"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":4,"max_tokens":4,"user":"x"})");
  REQUIRE(r.status == 200);
  CHECK(s.api.submitted()[3].max_tokens == 4);
}

TEST_CASE("request params: model names") {
  {
    server_fixture s;
    CHECK(post(s.http_port, "/v1/completions", R"({"prompt":"a","max_tokens":2})").status == 200);
    CHECK(post(s.http_port, "/v1/completions", R"({"prompt":"a","max_tokens":2,"model":"fake-model"})").status == 200);
    auto r = get(s.http_port, "/v1/models/fake-model");
    REQUIRE(r.status == 200);
    auto j = json::parse(r.body);
    CHECK(j.find("id")->s == "fake-model");
    CHECK(j.find("object")->s == "model");
    CHECK(post(s.http_port, "/v1/completions", R"({"prompt":"a","max_tokens":2,"model":"other"})").status == 404);
  }
  limits l;
  l.accept_any_model_name = true;
  server_fixture s(l);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"a","max_tokens":2,"model":"gpt-4o"})");
  REQUIRE(r.status == 200);
  CHECK(json::parse(r.body).find("model")->s == "fake-model");  // the answer names the model that answered
}

TEST_CASE("request params: penalties, min_p and logit_bias reach the engine request") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/chat/completions",
                R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"presence_penalty":0.5,
                    "frequency_penalty":-0.25,"repetition_penalty":1.3,"min_p":0.1,"logit_bias":{"7":-100,"65":2.5}})");
  REQUIRE(r.status == 200);
  REQUIRE(s.api.submitted().size() == 1);
  const auto p = s.api.submitted()[0].sampling;  // submitted() returns a copy
  CHECK(p.presence_penalty == 0.5f);
  CHECK(p.frequency_penalty == -0.25f);
  CHECK(p.repetition_penalty == 1.3f);
  CHECK(p.min_p == 0.1f);
  CHECK(p.logit_bias == std::vector<std::pair<int32_t, float>>{{7, -100.0f}, {65, 2.5f}});
  CHECK(p.validate() == "");
  r = post(s.http_port, "/v1/completions", R"({"prompt":"a","max_tokens":2,"stream":true,"presence_penalty":1})");
  REQUIRE(r.status == 200);
  REQUIRE(s.api.submitted().size() == 2);
  CHECK(s.api.submitted()[1].sampling.presence_penalty == 1.0f);
}
