// `n` choices over HTTP against the fake serving_api (which runs each choice in turn): indices,
// per-choice finish reasons and stop strings, usage summed over the choices, streaming.
#include <doctest/doctest.h>

#include <map>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;

namespace {

json::value body_json(const http_response& r) {
  INFO("body: " << r.body);
  return json::parse(r.body);
}

}  // namespace

TEST_CASE("http: n = 3 returns choices 0..2, usage sums the completion tokens, the engine got n") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"abc","max_tokens":5,"n":3})");
  REQUIRE(r.status == 200);
  auto j = body_json(r);
  auto* c = j.find("choices");
  REQUIRE(c);
  REQUIRE(c->arr.size() == 3);
  for (size_t k = 0; k < 3; ++k) {
    CHECK(c->arr[k].find("index")->i == int64_t(k));
    CHECK(c->arr[k].find("text")->s == "Hello");
    CHECK(c->arr[k].find("finish_reason")->s == "length");
  }
  CHECK(j.find("usage")->find("prompt_tokens")->i == 4);
  CHECK(j.find("usage")->find("completion_tokens")->i == 15);
  CHECK(j.find("usage")->find("total_tokens")->i == 19);
  auto sub = s.api.submitted();
  REQUIRE(sub.size() == 1);
  CHECK(sub[0].n == 3);

  // Chat: a stop string ends each choice's text; the engine is told per choice.
  auto rc = post(s.http_port, "/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"n":2,"stop":" wor"})");
  REQUIRE(rc.status == 200);
  auto jc = body_json(rc);
  REQUIRE(jc.find("choices")->arr.size() == 2);
  for (const auto& ch : jc.find("choices")->arr) {
    CHECK(ch.find("message")->find("content")->s == "Hello");
    CHECK(ch.find("finish_reason")->s == "stop");
  }
}

TEST_CASE("http: n = 2 streams chunks with their choice's index and one finish_reason per index, then usage") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/chat/completions",
                R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"n":2,"stream":true,)"
                R"("stream_options":{"include_usage":true}})");
  REQUIRE(r.status == 200);
  bool ok = false;
  auto evs = sse_events(r.body, ok);
  INFO("body: " << r.body);
  CHECK(ok);
  REQUIRE(evs.size() >= 3);
  std::map<int64_t, std::string> text, finish;
  for (size_t i = 0; i + 1 < evs.size(); ++i) {
    auto j = json::parse(evs[i]);
    auto& ch = j.find("choices")->arr;
    REQUIRE(ch.size() == 1);
    const int64_t k = ch[0].find("index")->i;
    CHECK(finish[k].empty());  // nothing of a choice after its finish_reason
    auto* d = ch[0].find("delta");
    if (auto* content = d->find("content"); content && content->k == json::kind::string) text[k] += content->s;
    if (auto* f = ch[0].find("finish_reason"); f->k == json::kind::string) finish[k] = f->s;
  }
  CHECK(text[0] == "Hello world");
  CHECK(text[1] == "Hello world");
  CHECK(finish[0] == "stop");
  CHECK(finish[1] == "stop");
  CHECK(finish.size() == 2);
  auto last = json::parse(evs.back());
  CHECK(last.find("choices")->arr.empty());
  CHECK(last.find("usage")->find("completion_tokens")->i == 24);
}

TEST_CASE("http: n above limits.max_choices is 422 naming n and the bound") {
  limits lim;
  lim.max_choices = 4;
  server_fixture s(lim);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"abc","n":5})");
  CHECK(r.status == 422);
  auto j = body_json(r);
  CHECK(j.find("error")->find("param")->s == "n");
  CHECK(j.find("error")->find("message")->s.find("use 1 to 4 (limits.max_choices = 4") != std::string::npos);
  auto b = post(s.http_port, "/v1/completions", R"({"prompt":"abc","n":2,"best_of":2})");
  CHECK(b.status == 422);
  CHECK(body_json(b).find("error")->find("param")->s == "best_of");
}
