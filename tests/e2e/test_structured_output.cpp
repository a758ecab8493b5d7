// End to end: response_format json_schema / json_object on the real `tandem serve` with a
// random-weight model at temperature 1: every output is grammar-constrained, so it parses and
// validates against the schema (a validator of this schema below), whatever the weights.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <string>

#include "tests/e2e/pd_harness.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

// Nested object, enum, array (bounded), integer, bounded string, boolean, optional field.
constexpr const char* schema = R"({"type":"object","properties":{
  "kind":{"enum":["cat","dog",7]},
  "age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":3},
  "owner":{"type":"object","properties":{"name":{"type":"string","maxLength":6},"ok":{"type":"boolean"}},
           "required":["name","ok"],"additionalProperties":false},
  "note":{"type":["null","integer"]}},
  "required":["kind","age","tags","owner"],"additionalProperties":false})";

bool is_integer(const json::value& v) { return v.k == json::kind::number && v.is_int; }

/// The schema above, checked by hand: the test's independent reference.
std::string invalid_reason(const json::value& v) {
  if (v.k != json::kind::object) return "not an object";
  for (const auto& m : v.obj)
    if (m.first != "kind" && m.first != "age" && m.first != "tags" && m.first != "owner" && m.first != "note")
      return "extra property " + m.first;
  const auto* kind = v.find("kind");
  if (!kind || !((kind->k == json::kind::string && (kind->s == "cat" || kind->s == "dog")) ||
                 (is_integer(*kind) && kind->i == 7)))
    return "kind";
  if (!v.find("age") || !is_integer(*v.find("age"))) return "age";
  const auto* tags = v.find("tags");
  if (!tags || tags->k != json::kind::array || tags->arr.empty() || tags->arr.size() > 3) return "tags";
  for (const auto& t : tags->arr)
    if (!is_integer(t)) return "tags item";
  const auto* owner = v.find("owner");
  if (!owner || owner->k != json::kind::object || owner->obj.size() != 2) return "owner";
  const auto* name = owner->find("name");
  if (!name || name->k != json::kind::string) return "owner.name";
  size_t chars = 0;
  for (char c : name->s) chars += (uint8_t(c) & 0xC0) != 0x80;
  if (chars > 6) return "owner.name length";
  if (!owner->find("ok") || owner->find("ok")->k != json::kind::boolean) return "owner.ok";
  if (const auto* note = v.find("note"); note && note->k != json::kind::null && !is_integer(*note)) return "note";
  return "";
}

struct structured_choice {
  int status = 0;
  std::string text, finish_reason, raw;
};

structured_choice ask(uint16_t port, const std::string& path, const std::string& body) {
  auto resp = test::post(port, path, body);
  structured_choice c;
  c.status = resp.status;
  c.raw = resp.body;
  if (resp.status != 200) return c;
  auto v = json::parse(resp.body);
  const auto& ch = v.find("choices")->arr.at(0);
  c.finish_reason = ch.find("finish_reason")->s;
  c.text = path == "/v1/completions" ? ch.find("text")->s : ch.find("message")->find("content")->s;
  return c;
}

struct fixture {
  fixture() : model(write_micro_model(dir.path)), srv(model, (dir.path / "serve.log").string()) {}
  temp_dir dir;
  std::string model;
  server srv;
};

}  // namespace

TEST_CASE("structured output: 50 seeded json_schema requests at temperature 1 all parse and validate") {
  fixture f;
  int stopped = 0;
  for (int seed = 1; seed <= 50; ++seed) {
    const std::string body =
        fmt::format(R"({{"prompt":"Describe a pet as JSON:","max_tokens":400,"temperature":1,"seed":{},
                        "response_format":{{"type":"json_schema","json_schema":{{"name":"pet","strict":true,"schema":{}}}}}}})",
                    seed, schema);
    const structured_choice c = ask(f.srv.http_port, "/v1/completions", body);
    REQUIRE_MESSAGE(c.status == 200, c.raw);
    INFO("seed ", seed, ": ", c.text);
    CHECK(c.finish_reason == "stop");  // EOS is the only token once the document is complete
    json::value v;
    REQUIRE_NOTHROW(v = json::parse(c.text));
    CHECK(invalid_reason(v) == "");
    stopped += c.finish_reason == "stop";
  }
  CHECK(stopped == 50);
  // The chat route takes the same response_format.
  const std::string chat = fmt::format(
      R"({{"messages":[{{"role":"user","content":"a pet"}}],"max_tokens":400,"temperature":1,"seed":3,
          "response_format":{{"type":"json_schema","json_schema":{{"name":"pet","schema":{}}}}}}})",
      schema);
  const structured_choice c = ask(f.srv.http_port, "/v1/chat/completions", chat);
  REQUIRE_MESSAGE(c.status == 200, c.raw);
  CHECK(invalid_reason(json::parse(c.text)) == "");
  // The worker's metrics count the masked steps.
  const auto m = test::get(f.srv.http_port, "/metrics").body;
  CHECK(m.find("tandem_worker_grammar_steps_total") != std::string::npos);
}

TEST_CASE("structured output: json_object outputs parse as objects, and bad schemas are 422 naming the keyword") {
  fixture f;
  int stopped = 0;
  for (int seed = 1; seed <= 10; ++seed) {
    const std::string body = fmt::format(
        R"({{"prompt":"JSON:","max_tokens":300,"temperature":1,"seed":{},"response_format":{{"type":"json_object"}}}})", seed);
    const structured_choice c = ask(f.srv.http_port, "/v1/completions", body);
    REQUIRE_MESSAGE(c.status == 200, c.raw);
    INFO("seed ", seed, ": ", c.text);
    if (c.finish_reason != "stop") continue;  // a long document cut by max_tokens is a prefix
    ++stopped;
    json::value v;
    REQUIRE_NOTHROW(v = json::parse(c.text));
    CHECK(v.k == json::kind::object);
  }
  MESSAGE(stopped, " of 10 json_object documents completed within max_tokens");
  // llama-server's top-level json_schema on /v1/completions.
  const structured_choice c = ask(f.srv.http_port, "/v1/completions",
                            fmt::format(R"({{"prompt":"x","max_tokens":400,"seed":5,"json_schema":{}}})", schema));
  REQUIRE_MESSAGE(c.status == 200, c.raw);
  CHECK(invalid_reason(json::parse(c.text)) == "");
  auto bad = test::post(f.srv.http_port, "/v1/chat/completions",
                        R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema",
                            "json_schema":{"name":"x","schema":{"type":"string","pattern":"^a"}}}})");
  CHECK(bad.status == 422);
  CHECK(bad.body.find("'pattern'") != std::string::npos);
  CHECK(bad.body.find("response_format") != std::string::npos);
}

TEST_CASE("structured output: across a KV handoff the decode node rebuilds the grammar state from the generated tokens") {
  temp_dir dir;
  const std::string model = std::string(TANDEM_SHARED_MODELS) + "/r15m-f16.gguf";
  REQUIRE(std::filesystem::exists(model));
  pd_cluster pd(model, dir.path, "fail", false);
  INFO(pd.logs());
  for (int seed = 1; seed <= 6; ++seed) {
    const std::string body =
        fmt::format(R"({{"prompt":"A pet:","max_tokens":400,"temperature":1,"seed":{},
                        "response_format":{{"type":"json_schema","json_schema":{{"name":"pet","schema":{}}}}}}})",
                    seed, schema);
    const structured_choice c = ask(pd.router().http, "/v1/completions", body);
    REQUIRE_MESSAGE(c.status == 200, c.raw);
    INFO("seed ", seed, ": ", c.text);
    CHECK(c.finish_reason == "stop");
    json::value v;
    REQUIRE_NOTHROW(v = json::parse(c.text));
    CHECK(invalid_reason(v) == "");
  }
  // The decode worker never saw these sequences' first token: it replayed each one's history.
  const auto dm = test::get(pd.decode().http, "/metrics").body;
  CHECK(series(dm, "tandem_worker_grammar_replays_total") >= 6);
  CHECK(series(dm, "tandem_worker_grammar_steps_total") > 6);
}
