// Hostile and malformed HTTP requests: each gets a 4xx JSON error and starts no engine work.
#include <doctest/doctest.h>

#include <poll.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;

namespace {

limits small_limits() {
  limits l;
  l.max_body_bytes = 4096;
  l.max_new_tokens = 64;
  // Short so the slow-client cases finish quickly; the tests wait for the server's close, not a clock.
  l.http_header_timeout_ms = 300;
  l.http_body_timeout_ms = 300;
  return l;
}

struct bad_case {
  const char* what;
  std::string raw;    ///< the whole request
  int status;
  std::string code;   ///< error.code
  std::string param;  ///< error.param ("" = null)
};

std::string post_raw(const std::string& path, const std::string& body, const std::string& type = "application/json") {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}
std::string completion(const std::string& body) { return post_raw("/v1/completions", body); }
std::string chat(const std::string& body) { return post_raw("/v1/chat/completions", body); }

std::vector<bad_case> cases() {
  const std::string long_prompt(400, 'a');  // 401 tokens with BOS; the fake model's context is 128
  return {
      {"over-long prompt", completion(R"({"prompt":")" + long_prompt + R"(","max_tokens":4})"), 422, "invalid_value", "max_tokens"},
      {"over-long token prompt", completion(R"({"prompt":[)" + [] {
         std::string s;
         for (int i = 0; i < 200; ++i) s += (i ? "," : "") + std::to_string(65);
         return s;
       }() + R"(],"max_tokens":1})"), 422, "invalid_value", "max_tokens"},
      {"max_tokens 0", completion(R"({"prompt":"a","max_tokens":0})"), 422, "invalid_value", "max_tokens"},
      {"max_tokens negative", completion(R"({"prompt":"a","max_tokens":-5})"), 422, "invalid_value", "max_tokens"},
      {"max_tokens huge", completion(R"({"prompt":"a","max_tokens":1000000000000})"), 422, "invalid_value", "max_tokens"},
      {"max_tokens over the limit", completion(R"({"prompt":"a","max_tokens":65})"), 422, "invalid_value", "max_tokens"},
      {"max_tokens fractional", completion(R"({"prompt":"a","max_tokens":1.5})"), 400, "invalid_type", "max_tokens"},
      {"max_tokens string", completion(R"({"prompt":"a","max_tokens":"8"})"), 400, "invalid_type", "max_tokens"},
      {"temperature negative", completion(R"({"prompt":"a","temperature":-0.1})"), 422, "invalid_value", "temperature"},
      {"temperature huge", completion(R"({"prompt":"a","temperature":1e300})"), 422, "invalid_value", "temperature"},
      {"temperature string", completion(R"({"prompt":"a","temperature":"hot"})"), 400, "invalid_type", "temperature"},
      {"top_p 0", completion(R"({"prompt":"a","top_p":0})"), 422, "invalid_value", "top_p"},
      {"top_p above 1", completion(R"({"prompt":"a","top_p":1.5})"), 422, "invalid_value", "top_p"},
      {"top_k negative", completion(R"({"prompt":"a","top_k":-7})"), 422, "invalid_value", "top_k"},
      {"token id out of range", completion(R"({"prompt":[1,2,99999]})"), 422, "invalid_value", "prompt"},
      {"too many stop strings", completion(R"({"prompt":"a","stop":["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"]})"), 422, "invalid_value", "stop"},
      {"empty prompt", completion(R"({"prompt":[]})"), 422, "invalid_value", "prompt"},
      {"missing prompt", completion(R"({"max_tokens":3})"), 400, "missing_field", "prompt"},
      {"n 99", completion(R"({"prompt":"a","n":99})"), 422, "invalid_value", "n"},
      {"n 0", completion(R"({"prompt":"a","n":0})"), 422, "invalid_value", "n"},
      {"unknown parameter", completion(R"({"prompt":"a","temprature":0.5})"), 422, "unknown_parameter", "temprature"},
      {"messages on completions", completion(R"({"prompt":"a","messages":[]})"), 422, "unknown_parameter", "messages"},
      {"prompt on chat", chat(R"({"messages":[{"role":"user","content":"hi"}],"prompt":"a"})"), 422, "unknown_parameter", "prompt"},
      {"echo with logprobs", completion(R"({"prompt":"a","echo":true,"logprobs":1})"), 422, "invalid_value", "echo"},
      {"suffix", completion(R"({"prompt":"a","suffix":"b"})"), 422, "unsupported_parameter", "suffix"},
      {"best_of", completion(R"({"prompt":"a","best_of":3})"), 422, "unsupported_parameter", "best_of"},
      {"presence_penalty over 2", completion(R"({"prompt":"a","presence_penalty":2.5})"), 422, "invalid_value", "presence_penalty"},
      {"frequency_penalty string", chat(R"({"messages":[{"role":"user","content":"hi"}],"frequency_penalty":"1"})"), 400, "invalid_type", "frequency_penalty"},
      {"repetition_penalty 0", completion(R"({"prompt":"a","repetition_penalty":0})"), 422, "invalid_value", "repetition_penalty"},
      {"min_p above 1", completion(R"({"prompt":"a","min_p":1.5})"), 422, "invalid_value", "min_p"},
      {"logit_bias id out of the vocabulary", chat(R"({"messages":[{"role":"user","content":"hi"}],"logit_bias":{"99999":-100}})"), 422, "invalid_value", "logit_bias"},
      {"logit_bias key not an id", completion(R"({"prompt":"a","logit_bias":{"abc":1}})"), 422, "invalid_value", "logit_bias"},
      {"logit_bias value over 100", completion(R"({"prompt":"a","logit_bias":{"5":101}})"), 422, "invalid_value", "logit_bias"},
      {"logit_bias not an object", completion(R"({"prompt":"a","logit_bias":[5]})"), 400, "invalid_type", "logit_bias"},
      {"top_logprobs without logprobs", chat(R"({"messages":[{"role":"user","content":"hi"}],"top_logprobs":2})"), 422, "invalid_value", "top_logprobs"},
      {"top_logprobs over 20", chat(R"({"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":21})"), 422, "invalid_value", "top_logprobs"},
      {"response_format type", chat(R"({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"xml"}})"), 422, "invalid_value", "response_format.type"},
      {"response_format schema keyword", chat(R"({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"integer","minimum":1}}}})"), 422, "invalid_value", "response_format.json_schema.schema"},
      {"tools on completions", completion(R"({"prompt":"a","tools":[{"type":"function","function":{"name":"f"}}]})"), 422, "unsupported_parameter", "tools"},
      {"tool_choice required without tools", chat(R"({"messages":[{"role":"user","content":"hi"}],"tool_choice":"required"})"), 422, "invalid_value", "tool_choice"},
      {"tool_choice required on completions", completion(R"({"prompt":"a","tool_choice":"required"})"), 422, "unsupported_parameter", "tool_choice"},
      {"model not served", completion(R"({"prompt":"a","model":"gpt-4o"})"), 404, "model_not_found", "model"},
      {"model not served (chat)", chat(R"({"messages":[{"role":"user","content":"hi"}],"model":"gpt-4o"})"), 404, "model_not_found", "model"},
      {"GET a model not served", "GET /v1/models/gpt-4o HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "model_not_found", "model"},
      {"max_tokens and max_completion_tokens disagree", completion(R"({"prompt":"a","max_tokens":2,"max_completion_tokens":3})"), 422, "invalid_value", "max_completion_tokens"},
      {"malformed JSON", completion(R"({"prompt":"a",)"), 400, "invalid_json", ""},
      {"trailing garbage", completion(R"({"prompt":"a"} x)"), 400, "invalid_json", ""},
      {"duplicate key", completion(R"({"prompt":"a","prompt":"b"})"), 400, "invalid_json", ""},
      {"deep nesting", completion(std::string(100, '[') + std::string(100, ']')), 400, "invalid_json", ""},
      {"not an object", completion("[1,2,3]"), 400, "invalid_type", ""},
      {"empty body", completion(""), 400, "invalid_json", ""},
      {"invalid UTF-8", completion("{\"prompt\":\"a\xff\xfe\"}"), 400, "invalid_json", ""},
      {"overlong UTF-8", completion("{\"prompt\":\"\xc0\xaf\"}"), 400, "invalid_json", ""},
      {"lone surrogate escape", completion(R"({"prompt":"\ud800"})"), 400, "invalid_json", ""},
      {"chat without messages", chat(R"({"model":"fake-model"})"), 400, "missing_field", "messages"},
      {"chat bad role", chat(R"({"messages":[{"role":"wizard","content":"hi"}]})"), 422, "invalid_value", "messages"},
      {"chat content number", chat(R"({"messages":[{"role":"user","content":5}]})"), 400, "invalid_type", "messages[].content"},
      {"body over the limit (Content-Length)", completion(R"({"prompt":")" + std::string(5000, 'a') + R"("})"), 413, "body_too_large", ""},
      {"body over the limit (chunked)",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
       "Transfer-Encoding: chunked\r\n\r\n1388\r\n" + std::string(5000, ' ') + "\r\n0\r\n\r\n",
       413, "body_too_large", ""},
      {"declared length over the limit", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n",
       413, "body_too_large", ""},
      {"wrong content type", post_raw("/v1/completions", R"({"prompt":"a"})", "text/plain"), 415, "unsupported_media_type", ""},
      {"form content type", post_raw("/v1/completions", "prompt=a", "application/x-www-form-urlencoded"), 415, "unsupported_media_type", ""},
      {"unknown route", "GET /v1/engines HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "not_found", ""},
      {"path traversal", "GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "not_found", ""},
      {"GET on a POST route", "GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405, "method_not_allowed", ""},
      {"DELETE", "DELETE /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405, "method_not_allowed", ""},
      {"not HTTP", "HELLO THERE\r\n\r\n", 400, "bad_http", ""},
      {"bad header line", "GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400, "bad_http", ""},
  };
}

void check_error_json(const http_response& r, const bad_case& c) {
  INFO("body: " << r.body);
  CHECK(r.headers.at("content-type") == "application/json");
  json::value j;
  REQUIRE_NOTHROW(j = json::parse(r.body));
  auto* e = j.find("error");
  REQUIRE(e);
  REQUIRE(e->find("message"));
  CHECK(e->find("message")->k == json::kind::string);
  CHECK(!e->find("message")->s.empty());
  CHECK(e->find("type")->s == "invalid_request_error");
  CHECK(e->find("code")->s == c.code);
  if (c.param.empty()) CHECK(e->find("param")->k == json::kind::null);
  else CHECK(e->find("param")->s == c.param);
}

/// Reads until the server closes or `fd`'s receive timeout (10 s, a broken server) passes.
std::string read_until_close(int fd, bool& closed) {
  std::string raw;
  char buf[4096];
  closed = false;
  for (;;) {
    ssize_t n = test::recv_some(fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) {
      closed = true;
      break;
    }
    if (n < 0) break;  // the receive timeout: the server kept the connection
    raw.append(buf, static_cast<size_t>(n));
  }
  return raw;
}

}  // namespace

TEST_CASE("bad requests: each gets its 4xx JSON error and starts no engine work") {
  server_fixture s(small_limits());
  for (const auto& c : cases()) {
    CAPTURE(c.what);
    auto r = http_exchange(s.http_port, c.raw);
    CHECK(r.status == c.status);
    if (r.status != 0) check_error_json(r, c);
  }
  CHECK(s.api.submitted().empty());
  // The server still serves well-formed requests after all of that.
  auto ok = post(s.http_port, "/v1/completions", R"({"prompt":"abc","max_tokens":2})");
  CHECK(ok.status == 200);
  CHECK(s.api.submitted().size() == 1);
}

TEST_CASE("bad requests: a head dribbled slower than limits.http_header_timeout_ms is closed (slowloris)") {
  server_fixture s(small_limits());
  int fd = connect_to(s.http_port);
  REQUIRE(fd >= 0);
  // Part of a request head, then nothing: the server must give up on its own.
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty");
  bool closed = false;
  std::string raw = read_until_close(fd, closed);
  ::close(fd);
  CHECK(closed);  // not our 10 s receive timeout
  // kj answers a timed-out head with 408 (or closes silently); never a 2xx, never engine work.
  if (!raw.empty()) CHECK(parse_response(raw).status == 408);
  CHECK(s.api.submitted().empty());
}

TEST_CASE("bad requests: a body dribbled slower than limits.http_body_timeout_ms gets 408") {
  server_fixture s(small_limits());
  int fd = connect_to(s.http_port);
  REQUIRE(fd >= 0);
  send_all(fd, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prom");
  bool closed = false;
  std::string raw;
  char buf[4096];
  while (!response_complete(raw)) {
    ssize_t n = test::recv_some(fd, buf, sizeof buf);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  auto r = parse_response(raw);
  CHECK(r.status == 408);
  check_error_json(r, {"", "", 408, "body_timeout", ""});
  // The connection is not kept for the rest of that body.
  read_until_close(fd, closed);
  ::close(fd);
  CHECK(closed);
  CHECK(s.api.submitted().empty());
}
