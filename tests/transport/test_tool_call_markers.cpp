// Tool-call markers that are single control tokens (Mistral's [TOOL_CALLS]): on a SentencePiece
// vocabulary that has the marker as a control token (as Mistral's v3 vocabularies do), the
// detokenized text has no marker, so without rendering a call stays content; rendered for the
// parser alone it is parsed, and the content never shows the marker.
#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "kernels/gguf/gguf.h"
#include "kernels/tokenizer/tokenizer.h"
#include "transport/chat/tool_call_markers.h"
#include "transport/chat/tool_call_parser.h"
#include "transport/http/generation.h"

using namespace tandem;

namespace {

constexpr int32_t k_marker = 3;  // [TOOL_CALLS]

/// <unk> <s> </s> [TOOL_CALLS] (control), the 256 byte tokens and "▁": every text spells in
/// bytes, and the marker is one control token.
std::unique_ptr<tokenizer> mistral_like_vocab(std::vector<uint8_t>& storage, std::optional<gguf::file>& f) {
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>", "[TOOL_CALLS]"};
  std::vector<float> scores = {0, 0, 0, 0};
  std::vector<int32_t> types = {2, 3, 3, 3};
  static const char* hex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    toks.push_back(std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">");
    scores.push_back(0);
    types.push_back(6);
  }
  toks.push_back("\xE2\x96\x81");
  scores.push_back(-1);
  types.push_back(1);
  gguf::writer w;
  w.set_string("tokenizer.ggml.model", "llama");
  w.set_array_string("tokenizer.ggml.tokens", toks);
  w.set_array_f32("tokenizer.ggml.scores", scores);
  w.set_array_i32("tokenizer.ggml.token_type", types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  storage = w.bytes();
  f.emplace(gguf::file::parse(storage));
  return tokenizer::from_gguf(*f);
}

struct fixture {
  fixture() : tok(mistral_like_vocab(storage, file)) {}
  std::vector<uint8_t> storage;
  std::optional<gguf::file> file;
  std::unique_ptr<tokenizer> tok;

  /// Generated ids: `before`, the marker token, `after` (text spelled by the vocabulary).
  std::vector<int32_t> ids(const std::string& before, const std::string& after) const {
    std::vector<int32_t> r = tok->encode(before, false);
    r.push_back(k_marker);
    for (int32_t id : tok->encode(after, false)) r.push_back(id);
    return r;
  }
};

struct outcome {
  std::string content;
  std::vector<parsed_tool_call> calls;
};

/// The front end's path for a chat with tools: text assembler -> tool-call parser, the ids fed
/// `step` at a time; `render` as openai_routes does it for a vocabulary with control markers.
outcome run(const tokenizer& tok, const std::vector<int32_t>& ids, bool render, size_t step = 1,
            std::vector<std::string> stop = {}) {
  transport::text_assembler text(tok, std::move(stop));
  std::vector<std::string> hidden;
  if (render) {
    std::vector<std::pair<int32_t, std::string>> r;
    for (const auto& m : control_markers(tok, tool_call_format::mistral)) {
      r.emplace_back(m.id, m.text);
      hidden.push_back(m.text);
    }
    text.render_control(std::move(r));
  }
  tool_call_parser parser(tool_call_format::mistral, hidden);
  outcome o;
  auto take = [&](tool_call_parser::result r) {
    o.content += r.content;
    for (auto& c : r.calls) o.calls.push_back(std::move(c));
  };
  for (size_t i = 0; i < ids.size(); i += step) {
    const size_t n = std::min(step, ids.size() - i);
    take(parser.push(text.push(std::span<const int32_t>(ids.data() + i, n))));
  }
  take(parser.push(text.finish()));
  take(parser.finish());
  return o;
}

}  // namespace

TEST_CASE("tool call markers: a marker that is a control token is found, and one spelled as text is not") {
  fixture f;
  CHECK(f.tok->token_bytes(k_marker).empty());  // decodes to no text
  CHECK(f.tok->token_text(k_marker) == "[TOOL_CALLS]");
  auto m = control_markers(*f.tok, tool_call_format::mistral);
  REQUIRE(m.size() == 1);
  CHECK(m[0].id == k_marker);
  CHECK(m[0].text == "[TOOL_CALLS]");
  // Hermes' tags are spelled in bytes here, llama3's tag is absent: nothing to render.
  CHECK(control_markers(*f.tok, tool_call_format::hermes).empty());
  CHECK(control_markers(*f.tok, tool_call_format::llama3_json).empty());
  CHECK(control_markers(*f.tok, tool_call_format::none).empty());
}

TEST_CASE("tool call markers: rendered for the parser, a call after the control token is parsed, and text never shows it") {
  fixture f;
  const auto ids = f.ids("Let me check.", R"([{"name": "get_weather", "arguments": {"city": "Paris"}}])");
  // Today's detokenizer alone: the marker is no text, so the call stays content.
  const outcome plain = run(*f.tok, ids, false);
  CHECK(plain.calls.empty());
  CHECK(plain.content.find("get_weather") != std::string::npos);
  CHECK(plain.content.find("[TOOL_CALLS]") == std::string::npos);
  for (size_t step : {size_t(1), size_t(2), size_t(7), ids.size()}) {
    INFO("step ", step);
    const outcome o = run(*f.tok, ids, true, step);
    REQUIRE(o.calls.size() == 1);
    CHECK(o.calls[0].name == "get_weather");
    CHECK(o.calls[0].arguments == R"({"city":"Paris"})");
    CHECK(o.content == run(*f.tok, f.tok->encode("Let me check.", false), false).content);
  }
  // Not a call after the marker: the content is what it is without rendering (no marker text).
  for (const std::string& after : {std::string(" sorry, no tool fits"), std::string(R"([{"nom": 1}] and text)"),
                                  std::string(R"([{"name": "f", "argu)")}) {
    INFO(after);
    const auto bad = f.ids("Hm.", after);
    const outcome want = run(*f.tok, bad, false);
    for (size_t step : {size_t(1), size_t(3), bad.size()}) {
      const outcome o = run(*f.tok, bad, true, step);
      CHECK(o.calls.empty());
      CHECK(o.content == want.content);
    }
  }
  // Two calls in one array, and text after them.
  const outcome two = run(*f.tok, f.ids("", R"([{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1]}}] done)"), true);
  REQUIRE(two.calls.size() == 2);
  CHECK(two.calls[1].arguments == R"({"x":[1]})");
  CHECK(two.content == " done");
}
