// End to end: `tandem serve` renders /v1/chat/completions with the chat template in the GGUF
// file (`tokenizer.chat_template`, written by make-model's option), or with
// --chat-template-file; the prompt is the template's text tokenized with special tokens parsed
// and a single BOS, checked through the server's own POST /tokenize.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/model/make_model.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/chat/chat_template.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

const std::filesystem::path k_templates = std::filesystem::path(TANDEM_SHARED_MODELS).parent_path() / "chat-templates";

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string write_model(const std::filesystem::path& dir, const std::string& chat_template) {
  const std::string path = (dir / "chat.gguf").string();
  make_model_options o;
  o.preset = "micro";
  o.dtype = ggml_type::f16;
  o.seed = 7;
  o.chat_template = chat_template;
  write_random_llama(o, path);
  return path;
}

/// The ids the server's tokenizer gives `text` with BOS and special tokens, one BOS kept.
std::vector<int64_t> server_tokens(uint16_t port, const std::string& text) {
  json::writer w;
  w.begin_object().key("content").str(text).key("add_special").boolean(true).key("parse_special").boolean(true).end_object();
  auto r = test::post(port, "/tokenize", w.take());
  REQUIRE_MESSAGE(r.status == 200, r.body);
  std::vector<int64_t> ids;
  const json::value v = json::parse(r.body);
  for (auto& t : v.find("tokens")->arr) ids.push_back(t.i);
  if (ids.size() >= 2 && ids[0] == 1 && ids[1] == 1) ids.erase(ids.begin());  // make-model's BOS is 1
  return ids;
}

int64_t chat_prompt_tokens(uint16_t port, const std::string& messages_json, std::string* body = nullptr) {
  auto r = test::post(port, "/v1/chat/completions", R"({"max_tokens":1,"temperature":0,"messages":)" + messages_json + "}");
  if (body) *body = r.body;
  if (r.status != 200) return -r.status;
  return json::parse(r.body).find("usage")->find("prompt_tokens")->i;
}

}  // namespace

TEST_CASE("chat template serve: the GGUF's tokenizer.chat_template renders chat, with one BOS and its refusals as 422") {
  temp_dir dir;
  const std::string gemma = read_file(k_templates / "google-gemma-2-2b-it.jinja");
  REQUIRE(!gemma.empty());
  const auto model = write_model(dir.path, gemma);
  const auto log = (dir.path / "serve.log").string();
  server srv(model, log);

  chat_template tmpl(gemma, "<s>", "</s>");
  const std::vector<chat_message> msgs{{"user", "Hello there"}, {"assistant", "Hi!"}, {"user", "How are you?"}};
  const std::string text = tmpl.render(msgs, nullptr, true);
  CHECK(text.rfind("<s><start_of_turn>user\nHello there<end_of_turn>\n", 0) == 0);
  const auto want = server_tokens(srv.http_port, text);
  CHECK(want.at(0) == 1);
  CHECK(want.at(1) != 1);  // the template's "<s>" and the vocabulary's BOS give one BOS
  CHECK(chat_prompt_tokens(srv.http_port, R"([{"role":"user","content":"Hello there"},{"role":"assistant","content":"Hi!"},
      {"role":"user","content":"How are you?"}])") == static_cast<int64_t>(want.size()));

  std::string body;
  CHECK(chat_prompt_tokens(srv.http_port, R"([{"role":"system","content":"x"},{"role":"user","content":"y"}])", &body) == -422);
  CHECK(body.find("System role not supported") != std::string::npos);
}

TEST_CASE("chat template serve: --chat-template-file overrides the model's template, and a bad one stops serve naming its line") {
  temp_dir dir;
  const auto model = write_model(dir.path, "");  // no template: the Llama-2 fallback unless overridden
  const auto qwen_path = k_templates / "Qwen-Qwen2.5-7B-Instruct.jinja";
  const auto log = (dir.path / "serve.log").string();
  server srv(model, log, {"--chat-template-file", qwen_path.string()});
  chat_template tmpl(read_file(qwen_path), "<s>", "</s>");
  chat_message call("assistant", "");
  call.content_null = true;
  call.tool_calls.push_back({"call1", "get_weather", R"({"city": "Paris"})"});
  chat_message result("tool", "21 C");
  result.tool_call_id = "call1";
  const std::vector<chat_message> msgs{{"user", "Weather in Paris?"}, call, result};
  const auto text = tmpl.render(msgs, nullptr, true);
  CHECK(text.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>") !=
        std::string::npos);
  CHECK(chat_prompt_tokens(srv.http_port, R"([{"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"call1","type":"function",
        "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"call1","content":"21 C"}])") ==
        static_cast<int64_t>(server_tokens(srv.http_port, text).size()));

  const auto bad = dir.path / "bad.jinja";
  std::ofstream(bad) << "line one\n{% for m in messages %}{{ m.content }\n";
  const auto bad_log = (dir.path / "bad.log").string();
  CHECK_THROWS(server(model, bad_log, {"--chat-template-file", bad.string()}));
  const auto err = read_file(bad_log);
  CHECK(err.find("--chat-template-file") != std::string::npos);
  CHECK(err.find("line 2") != std::string::npos);
}
