// tool_choice: which modes force a call, the schema of the forced call (checked by running its
// grammar over texts), and the errors that name the field.
#include <doctest/doctest.h>

#include <memory>

#include "kernels/grammar/json_schema.h"
#include "kernels/grammar/matcher.h"
#include "transport/chat/tool_call_parser.h"
#include "transport/http/json.h"
#include "transport/http/tool_choice.h"

using namespace tandem;
using namespace tandem::transport;

namespace {

constexpr const char* k_tools = R"("tools":[
  {"type":"function","function":{"name":"get_weather","parameters":{"type":"object",
    "properties":{"city":{"type":"string","maxLength":8},"unit":{"enum":["c","f"]}},"required":["city","unit"],
    "additionalProperties":false}}},
  {"type":"function","function":{"name":"add","parameters":{"type":"object","$defs":{"n":{"type":"integer"}},
    "properties":{"a":{"$ref":"#/$defs/n"},"b":{"$ref":"#/$defs/n"}},"required":["a","b"],"additionalProperties":false}}},
  {"type":"function","function":{"name":"ping"}}])";

struct parsed {
  std::optional<field_error> err;
  tool_choice choice;
  grammar_spec grammar;
};

parsed parse(const std::string& fields, grammar_spec g = {}) {
  parsed p;
  p.grammar = std::move(g);
  p.err = parse_tool_choice(json::parse("{" + fields + "}"), p.choice, p.grammar, limits{});
  return p;
}

/// A byte vocabulary: one token per byte value, EOS last.
std::shared_ptr<const grammar::token_trie> byte_vocab() {
  std::vector<std::string> t;
  for (int c = 0; c < 256; ++c) t.emplace_back(1, char(c));
  t.emplace_back("");
  return std::make_shared<grammar::token_trie>(t, int32_t(t.size() - 1));
}

/// Whether the spec's grammar takes `text` as a whole document.
bool accepts(const grammar_spec& g, std::string_view text) {
  grammar::automaton a(grammar::compile_grammar(g), byte_vocab());
  grammar::state s = a.initial(), n;
  for (char c : text) {
    a.advance_byte(s, uint8_t(c), n);
    if (n.empty()) return false;
    s.swap(n);
  }
  return grammar::automaton::accepting(s);
}

}  // namespace

TEST_CASE("tool_choice: auto and none constrain nothing, and none is its own mode") {
  auto a = parse(std::string(R"("tool_choice":"auto",)") + k_tools);
  CHECK(!a.err);
  CHECK(a.choice.mode == tool_choice_mode::auto_choice);
  CHECK(!a.grammar.active());
  auto absent = parse(k_tools);
  CHECK(absent.choice.mode == tool_choice_mode::auto_choice);
  auto none = parse(std::string(R"("tool_choice":"none",)") + k_tools);
  CHECK(!none.err);
  CHECK(none.choice.mode == tool_choice_mode::none);
  CHECK(!none.choice.forced());
  CHECK(!none.grammar.active());
}

TEST_CASE("tool_choice: a named function constrains the output to one call of it, with schema-valid arguments") {
  auto p = parse(std::string(R"("tool_choice":{"type":"function","function":{"name":"get_weather"}},)") + k_tools);
  REQUIRE_MESSAGE(!p.err, p.err->message);
  CHECK(p.choice.mode == tool_choice_mode::named);
  CHECK(p.choice.name == "get_weather");
  REQUIRE(p.grammar.kind == grammar_kind::json_schema);
  CHECK(accepts(p.grammar, R"({"name":"get_weather","arguments":{"city":"Paris","unit":"c"}})"));
  CHECK(accepts(p.grammar, R"({"name": "get_weather", "arguments": {"city": "", "unit": "f"}})"));
  CHECK(!accepts(p.grammar, R"({"name":"add","arguments":{"a":1,"b":2}})"));                  // another tool
  CHECK(!accepts(p.grammar, R"({"name":"get_weather","arguments":{"city":"Paris","unit":"k"}})"));  // enum
  CHECK(!accepts(p.grammar, R"({"name":"get_weather","arguments":{"city":"Amsterdam","unit":"c"}})"));  // maxLength
  CHECK(!accepts(p.grammar, R"({"name":"get_weather"})"));                                    // no arguments
  CHECK(!accepts(p.grammar, R"({"name":"get_weather","arguments":{"city":"P","unit":"c"},"x":1})"));
  // What the grammar lets through is read as a call by the parser the front end uses for it.
  tool_call_parser parser(tool_call_format::llama3_json);
  auto r = parser.push(R"({"name":"get_weather","arguments":{"city":"Paris","unit":"c"}})");
  auto f = parser.finish();
  r.calls.insert(r.calls.end(), f.calls.begin(), f.calls.end());
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == R"({"city":"Paris","unit":"c"})");
  CHECK(r.content + f.content == "");
}

TEST_CASE("tool_choice: required is any one tool's call, and $refs inside a tool's parameters still resolve") {
  auto p = parse(std::string(R"("tool_choice":"required",)") + k_tools);
  REQUIRE_MESSAGE(!p.err, p.err->message);
  CHECK(p.choice.mode == tool_choice_mode::required);
  REQUIRE(p.grammar.kind == grammar_kind::json_schema);
  CHECK(accepts(p.grammar, R"({"name":"get_weather","arguments":{"city":"Oslo","unit":"f"}})"));
  CHECK(accepts(p.grammar, R"({"name":"add","arguments":{"a":1,"b":-2}})"));
  CHECK(!accepts(p.grammar, R"({"name":"add","arguments":{"a":1.5,"b":2}})"));  // the $ref'd integer
  CHECK(accepts(p.grammar, R"({"name":"ping","arguments":{}})"));              // no parameters: {}
  CHECK(!accepts(p.grammar, R"({"name":"ping","arguments":{"x":1}})"));
  CHECK(!accepts(p.grammar, R"({"name":"other","arguments":{}})"));
  CHECK(!accepts(p.grammar, "Sure, let me call it."));
  // Properties named like data keywords still have their $refs followed.
  auto named = parse(R"("tool_choice":"required","tools":[{"type":"function","function":{"name":"cfg","parameters":
                        {"type":"object","definitions":{"b":{"type":"boolean"}},"properties":{"default":{"$ref":"#/definitions/b"},
                         "enum":{"$ref":"#/definitions/b"}},"required":["default","enum"],"additionalProperties":false}}}])");
  REQUIRE_MESSAGE(!named.err, named.err->message);
  CHECK(accepts(named.grammar, R"({"name":"cfg","arguments":{"default":true,"enum":false}})"));
  CHECK(!accepts(named.grammar, R"({"name":"cfg","arguments":{"default":1,"enum":false}})"));
  // A recursive schema ("#" = the parameters) points at the tool's own definition.
  auto rec = parse(R"("tool_choice":"required","tools":[{"type":"function","function":{"name":"tree","parameters":
                      {"type":"object","properties":{"kids":{"type":"array","items":{"$ref":"#"},"maxItems":2}},
                       "required":["kids"],"additionalProperties":false}}}])");
  REQUIRE_MESSAGE(!rec.err, rec.err->message);
  CHECK(accepts(rec.grammar, R"({"name":"tree","arguments":{"kids":[{"kids":[]},{"kids":[{"kids":[]}]}]}})"));
  CHECK(!accepts(rec.grammar, R"({"name":"tree","arguments":{"kids":[{"kids":[{"name":"tree"}]}]}})"));
}

TEST_CASE("tool_choice: errors name tool_choice, or the tool's parameters and the refused keyword") {
  auto bad_keyword = parse(R"("tool_choice":"required","tools":[{"type":"function","function":{"name":"a"}},
      {"type":"function","function":{"name":"b","parameters":{"type":"object","properties":{"s":{"type":"string","pattern":"^x"}}}}}])");
  REQUIRE(bad_keyword.err);
  CHECK(bad_keyword.err->status == 422);
  CHECK(bad_keyword.err->param == "tools[1].function.parameters");
  CHECK(bad_keyword.err->message.find("'pattern'") != std::string::npos);
  CHECK(bad_keyword.err->message.find("tools[1].function.parameters") != std::string::npos);
  // Named: only the named tool is compiled, so another tool's keyword does not matter.
  auto named_ok = parse(R"("tool_choice":{"type":"function","function":{"name":"a"}},"tools":[{"type":"function","function":{"name":"a"}},
      {"type":"function","function":{"name":"b","parameters":{"type":"object","properties":{"s":{"type":"string","pattern":"^x"}}}}}])");
  CHECK(!named_ok.err);
  // auto with such a tool constrains nothing and compiles nothing.
  CHECK(!parse(R"("tool_choice":"auto","tools":[{"type":"function","function":{"name":"b","parameters":{"pattern":"x"}}}])").err);

  auto unknown = parse(std::string(R"("tool_choice":{"type":"function","function":{"name":"nope"}},)") + k_tools);
  REQUIRE(unknown.err);
  CHECK(unknown.err->status == 422);
  CHECK(unknown.err->param == "tool_choice");
  CHECK(unknown.err->message.find("'nope'") != std::string::npos);
  CHECK(unknown.err->message.find("get_weather, add, ping") != std::string::npos);

  auto no_tools = parse(R"("tool_choice":"required")");
  REQUIRE(no_tools.err);
  CHECK(no_tools.err->param == "tool_choice");
  CHECK(no_tools.err->status == 422);
  CHECK(parse(R"("tool_choice":"required","tools":[])").err);

  auto word = parse(std::string(R"("tool_choice":"always",)") + k_tools);
  REQUIRE(word.err);
  CHECK(word.err->status == 422);
  CHECK(word.err->message.find("'always'") != std::string::npos);
  auto type = parse(std::string(R"("tool_choice":3,)") + k_tools);
  REQUIRE(type.err);
  CHECK(type.err->status == 400);
  auto shape = parse(std::string(R"("tool_choice":{"type":"function","name":"add"},)") + k_tools);
  REQUIRE(shape.err);
  CHECK(shape.err->status == 400);
  CHECK(shape.err->param == "tool_choice");

  grammar_spec rf{grammar_kind::json_object, ""};
  auto both = parse(std::string(R"("tool_choice":"required",)") + k_tools, rf);
  REQUIRE(both.err);
  CHECK(both.err->param == "tool_choice");
  CHECK(both.err->message.find("response_format") != std::string::npos);

  auto bad_tool = parse(R"("tool_choice":"required","tools":[{"type":"function","function":{"name":"a","parameters":[]}}])");
  REQUIRE(bad_tool.err);
  CHECK(bad_tool.err->param == "tools[0].function.parameters");
  CHECK(bad_tool.err->status == 400);
  auto no_name = parse(R"("tool_choice":"required","tools":[{"type":"function","function":{}}])");
  REQUIRE(no_name.err);
  CHECK(no_name.err->param == "tools[0].function.name");
}
