#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "transport/chat/tool_call_parser.h"

using namespace tandem;

namespace {

struct outcome {
  std::string content;
  std::vector<parsed_tool_call> calls;
};

/// Feeds `text` in pieces of `piece` bytes (0 = whole).
outcome run(tool_call_format f, const std::string& text, size_t piece) {
  tool_call_parser p(f);
  outcome o;
  auto take = [&](tool_call_parser::result r) {
    o.content += r.content;
    for (auto& c : r.calls) o.calls.push_back(c);
  };
  if (piece == 0) take(p.push(text));
  else
    for (size_t i = 0; i < text.size(); i += piece) take(p.push(std::string_view(text).substr(i, piece)));
  take(p.finish());
  return o;
}

/// The outcome of `text`, checked to be the same however the text is split (every split in
/// two, and byte by byte).
outcome parse_all_ways(tool_call_format f, const std::string& text) {
  outcome whole = run(f, text, 0);
  auto same = [&](const outcome& o, const std::string& how) {
    INFO("split: " << how << " input: " << text);
    CHECK(o.content == whole.content);
    REQUIRE(o.calls.size() == whole.calls.size());
    for (size_t i = 0; i < o.calls.size(); ++i) {
      CHECK(o.calls[i].name == whole.calls[i].name);
      CHECK(o.calls[i].arguments == whole.calls[i].arguments);
    }
  };
  same(run(f, text, 1), "bytes");
  for (size_t cut = 1; cut < text.size(); ++cut) {
    tool_call_parser p(f);
    outcome o;
    for (auto r : {p.push(text.substr(0, cut)), p.push(text.substr(cut)), p.finish()}) {
      o.content += r.content;
      for (auto& c : r.calls) o.calls.push_back(c);
    }
    same(o, "at " + std::to_string(cut));
  }
  return whole;
}

}  // namespace

TEST_CASE("tool calls: the format follows the chat template") {
  CHECK(tool_call_format_for_template("{{ '<tool_call>\\n' }}") == tool_call_format::hermes);
  CHECK(tool_call_format_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == tool_call_format::mistral);
  CHECK(tool_call_format_for_template("<|start_header_id|> {\"name\": function name, \"parameters\": ...}") ==
        tool_call_format::llama3_json);
  CHECK(tool_call_format_for_template("<|im_start|>{{ message.content }}") == tool_call_format::none);
}

TEST_CASE("tool calls: hermes calls between content, however the text is split") {
  auto o = parse_all_ways(tool_call_format::hermes,
                          "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                          "\"days\": 3}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>");
  CHECK(o.content == "Let me check.\n\n");
  REQUIRE(o.calls.size() == 2);
  CHECK(o.calls[0].name == "get_weather");
  CHECK(o.calls[0].arguments == R"({"city":"Paris","days":3})");
  CHECK(o.calls[1].name == "now");
  CHECK(o.calls[1].arguments == "{}");
}

TEST_CASE("tool calls: hermes without the closing tag at the end, and a bad call kept as content") {
  auto o = parse_all_ways(tool_call_format::hermes, "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": [1, \"]}\"]}}");
  REQUIRE(o.calls.size() == 1);
  CHECK(o.calls[0].arguments == R"({"x":[1,"]}"]})");
  CHECK(o.content.empty());
  auto bad = parse_all_ways(tool_call_format::hermes, "a <tool_call>{not json}</tool_call> b <tool_");
  CHECK(bad.calls.empty());
  CHECK(bad.content == "a <tool_call>{not json}</tool_call> b <tool_");
  auto noname = parse_all_ways(tool_call_format::hermes, "<tool_call>{\"arguments\": {}}</tool_call>");
  CHECK(noname.calls.empty());
  CHECK(noname.content == "<tool_call>{\"arguments\": {}}</tool_call>");
}

TEST_CASE("tool calls: llama 3 JSON is a call only when the whole reply is one") {
  auto o = parse_all_ways(tool_call_format::llama3_json,
                          " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; "
                          "{\"name\": \"now\", \"parameters\": {}} ");
  CHECK(o.content.empty());
  REQUIRE(o.calls.size() == 2);
  CHECK(o.calls[0].arguments == R"({"city":"Paris"})");
  CHECK(o.calls[1].name == "now");
  auto tagged = parse_all_ways(tool_call_format::llama3_json, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"a\": 1.5}}");
  // Found by fuzz_tool_calls: a tag after `;` split across pieces.
  auto second_tagged = parse_all_ways(tool_call_format::llama3_json,
                                      "{\"name\": \"f\", \"parameters\": {}}; <|python_tag|>{\"name\": \"g\", \"parameters\": {}}");
  CHECK(second_tagged.calls.size() == 2);
  CHECK(second_tagged.content.empty());
  REQUIRE(tagged.calls.size() == 1);
  CHECK(tagged.calls[0].arguments == R"({"a":1.5})");
  auto text = parse_all_ways(tool_call_format::llama3_json, "The answer is {\"name\": \"f\"}");
  CHECK(text.calls.empty());
  CHECK(text.content == "The answer is {\"name\": \"f\"}");
  auto json_answer = parse_all_ways(tool_call_format::llama3_json, "{\"city\": \"Paris\"}");
  CHECK(json_answer.calls.empty());
  CHECK(json_answer.content == "{\"city\": \"Paris\"}");
  auto cut = parse_all_ways(tool_call_format::llama3_json, "{\"name\": \"f\", \"parameters\": {\"a\":");
  CHECK(cut.calls.empty());
  CHECK(cut.content == "{\"name\": \"f\", \"parameters\": {\"a\":");
}

TEST_CASE("tool calls: mistral's [TOOL_CALLS] array, string arguments kept as written") {
  auto o = parse_all_ways(tool_call_format::mistral,
                          "Sure. [TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"q\": \"x\\\"y\"}}, "
                          "{\"name\": \"b\", \"arguments\": \"{\\\"n\\\": 2}\"}]");
  CHECK(o.content == "Sure. ");
  REQUIRE(o.calls.size() == 2);
  CHECK(o.calls[0].arguments == R"({"q":"x\"y"})");
  CHECK(o.calls[1].name == "b");
  CHECK(o.calls[1].arguments == R"({"n": 2})");
  // Found by fuzz_tool_calls: after a marker that is not followed by calls, or by JSON that is
  // not calls, the text after it is still scanned for the next marker.
  auto again = parse_all_ways(tool_call_format::mistral, "[TOOL_CALLS] x [TOOL_CALLS] [{\"name\": \"a\"}]");
  CHECK(again.content == "[TOOL_CALLS] x ");
  REQUIRE(again.calls.size() == 1);
  CHECK(again.calls[0].arguments == "{}");
  auto bad_then_good = parse_all_ways(tool_call_format::mistral, "[TOOL_CALLS] [1] [TOOL_CALLS] [{\"name\": \"b\"}]");
  CHECK(bad_then_good.content == "[TOOL_CALLS] [1] ");
  CHECK(bad_then_good.calls.size() == 1);
  auto plain = parse_all_ways(tool_call_format::mistral, "no calls [TOOL here");
  CHECK(plain.calls.empty());
  CHECK(plain.content == "no calls [TOOL here");
}

TEST_CASE("tool calls: format none passes everything through at once") {
  tool_call_parser p(tool_call_format::none);
  CHECK(p.push("<tool_call>{\"name\": \"f\"}").content == "<tool_call>{\"name\": \"f\"}");
  CHECK(p.finish().content.empty());
  CHECK(p.calls_found() == 0);
}
