// The strict JSON reader/writer and the text assembly (stop strings) used by the front ends.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/generation.h"
#include "transport/http/json.h"

using namespace tandem;

TEST_CASE("json: parses values, escapes and surrogate pairs") {
  auto v = json::parse(R"( {"a":[1,-2.5e1,true,false,null],"s":"x\u00e9\ud83d\ude00\n\"\/","big":12345678901234} )");
  REQUIRE(v.k == json::kind::object);
  auto* a = v.find("a");
  REQUIRE(a);
  REQUIRE(a->arr.size() == 5);
  CHECK(a->arr[0].is_int);
  CHECK(a->arr[0].i == 1);
  CHECK(!a->arr[1].is_int);
  CHECK(a->arr[1].num == -25.0);
  CHECK(a->arr[2].b);
  CHECK(a->arr[4].k == json::kind::null);
  CHECK(v.find("s")->s == "x\xc3\xa9\xf0\x9f\x98\x80\n\"/");
  CHECK(v.find("big")->i == 12345678901234);
}

TEST_CASE("json: rejects malformed input") {
  for (std::string bad : {"", "{", "[1,]", "{\"a\":1,}", "01", "1.", "\"abc", "\"\x01\"", "\"\\x\"", "\"\\ud800\"",
                          "\"\\udc00\"", "\"\\ud800\\u0041\"", "{\"a\":1} x", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "nul",
                          "{\"k\":1,\"k\":2}", "[1e999]"}) {
    INFO(bad);
    CHECK_THROWS_AS(json::parse(bad), json::parse_error);
  }
  CHECK_THROWS_AS(json::parse(std::string(100, '[') + std::string(100, ']')), json::parse_error);
  CHECK_NOTHROW(json::parse(std::string(10, '[') + std::string(10, ']')));
}

TEST_CASE("json: writer escapes and round-trips") {
  json::writer w;
  w.begin_object().key("t").str("a\"b\\c\n\x01").key("n").num(-3).key("l").begin_array().boolean(true).null().end_array().end_object();
  CHECK(w.text() == "{\"t\":\"a\\\"b\\\\c\\n\\u0001\",\"n\":-3,\"l\":[true,null]}");
  auto v = json::parse(w.text());
  CHECK(v.find("t")->s == "a\"b\\c\n\x01");
}

TEST_CASE("json: dump writes numbers as written and quotes as json.dumps does, quote also escapes DEL") {
  // The grammar compiler emits a schema's const/enum values with dump(): the source text of a
  // number must survive (not %.17g of a double), and the strings match json.dumps.
  auto v = json::parse(R"({"n":[1.50,-0,1e3,12345678901234567890],"s":"a\u007f\b\f\u0001\"","o":{}})");
  CHECK(v.find("n")->arr[0].s == "1.50");
  CHECK(v.dump() == "{\"n\":[1.50,-0,1e3,12345678901234567890],\"s\":\"a\x7f\\b\\f\\u0001\\\"\",\"o\":{}}");
  CHECK(json::quote("a\x7f") == "\"a\\u007f\"");
  CHECK(json::quote("a\x7f", /*escape_del=*/false) == "\"a\x7f\"");
  std::string out = "x";
  json::append_quoted(out, "\n");
  CHECK(out == "x\"\\n\"");
}

TEST_CASE("text_assembler: holds back possible stop-string prefixes and trims at the match") {
  test::fake_tokenizer tok;
  auto ids = test::fake_tokenizer::ids("Hello world");
  {
    transport::text_assembler t(tok, {"lo w"});
    std::string out;
    for (int32_t id : ids) {
      out += t.push(std::span<const int32_t>(&id, 1));
      // Never emits text that could still turn into the stop string.
      CHECK(std::string("Hel").find(out) == 0);
    }
    CHECK(t.stopped());
    CHECK(out == "Hel");
    CHECK(t.tokens_consumed() == 7);
    CHECK(t.finish().empty());
  }
  {
    transport::text_assembler t(tok, {"wx"});
    std::string out = t.push(ids);
    CHECK(out == "Hello world");
    CHECK(!t.stopped());
  }
  {
    transport::text_assembler t(tok, {"ld!"});
    std::string out = t.push(ids);
    CHECK(out == "Hello wor");  // "ld" held back
    out += t.finish();
    CHECK(out == "Hello world");
  }
  {
    // A multi-byte character split across tokens is emitted whole.
    transport::text_assembler t(tok, {});
    auto e = test::fake_tokenizer::ids("\xc3\xa9");
    CHECK(t.push(std::span<const int32_t>(e.data(), 1)).empty());
    CHECK(t.push(std::span<const int32_t>(e.data() + 1, 1)) == "\xc3\xa9");
  }
}

TEST_CASE("request ids are unique") {
  transport::request_ids a("cmpl"), b("cmpl");
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) {
    CHECK(seen.insert(a.next()).second);
    CHECK(seen.insert(b.next()).second);
  }
  CHECK(a.next().rfind("cmpl-", 0) == 0);
}
