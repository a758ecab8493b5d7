// OpenAI HTTP front end against the fake serving_api: routes, SSE framing, usage, errors.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

using namespace tandem;
using namespace tandem::test;

namespace {

json::value body_json(const http_response& r) {
  INFO("body: " << r.body);
  return json::parse(r.body);
}

std::string str_at(const json::value& v, std::initializer_list<std::string_view> path) {
  const json::value* p = &v;
  for (auto k : path) {
    REQUIRE(p);
    p = p->find(k);
  }
  REQUIRE(p);
  return p->s;
}

const json::value& choice0(const json::value& v) {
  auto* c = v.find("choices");
  REQUIRE(c);
  REQUIRE(c->arr.size() == 1);
  return c->arr[0];
}

int64_t usage(const json::value& v, std::string_view k) {
  auto* u = v.find("usage");
  REQUIRE(u);
  auto* n = u->find(k);
  REQUIRE(n);
  return n->i;
}

}  // namespace

TEST_CASE("http: GET /health, /v1/models and /metrics") {
  server_fixture s;
  auto h = get(s.http_port, "/health");
  CHECK(h.status == 200);
  CHECK(str_at(body_json(h), {"status"}) == "ok");

  auto m = get(s.http_port, "/v1/models");
  CHECK(m.status == 200);
  auto mj = body_json(m);
  CHECK(str_at(mj, {"object"}) == "list");
  REQUIRE(mj.find("data")->arr.size() == 1);
  CHECK(mj.find("data")->arr[0].find("id")->s == "fake-model");

  auto met = get(s.http_port, "/metrics");
  CHECK(met.status == 200);
  CHECK(met.headers["content-type"].find("text/plain") == 0);
  CHECK(met.body.find("tandem_fake_metric 7") != std::string::npos);
  // The earlier requests are counted by route and status.
  CHECK(met.body.find("tandem_http_requests_total{route=\"/health\",status=\"200\"} 1") != std::string::npos);
  CHECK(met.body.find("tandem_http_requests_total{route=\"/v1/models\",status=\"200\"} 1") != std::string::npos);
}

TEST_CASE("http: non-streaming completion with usage and finish reasons") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/completions", R"({"model":"fake-model","prompt":"abc","max_tokens":5,"temperature":0})");
  REQUIRE(r.status == 200);
  auto j = body_json(r);
  CHECK(str_at(j, {"object"}) == "text_completion");
  CHECK(str_at(j, {"model"}) == "fake-model");
  CHECK(str_at(j, {"id"}).rfind("cmpl-", 0) == 0);
  CHECK(choice0(j).find("text")->s == "Hello");
  CHECK(choice0(j).find("finish_reason")->s == "length");
  CHECK(usage(j, "prompt_tokens") == 4);  // BOS + 3 bytes
  CHECK(usage(j, "completion_tokens") == 5);
  CHECK(usage(j, "total_tokens") == 9);

  // The engine request got the parameters, EOS as stop token and a deadline.
  auto sub = s.api.submitted();
  REQUIRE(sub.size() == 1);
  CHECK(sub[0].prompt == std::vector<int32_t>{1, 'a' + 3, 'b' + 3, 'c' + 3});
  CHECK(sub[0].max_tokens == 5);
  CHECK(sub[0].sampling.temperature == 0.0f);
  CHECK(sub[0].stop_tokens == std::vector<int32_t>{2});
  CHECK(sub[0].deadline < std::chrono::steady_clock::time_point::max());

  // Runs to EOS: finish_reason stop, EOS is counted but not shown.
  auto r2 = post(s.http_port, "/v1/completions", R"({"prompt":[5,6,7],"max_tokens":50})");
  REQUIRE(r2.status == 200);
  auto j2 = body_json(r2);
  CHECK(choice0(j2).find("text")->s == "Hello world");
  CHECK(choice0(j2).find("finish_reason")->s == "stop");
  CHECK(usage(j2, "prompt_tokens") == 3);
  CHECK(usage(j2, "completion_tokens") == 12);
  CHECK(str_at(j, {"id"}) != str_at(j2, {"id"}));
}

TEST_CASE("http: streaming completion SSE framing and include_usage") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/completions",
                R"({"prompt":"x","max_tokens":50,"stream":true,"stream_options":{"include_usage":true}})");
  REQUIRE(r.status == 200);
  CHECK(r.headers["content-type"] == "text/event-stream");
  bool ok = false;
  auto evs = sse_events(r.body, ok);
  INFO("body: " << r.body);
  CHECK(ok);
  REQUIRE(evs.size() >= 3);
  std::string text;
  std::string finish;
  for (size_t i = 0; i + 1 < evs.size(); ++i) {
    auto j = json::parse(evs[i]);
    CHECK(j.find("object")->s == "text_completion");
    CHECK(j.find("usage")->k == json::kind::null);
    text += choice0(j).find("text")->s;
    auto* f = choice0(j).find("finish_reason");
    if (f->k == json::kind::string) {
      CHECK(i + 2 == evs.size());  // only the last choice chunk has a finish reason
      finish = f->s;
    }
  }
  CHECK(text == "Hello world");
  CHECK(finish == "stop");
  auto last = json::parse(evs.back());
  CHECK(last.find("choices")->arr.empty());
  CHECK(usage(last, "prompt_tokens") == 2);
  CHECK(usage(last, "completion_tokens") == 12);
  CHECK(usage(last, "total_tokens") == 14);
}

TEST_CASE("http: a token whose text is held back still gets its SSE chunk, with empty text") {
  // vLLM's rule: one chunk per token event, so a client's TTFT and inter-token gaps are the
  // engine's. "\xC3" alone is half of a UTF-8 sequence: its text waits for the next token.
  server_fixture s;
  fake_behavior b;
  b.output = "\xC3\xA9t\xC3\xA9";
  b.chunk = 1;
  s.api.set(b);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x","max_tokens":50,"stream":true})");
  REQUIRE(r.status == 200);
  bool ok = false;
  auto evs = sse_events(r.body, ok);
  INFO("body: " << r.body);
  CHECK(ok);
  std::vector<std::string> texts;
  for (auto& e : evs) texts.push_back(choice0(json::parse(e)).find("text")->s);
  REQUIRE(texts.size() >= 5);
  CHECK(texts[0].empty());
  CHECK(texts[1] == "\xC3\xA9");
  CHECK(texts[2] == "t");
  CHECK(texts[3].empty());
  CHECK(texts[4] == "\xC3\xA9");
  std::string all;
  for (auto& t : texts) all += t;
  CHECK(all == "\xC3\xA9t\xC3\xA9");
}

TEST_CASE("http: chat completions use the Llama-2 template, stream and non-stream") {
  server_fixture s;
  auto r = post(s.http_port, "/v1/chat/completions",
                R"({"model":"fake-model","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}],"max_tokens":5})");
  REQUIRE(r.status == 200);
  auto j = body_json(r);
  CHECK(str_at(j, {"object"}) == "chat.completion");
  CHECK(str_at(j, {"id"}).rfind("chatcmpl-", 0) == 0);
  CHECK(choice0(j).find("message")->find("role")->s == "assistant");
  CHECK(choice0(j).find("message")->find("content")->s == "Hello");
  fake_tokenizer tok;
  auto want = tok.encode("[INST] <<SYS>>\nbe brief\n<</SYS>>\n\nhi [/INST]", true);
  REQUIRE(s.api.submitted().size() == 1);
  CHECK(s.api.submitted()[0].prompt == want);
  CHECK(usage(j, "prompt_tokens") == static_cast<int64_t>(want.size()));

  // Multi-turn: each turn is its own BOS ... EOS segment.
  auto turns = std::vector<chat_message>{{"user", "a"}, {"assistant", "b"}, {"user", [] { return std::string("c"); }()}};
  auto ids = render_chat_llama2(tok, turns);
  auto first = tok.encode("[INST] a [/INST] b ", true);
  first.push_back(2);
  auto second = tok.encode("[INST] c [/INST]", true);
  first.insert(first.end(), second.begin(), second.end());
  CHECK(ids == first);
  CHECK_THROWS_AS(render_chat_llama2(tok, {{"robot", "x"}}), tandem::error);

  auto st = post(s.http_port, "/v1/chat/completions",
                 R"({"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true})");
  REQUIRE(st.status == 200);
  bool ok = false;
  auto evs = sse_events(st.body, ok);
  CHECK(ok);
  REQUIRE(evs.size() >= 2);
  std::string text;
  auto first_ev = json::parse(evs[0]);
  CHECK(first_ev.find("object")->s == "chat.completion.chunk");
  CHECK(choice0(first_ev).find("delta")->find("role")->s == "assistant");
  for (auto& e : evs) {
    auto ej = json::parse(e);
    if (auto* c = choice0(ej).find("delta")->find("content")) text += c->s;
  }
  CHECK(text == "Hello world");
  CHECK(choice0(json::parse(evs.back())).find("finish_reason")->s == "stop");
}

TEST_CASE("http: stop strings are matched in the text, trimmed, and abort the engine request") {
  server_fixture s;
  fake_behavior b;
  b.chunk = 1;  // the stop string spans several events
  s.api.set(b);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x","max_tokens":50,"stop":["zz","o w"]})");
  REQUIRE(r.status == 200);
  auto j = body_json(r);
  CHECK(choice0(j).find("text")->s == "Hell");
  CHECK(choice0(j).find("finish_reason")->s == "stop");
  CHECK(usage(j, "completion_tokens") == 7);  // "Hello w"
  CHECK(s.api.wait_aborted(str_at(j, {"id"})));

  auto st = post(s.http_port, "/v1/completions", R"({"prompt":"x","max_tokens":50,"stop":"wor","stream":true})");
  bool ok = false;
  auto evs = sse_events(st.body, ok);
  CHECK(ok);
  std::string text;
  for (auto& e : evs) text += choice0(json::parse(e)).find("text")->s;
  CHECK(text == "Hello ");
  // A partial match at the end of the stream is released, not swallowed.
  auto r3 = post(s.http_port, "/v1/completions", R"({"prompt":"x","max_tokens":50,"stop":"ldx"})");
  CHECK(choice0(body_json(r3)).find("text")->s == "Hello world");
}

TEST_CASE("http: bad requests get JSON errors with status and a message naming the problem") {
  limits lim;
  lim.max_body_bytes = 2048;
  lim.max_new_tokens = 100;
  server_fixture s(lim);
  struct bad {
    std::string path, body;
    int status;
    std::string needle;
  };
  std::string big(3000, ' ');
  std::vector<bad> table = {
      {"/v1/completions", "{\"prompt\": \"x\"", 400, "malformed JSON"},
      {"/v1/completions", "[1,2]", 400, "must be a JSON object"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":"5"})", 400, "'max_tokens' must be an integer, got string"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":2.5})", 400, "'max_tokens' must be an integer"},
      {"/v1/completions", R"({"prompt":"x","temperature":"hot"})", 400, "'temperature' must be a number"},
      {"/v1/completions", R"({"prompt":"x","stream":1})", 400, "'stream' must be a boolean"},
      {"/v1/completions", R"({"prompt":{"a":1}})", 400, "'prompt' must be a string or an array of token ids"},
      {"/v1/completions", R"({"max_tokens":3})", 400, "'prompt' is required"},
      {"/v1/completions", R"({"prompt":"x","stop":[1]})", 400, "'stop' must be a string or a list of strings"},
      {"/v1/completions", R"({"prompt":"x","a":1,"a":2})", 400, "duplicate key"},
      {"/v1/completions", "{\"prompt\":\"\xff\xfe\"}", 400, "not valid UTF-8"},
      {"/v1/completions", "{\"prompt\":\"\\ud800\"}", 400, "surrogate"},
      {"/v1/completions", "{\"prompt\":\"x\"" + big + "}", 413, "limit is 2048 bytes"},
      {"/v1/completions", R"({"prompt":"x","temperature":3.5})", 422, "temperature = 3.5 is out of range; use 0 (greedy) to 2"},
      {"/v1/completions", R"({"prompt":"x","temperature":-1})", 422, "temperature = -1"},
      {"/v1/completions", R"({"prompt":"x","top_p":0})", 422, "top_p = 0 is out of range"},
      {"/v1/completions", R"({"prompt":"x","top_p":1.5})", 422, "top_p = 1.5"},
      {"/v1/completions", R"({"prompt":"x","top_k":-5})", 422, "top_k = -5"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":0})", 422, "max_tokens = 0 is out of range; use 1 to 100"},
      {"/v1/completions", R"({"prompt":"x","max_tokens":101})", 422, "max_tokens = 101"},
      {"/v1/completions", R"({"prompt":")" + std::string(120, 'a') + R"(","max_tokens":20})", 422,
       "prompt (121 tokens) + max_tokens (20) = 141 exceeds the model context of 128"},
      {"/v1/completions", R"({"prompt":[1,999]})", 422, "prompt token id 999 is out of range"},
      {"/v1/completions", R"({"prompt":"x","n":9})", 422, "n = 9 is out of range; use 1 to 8 (limits.max_choices = 8"},
      {"/v1/chat/completions", R"({"messages":"hi"})", 400, "'messages' must be an array"},
      {"/v1/chat/completions", R"({"messages":[{"role":"robot","content":"x"}]})", 422, "role \"robot\" is not supported"},
      {"/v1/chat/completions", R"({"messages":[]})", 422, "messages is empty"},
  };
  for (auto& t : table) {
    INFO(t.body.substr(0, 120));
    auto r = post(s.http_port, t.path, t.body);
    CHECK(r.status == t.status);
    CHECK(r.headers["content-type"] == "application/json");
    auto j = body_json(r);
    auto* e = j.find("error");
    REQUIRE(e);
    CHECK(e->find("message")->s.find(t.needle) != std::string::npos);
    CHECK(e->find("type")->k == json::kind::string);
    CHECK(e->find("param") != nullptr);
    CHECK(e->find("code") != nullptr);
  }
  // 422s name the parameter.
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x","temperature":9})");
  CHECK(body_json(r).find("error")->find("param")->s == "temperature");
  // Nothing bad reached the engine.
  CHECK(s.api.submitted().empty());

  // A body over the limit without Content-Length (chunked) is cut off at the limit.
  std::string chunked = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
  std::string payload = "{\"prompt\":\"" + std::string(4000, 'a') + "\"}";
  char hex[16];
  std::snprintf(hex, sizeof hex, "%zx", payload.size());
  chunked += std::string(hex) + "\r\n" + payload + "\r\n0\r\n\r\n";
  CHECK(http_exchange(s.http_port, chunked).status == 413);

  // Routes and methods.
  auto nf = get(s.http_port, "/v2/nothing");
  CHECK(nf.status == 404);
  CHECK(body_json(nf).find("error")->find("message")->s.find("no route for /v2/nothing") != std::string::npos);
  auto wm = get(s.http_port, "/v1/completions");
  CHECK(wm.status == 405);
  CHECK(wm.headers["allow"] == "POST");
  CHECK(http_exchange(s.http_port, request_text("POST", "/health", "{}")).status == 405);

  auto met = get(s.http_port, "/metrics");
  CHECK(met.body.find("tandem_http_requests_total{route=\"/v1/completions\",status=\"422\"}") != std::string::npos);
  CHECK(met.body.find("tandem_http_requests_total{route=\"other\",status=\"404\"} 1") != std::string::npos);
}

TEST_CASE("http: engine errors map by kind, streams that started get an in-band error") {
  server_fixture s;
  struct row {
    error_kind kind;
    int status;
  };
  for (auto [kind, status] : {row{error_kind::overloaded, 503}, row{error_kind::failed, 500},
                              row{error_kind::disconnected, 502}, row{error_kind::unimplemented, 501}}) {
    fake_behavior b;
    b.fail = error(kind, "engine says no");
    s.api.set(b);
    auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x"})");
    CHECK(r.status == status);
    CHECK(body_json(r).find("error")->find("message")->s == "engine says no");
    CHECK(body_json(r).find("error")->find("code")->s == std::string(to_string(kind)));
    if (kind == error_kind::overloaded) CHECK(r.headers["retry-after"] == "1");
    // Streaming, failing before any token: still a proper status.
    auto st = post(s.http_port, "/v1/completions", R"({"prompt":"x","stream":true})");
    CHECK(st.status == status);
  }
  fake_behavior b;
  b.fail = error(error_kind::failed, "worker crashed");
  b.fail_after = 4;
  s.api.set(b);
  auto st = post(s.http_port, "/v1/completions", R"({"prompt":"x","stream":true,"max_tokens":50})");
  CHECK(st.status == 200);
  bool ok = false;
  auto evs = sse_events(st.body, ok);
  CHECK(ok);  // still ends with [DONE]
  REQUIRE(evs.size() == 2);
  CHECK(choice0(json::parse(evs[0])).find("text")->s == "Hell");
  CHECK(json::parse(evs[1]).find("error")->find("message")->s == "worker crashed");
}

TEST_CASE("http: a client that disconnects mid-request gets its request aborted") {
  server_fixture s;
  fake_behavior b;
  b.hold = true;
  s.api.set(b);
  for (bool stream : {true, false}) {
    INFO("stream " << stream);
    int fd = connect_to(s.http_port);
    REQUIRE(fd >= 0);
    std::string body = stream ? R"({"prompt":"x","stream":true,"max_tokens":50})" : R"({"prompt":"x","max_tokens":50})";
    send_all(fd, request_text("POST", "/v1/completions", body));
    if (stream) {
      // Wait for the first event so the response has started.
      std::string got;
      char buf[4096];
      while (got.find("data: ") == std::string::npos) {
        ssize_t n = test::recv_some(fd, buf, sizeof buf);
        REQUIRE(n > 0);
        got.append(buf, static_cast<size_t>(n));
      }
    } else {
      // The request must be in the engine before we leave.
      REQUIRE(s.api.wait_submitted(2));
    }
    ::close(fd);
    auto sub = s.api.submitted();
    REQUIRE(!sub.empty());
    CHECK(s.api.wait_aborted(sub.back().request_id));
  }
  auto met = get(s.http_port, "/metrics");
  CHECK(met.body.find("tandem_http_client_disconnects_total 2") != std::string::npos);
}

TEST_CASE("http: requests past limits.request_timeout_ms end with 503") {
  limits lim;
  lim.request_timeout_ms = 100;
  server_fixture s(lim);
  fake_behavior b;
  b.hold = true;  // the fake ignores deadlines: the front end must enforce them
  s.api.set(b);
  auto t0 = std::chrono::steady_clock::now();
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"x","max_tokens":5})");
  CHECK(r.status == 503);
  CHECK(body_json(r).find("error")->find("message")->s.find("deadline of 100 ms") != std::string::npos);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK(s.api.wait_aborted(s.api.submitted().back().request_id));
}
