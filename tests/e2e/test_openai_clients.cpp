// End to end: the Vercel AI SDK (@ai-sdk/openai-compatible), LangChain (@langchain/openai) and
// the openai client's tools against `tandem serve` with a tool-capable chat template (Qwen 2.5,
// whose calls are <tool_call> blocks): chat, streaming, logprobs, a multi-turn tool
// conversation (tests/e2e/openai/check_clients.mjs; npm ci by tests/run.sh).
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/model/make_model.h"
#include "tests/e2e/process.h"

using namespace tandem;
using namespace tandem::e2e;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("openai clients: the AI SDK, LangChain and openai tools against a model with a tool-capable template") {
  const fs::path dir = fs::path(TANDEM_SOURCE_DIR) / "tests/e2e/openai";
  const bool installed = fs::exists(dir / "node_modules/ai") && fs::exists(dir / "node_modules/@langchain/openai");
  REQUIRE_MESSAGE(installed, "the client npm packages are missing: run `npm ci` in tests/e2e/openai (tests/run.sh does this)");
  temp_dir tmp;
  const fs::path templates = fs::path(TANDEM_SHARED_MODELS).parent_path() / "chat-templates";
  make_model_options o;
  o.preset = "tiny-15m";  // micro's 512-token context is too short for the template's tool prompt
  o.dtype = ggml_type::f16;
  o.seed = 7;
  o.chat_template = read_file(templates / "Qwen-Qwen2.5-7B-Instruct.jinja");
  REQUIRE(!o.chat_template.empty());
  const std::string model = (tmp.path / "tools.gguf").string();
  write_random_llama(o, model);
  const std::string log = (tmp.path / "serve.log").string();
  server srv(model, log);
  const std::string err_path = (tmp.path / "node.err").string();
  child node({"/usr/bin/env", "node", (dir / "check_clients.mjs").string()},
             {{"TANDEM_BASE_URL", "http://127.0.0.1:" + std::to_string(srv.http_port) + "/v1"}}, err_path);
  auto out = node.read_all(std::chrono::seconds(90));
  const int rc = node.wait(std::chrono::seconds(10));
  INFO("node stdout:\n" << out << "\nnode stderr:\n" << read_file(err_path));
  INFO("server log: " << read_file(log));
  CHECK(rc == 0);
  CHECK(out.find("all client library checks passed") != std::string::npos);
}
