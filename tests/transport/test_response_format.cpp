// response_format and llama-server's json_schema read into the request's grammar_spec.
#include <doctest/doctest.h>

#include "transport/http/json.h"
#include "transport/http/response_format.h"

using namespace tandem;

namespace {
std::optional<transport::field_error> parse(const std::string& body, grammar_spec& out, bool chat = true,
                                            limits lim = {}) {
  return transport::parse_response_format(json::parse(body), chat, out, lim);
}
}  // namespace

TEST_CASE("response_format: text, json_object and json_schema become the request's grammar") {
  grammar_spec g;
  CHECK(!parse(R"({"response_format":{"type":"text"}})", g));
  CHECK(g.kind == grammar_kind::none);
  CHECK(!parse(R"({"response_format":null})", g));
  CHECK(!parse(R"({"response_format":{"type":"json_object"}})", g));
  CHECK(g.kind == grammar_kind::json_object);
  g = {};
  CHECK(!parse(R"({"response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,
                  "schema":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}}}})",
               g));
  CHECK(g.kind == grammar_kind::json_schema);
  // The source is compact JSON the worker's parser reads back to the same schema.
  auto doc = json::parse(g.source);
  CHECK(doc.find("properties")->find("a")->find("type")->s == "integer");
  g = {};
  CHECK(!parse(R"({"prompt":"x","json_schema":{"type":"boolean"}})", g, false));
  CHECK(g.kind == grammar_kind::json_schema);
  g = {};
  CHECK(!parse(R"({"response_format":{"type":"json_object","schema":{"type":"boolean"}}})", g));
  CHECK(g.kind == grammar_kind::json_schema);
}

TEST_CASE("response_format: errors name the parameter, the keyword and the bound") {
  grammar_spec g;
  auto e = parse(R"({"response_format":"json"})", g);
  REQUIRE(e);
  CHECK(e->status == 400);
  CHECK(e->param == "response_format");
  e = parse(R"({"response_format":{"type":"yaml"}})", g);
  REQUIRE(e);
  CHECK(e->status == 422);
  CHECK(e->param == "response_format.type");
  e = parse(R"({"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"string","format":"email"}}}})",
            g);
  REQUIRE(e);
  CHECK(e->status == 422);
  CHECK(e->param == "response_format.json_schema.schema");
  CHECK(e->message.find("'format'") != std::string::npos);
  limits lim;
  lim.max_grammar_bytes = 16;
  e = parse(R"({"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","properties":{}}}}})",
            g, true, lim);
  REQUIRE(e);
  CHECK(e->message.find("max_grammar_bytes") != std::string::npos);
  e = parse(R"({"prompt":"x","json_schema":{"type":"boolean"},"response_format":{"type":"json_object"}})", g, false);
  REQUIRE(e);
  CHECK(e->param == "json_schema");
  CHECK(g.kind == grammar_kind::none);  // nothing taken from a refused request
}
