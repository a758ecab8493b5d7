// End to end: tool_choice "required" and a named function on the real `tandem serve` with a
// random-weight model at temperature 1 (tiny-15m, the Qwen 2.5 template, whose own calls are
// <tool_call> blocks): the output is grammar-constrained to one call, so every reply is one
// parsed tool call whose arguments validate against the tool's parameters (a validator of
// these schemas below), whatever the weights.
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "kernels/model/make_model.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr const char* k_weather = R"({"type":"function","function":{"name":"get_weather","description":"Weather of a city",
  "parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":12},"unit":{"enum":["celsius","fahrenheit"]},
  "days":{"type":"integer"}},"required":["city","unit","days"],"additionalProperties":false}}})";
constexpr const char* k_add = R"({"type":"function","function":{"name":"add","description":"Adds two integers",
  "parameters":{"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}},"required":["a","b"],
  "additionalProperties":false}}})";

bool is_integer(const json::value* v) { return v && v->k == json::kind::number && v->is_int; }

/// The arguments of a call of `name`, checked by hand against the schemas above: "" if valid.
std::string invalid_reason(const std::string& name, const json::value& a) {
  if (a.k != json::kind::object) return "arguments not an object";
  if (name == "get_weather") {
    if (a.obj.size() != 3) return "get_weather: not exactly city, unit, days";
    const auto* city = a.find("city");
    if (!city || city->k != json::kind::string) return "city";
    size_t chars = 0;
    for (char c : city->s) chars += (uint8_t(c) & 0xC0) != 0x80;
    if (chars > 12) return "city length";
    const auto* unit = a.find("unit");
    if (!unit || unit->k != json::kind::string || (unit->s != "celsius" && unit->s != "fahrenheit")) return "unit";
    if (!is_integer(a.find("days"))) return "days";
    return "";
  }
  if (name == "add") {
    if (a.obj.size() != 2 || !is_integer(a.find("a")) || !is_integer(a.find("b"))) return "add: a and b integers";
    return "";
  }
  return "unknown tool " + name;
}

struct call_reply {
  int status = 0;
  std::string finish_reason, name, raw;
  json::value arguments;
  std::string arguments_text;
  size_t calls = 0;
  bool content_null = false;
};

call_reply ask(uint16_t port, const std::string& body) {
  auto r = test::post(port, "/v1/chat/completions", body);
  call_reply c;
  c.status = r.status;
  c.raw = r.body;
  if (r.status != 200) return c;
  auto v = json::parse(r.body);
  const auto& ch = v.find("choices")->arr.at(0);
  c.finish_reason = ch.find("finish_reason")->s;
  const auto& msg = *ch.find("message");
  c.content_null = msg.find("content")->k == json::kind::null;
  if (const auto* tc = msg.find("tool_calls")) {
    c.calls = tc->arr.size();
    if (c.calls > 0) {
      c.name = tc->arr[0].find("function")->find("name")->s;
      c.arguments_text = tc->arr[0].find("function")->find("arguments")->s;
      c.arguments = json::parse(c.arguments_text);
    }
  }
  return c;
}

struct fixture {
  fixture() {
    const auto templates = std::filesystem::path(TANDEM_SHARED_MODELS).parent_path() / "chat-templates";
    make_model_options o;
    o.preset = "tiny-15m";  // micro's 512-token context is too short for the template's tool prompt
    o.dtype = ggml_type::f16;
    o.seed = 7;
    o.chat_template = read_file(templates / "Qwen-Qwen2.5-7B-Instruct.jinja");
    REQUIRE(!o.chat_template.empty());
    model = (dir.path / "tools.gguf").string();
    write_random_llama(o, model);
    srv = std::make_unique<server>(model, (dir.path / "serve.log").string());
  }
  temp_dir dir;
  std::string model;
  std::unique_ptr<server> srv;
};

}  // namespace

TEST_CASE("tool_choice e2e: 20 seeded named-function requests at temperature 1 each give one schema-valid call") {
  fixture f;
  for (int seed = 1; seed <= 20; ++seed) {
    const std::string body = fmt::format(
        R"({{"messages":[{{"role":"user","content":"What is the weather in Paris?"}}],"tools":[{},{}],
            "tool_choice":{{"type":"function","function":{{"name":"get_weather"}}}},"max_tokens":300,"temperature":1,"seed":{}}})",
        k_weather, k_add, seed);
    const call_reply c = ask(f.srv->http_port, body);
    REQUIRE_MESSAGE(c.status == 200, c.raw);
    INFO("seed ", seed, ": ", c.raw);
    CHECK(c.finish_reason == "tool_calls");
    CHECK(c.calls == 1);
    CHECK(c.content_null);
    CHECK(c.name == "get_weather");
    CHECK(invalid_reason(c.name, c.arguments) == "");
  }
}

TEST_CASE("tool_choice e2e: required with two tools gives a valid call of one of them, streamed too") {
  fixture f;
  std::set<std::string> names;
  for (int seed = 1; seed <= 8; ++seed) {
    const std::string body = fmt::format(
        R"({{"messages":[{{"role":"user","content":"Add 2 and 3, or tell me the weather."}}],"tools":[{},{}],
            "tool_choice":"required","max_tokens":300,"temperature":1,"seed":{}}})",
        k_weather, k_add, seed);
    const call_reply c = ask(f.srv->http_port, body);
    REQUIRE_MESSAGE(c.status == 200, c.raw);
    INFO("seed ", seed, ": ", c.raw);
    CHECK(c.finish_reason == "tool_calls");
    CHECK(c.calls == 1);
    CHECK(invalid_reason(c.name, c.arguments) == "");
    names.insert(c.name);
  }
  MESSAGE("tools called: ", names.size());
  // Streaming gives the same call as one delta.tool_calls entry.
  const std::string body = fmt::format(
      R"({{"messages":[{{"role":"user","content":"Add 2 and 3."}}],"tools":[{},{}],"tool_choice":"required",
          "max_tokens":300,"temperature":1,"seed":3}})",
      k_weather, k_add);
  const call_reply plain = ask(f.srv->http_port, body);
  REQUIRE(plain.status == 200);
  auto r = test::post(f.srv->http_port, "/v1/chat/completions", body.substr(0, body.size() - 1) + R"(,"stream":true})");
  REQUIRE(r.status == 200);
  bool ok = false;
  std::string name, args, finish, content;
  for (auto& e : test::sse_events(r.body, ok)) {
    auto ch = json::parse(e);
    const auto& c0 = ch.find("choices")->arr.at(0);
    const auto& d = *c0.find("delta");
    if (const auto* t = d.find("content"); t && t->k == json::kind::string) content += t->s;
    if (const auto* tc = d.find("tool_calls"))
      for (const auto& x : tc->arr) {
        name += x.find("function")->find("name")->s;
        args += x.find("function")->find("arguments")->s;
      }
    if (const auto* fr = c0.find("finish_reason"); fr && fr->k == json::kind::string) finish = fr->s;
  }
  CHECK(ok);
  CHECK(finish == "tool_calls");
  CHECK(content == "");
  CHECK(name == plain.name);
  CHECK(args == plain.arguments_text);  // same seed, same call
  CHECK(invalid_reason(name, json::parse(args)) == "");
}
