// POST /tokenize and /detokenize (llama-server's routes): over HTTP against the fake serving_api,
// and their bodies against a real vocabulary with special tokens (shared/vocab gpt-2).
#include <doctest/doctest.h>

#include <filesystem>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"
#include "transport/http/tokenize_routes.h"

using namespace tandem;
using namespace tandem::test;

namespace {

json::value parsed(const std::string& body) {
  INFO("body: " << body);
  return json::parse(body);
}

std::vector<int64_t> ints(const json::value& arr) {
  std::vector<int64_t> r;
  for (const auto& e : arr.arr) r.push_back(e.i);
  return r;
}

}  // namespace

TEST_CASE("http tokenize: /tokenize and /detokenize round trip with the server's tokenizer") {
  server_fixture s;
  auto r = post(s.http_port, "/tokenize", R"({"content":"Hi!"})");
  REQUIRE(r.status == 200);
  CHECK(r.headers["content-type"] == "application/json");
  const auto ids = fake_tokenizer::ids("Hi!");
  CHECK(ints(*parsed(r.body).find("tokens")) == std::vector<int64_t>(ids.begin(), ids.end()));
  // add_special puts BOS (1) first
  r = post(s.http_port, "/tokenize", R"({"content":"Hi","add_special":true})");
  CHECK(ints(*parsed(r.body).find("tokens")) == std::vector<int64_t>{1, 'H' + 3, 'i' + 3});
  // with_pieces: {id, piece} objects
  r = post(s.http_port, "/tokenize", R"({"content":"ok","with_pieces":true})");
  REQUIRE(r.status == 200);
  const auto j = parsed(r.body);
  REQUIRE(j.find("tokens")->arr.size() == 2);
  CHECK(j.find("tokens")->arr[0].find("id")->i == 'o' + 3);
  CHECK(j.find("tokens")->arr[0].find("piece")->s == "o");
  CHECK(j.find("tokens")->arr[1].find("piece")->s == "k");

  r = post(s.http_port, "/detokenize", R"({"tokens":[75,108,36]})");  // 'H' 'i' '!' + 3
  REQUIRE(r.status == 200);
  CHECK(parsed(r.body).find("content")->s == "Hi!");
  r = post(s.http_port, "/detokenize", R"({"tokens":[]})");
  CHECK(parsed(r.body).find("content")->s.empty());
  // nothing reached the engine
  CHECK(s.api.submitted().empty());
  auto met = get(s.http_port, "/metrics");
  CHECK(met.body.find("tandem_http_requests_total{route=\"/tokenize\",status=\"200\"} 3") != std::string::npos);
  CHECK(met.body.find("tandem_http_requests_total{route=\"/detokenize\",status=\"200\"} 2") != std::string::npos);
}

TEST_CASE("http tokenize: bad bodies are 400s naming the field, wrong methods 405") {
  server_fixture s;
  struct bad {
    std::string path, body, param, needle;
  };
  const std::vector<bad> table = {
      {"/tokenize", R"({})", "content", "'content' is required"},
      {"/tokenize", R"({"content":null})", "content", "'content' is required"},
      {"/tokenize", R"({"content":[1,2]})", "content", "'content' must be a string, got array"},
      {"/tokenize", R"({"content":"x","with_pieces":"yes"})", "with_pieces", "'with_pieces' must be a boolean"},
      {"/tokenize", R"({"content":"x","add_special":1})", "add_special", "'add_special' must be a boolean"},
      {"/tokenize", R"(["x"])", "", "must be a JSON object"},
      {"/tokenize", R"({"content":"x")", "", "not valid JSON"},
      {"/detokenize", R"({})", "tokens", "'tokens' is required"},
      {"/detokenize", R"({"tokens":"1 2"})", "tokens", "'tokens' must be an array of token ids, got string"},
      {"/detokenize", R"({"tokens":[1,"2"]})", "tokens", "must hold integer token ids, got string"},
      {"/detokenize", R"({"tokens":[1.5]})", "tokens", "must hold integer token ids"},
      {"/detokenize", R"({"tokens":[3,259]})", "tokens", "token id 259 is out of range; ids are 0 to 258"},
      {"/detokenize", R"({"tokens":[-1]})", "tokens", "token id -1 is out of range"},
  };
  for (const auto& t : table) {
    INFO(t.path << " " << t.body);
    auto r = post(s.http_port, t.path, t.body);
    CHECK(r.status == 400);
    CHECK(r.headers["content-type"] == "application/json");
    const auto j = parsed(r.body);
    const auto* e = j.find("error");
    REQUIRE(e);
    CHECK(e->find("message")->s.find(t.needle) != std::string::npos);
    CHECK(e->find("type")->s == "invalid_request_error");
    if (t.param.empty()) CHECK(e->find("param")->k == json::kind::null);
    else CHECK(e->find("param")->s == t.param);
  }
  auto g = get(s.http_port, "/tokenize");
  CHECK(g.status == 405);
  CHECK(g.headers["allow"] == "POST");
  auto nf = get(s.http_port, "/nothing");
  CHECK(nf.body.find("/tokenize, /detokenize") != std::string::npos);
}

TEST_CASE("http tokenize: a real vocabulary's special tokens, pieces and partial characters") {
  const auto path = std::filesystem::path(TANDEM_SHARED_MODELS).parent_path() / "vocab" / "ggml-vocab-gpt-2.gguf";
  const auto f = gguf::file::open(path.string());
  const auto tok = tokenizer::from_gguf(f);
  // parse_special defaults to true, as in llama-server
  auto j = parsed(transport::tokenize_response(*tok, R"({"content":"Hi<|endoftext|>"})"));
  const auto want = tok->encode("Hi<|endoftext|>", false, true);
  CHECK(ints(*j.find("tokens")) == std::vector<int64_t>(want.begin(), want.end()));
  CHECK(j.find("tokens")->arr.back().i == 50256);
  j = parsed(transport::tokenize_response(*tok, R"({"content":"Hi<|endoftext|>","parse_special":false})"));
  CHECK(j.find("tokens")->arr.back().i != 50256);
  // pieces: the control token's text; an emoji split over byte tokens gives byte arrays
  j = parsed(transport::tokenize_response(*tok, "{\"content\":\"<|endoftext|> \xF0\x9F\xA6\x99\",\"with_pieces\":true}"));
  const auto& toks = j.find("tokens")->arr;
  REQUIRE(toks.size() >= 2);
  CHECK(toks[0].find("piece")->s == "<|endoftext|>");
  int64_t partial = -1;  // a token holding part of the emoji
  for (const auto& t : toks)
    if (t.find("piece")->k == json::kind::array && partial < 0) partial = t.find("id")->i;
  REQUIRE(partial >= 0);
  // detokenize joins the pieces back, control tokens included
  std::string ids;
  for (const auto& t : toks) ids += (ids.empty() ? "" : ",") + std::to_string(t.find("id")->i);
  j = parsed(transport::detokenize_response(*tok, "{\"tokens\":[" + ids + "]}"));
  CHECK(j.find("content")->s == "<|endoftext|> \xF0\x9F\xA6\x99");
  // half a character becomes U+FFFD instead of invalid JSON
  j = parsed(transport::detokenize_response(*tok, "{\"tokens\":[" + std::to_string(partial) + "]}"));
  CHECK(j.find("content")->s.find("\xEF\xBF\xBD") != std::string::npos);
}
