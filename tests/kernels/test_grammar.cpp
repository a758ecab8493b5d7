#include <doctest/doctest.h>

#include <fmt/format.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/base/json.h"
#include "kernels/grammar/json_schema.h"
#include "kernels/grammar/matcher.h"
#include "kernels/grammar/sessions.h"

using namespace tandem;
using namespace tandem::grammar;

namespace {

/// Every printable ASCII byte, newline, tab, a few UTF-8 bytes and multi-byte pieces JSON
/// often uses; a control token (empty bytes) and EOS last.
std::shared_ptr<const token_trie> toy_vocab() {
  std::vector<std::string> t;
  for (int c = 0x20; c < 0x7f; ++c) t.emplace_back(1, char(c));
  for (const char* s : {"\n", "\t", "{\"", "\":", "\": ", "\",", "\"}", "}", "},", "true", "false", "null", "12", "0.5",
                        "ab", "name", "\"name\"", "  ", "\n  ", "[\"", "\"]", "é", "\xC3", "\xA9", "\xED\xA0\x80", "e+",
                        "red", "\"red\"", "00", "-0", "1e", ", \""})
    t.emplace_back(s);
  t.emplace_back("");       // control token
  t.emplace_back("</s>");   // EOS (its bytes never match: only the id counts)
  return std::make_shared<token_trie>(t, int32_t(t.size() - 1));
}

bool bit(const std::vector<uint64_t>& m, int32_t id) { return (m[size_t(id) >> 6] >> (id & 63)) & 1; }

/// The naive reference of a mask: each token tried alone on a copy of the state.
void check_mask_against_brute_force(automaton& a, const state& s) {
  const auto mask = a.mask(s);  // copy: the reference may advance the automaton's tables
  for (int32_t id = 0; id < a.vocab().n_vocab(); ++id) {
    state c = s;
    const bool ok = a.advance_token(c, id);
    CHECK_MESSAGE(bit(mask, id) == ok, "token ", id, " '", a.vocab().bytes(id), "'");
  }
}

bool accepts_text(automaton& a, std::string_view text, bool need_complete = true) {
  state s = a.initial(), n;
  for (char c : text) {
    a.advance_byte(s, uint8_t(c), n);
    if (n.empty()) return false;
    s.swap(n);
  }
  return !need_complete || automaton::accepting(s);
}

/// A validator for the schema subset the compiler supports (the test's independent reference).
bool validate(const json::value& v, const json::value& schema, const json::value& root) {
  using K = json::kind;
  if (schema.k == K::boolean) return schema.b;
  if (auto* r = schema.find("$ref")) {
    const json::value* at = &root;
    std::string p = r->s.substr(1);
    size_t i = 0;
    while (i < p.size()) {
      size_t j = p.find('/', i + 1);
      if (j == std::string::npos) j = p.size();
      at = at->find(p.substr(i + 1, j - i - 1));
      i = j;
    }
    return validate(v, *at, root);
  }
  if (auto* c = schema.find("const")) return c->dump() == v.dump();
  if (auto* e = schema.find("enum")) {
    for (auto& x : e->arr)
      if (x.dump() == v.dump()) return true;
    return false;
  }
  for (const char* key : {"anyOf", "oneOf", "allOf"})
    if (auto* a = schema.find(key)) {
      for (auto& x : a->arr)
        if (validate(v, x, root)) return true;
      return false;
    }
  auto* t = schema.find("type");
  if (!t) return true;
  const std::string& ty = t->s;
  if (ty == "string") {
    if (v.k != K::string) return false;
    size_t chars = 0;  // code points: bytes that do not continue a UTF-8 sequence
    for (char c : v.s) chars += (uint8_t(c) & 0xC0) != 0x80;
    if (auto* mn = schema.find("minLength"); mn && chars < std::stoul(mn->s)) return false;
    if (auto* mx = schema.find("maxLength"); mx && chars > std::stoul(mx->s)) return false;
    return true;
  }
  if (ty == "integer") return v.k == K::number && v.s.find_first_of(".eE") == std::string::npos;
  if (ty == "number") return v.k == K::number;
  if (ty == "boolean") return v.k == K::boolean;
  if (ty == "null") return v.k == K::null;
  if (ty == "array") {
    if (v.k != K::array) return false;
    if (auto* mn = schema.find("minItems"); mn && v.arr.size() < std::stoul(mn->s)) return false;
    if (auto* mx = schema.find("maxItems"); mx && v.arr.size() > std::stoul(mx->s)) return false;
    if (auto* it = schema.find("items"))
      for (auto& x : v.arr)
        if (!validate(x, *it, root)) return false;
    return true;
  }
  if (ty == "object") {
    if (v.k != K::object) return false;
    auto* props = schema.find("properties");
    if (auto* req = schema.find("required"))
      for (auto& n : req->arr)
        if (!v.find(n.s)) return false;
    for (auto& [k, x] : v.obj) {
      const json::value* ps = props ? props->find(k) : nullptr;
      if (!ps) {
        auto* ap = schema.find("additionalProperties");
        if (ap && ap->k == K::boolean && !ap->b) return false;
        continue;
      }
      if (!validate(x, *ps, root)) return false;
    }
    return true;
  }
  return false;
}

/// Random walks through the masks; returns the completed documents (EOS drawn).
std::vector<std::string> random_documents(automaton& a, int walks, int max_steps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> docs;
  const int32_t eos = a.vocab().eos_id();
  for (int w = 0; w < walks; ++w) {
    state s = a.initial();
    std::string out;
    for (int step = 0; step < max_steps; ++step) {
      const auto& m = a.mask(s);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < a.vocab().n_vocab(); ++id)
        if (bit(m, id)) allowed.push_back(id);
      REQUIRE(!allowed.empty());
      // Favour EOS and structure a little so walks end.
      int32_t pick = allowed[rng() % allowed.size()];
      if (bit(m, eos) && rng() % 2 == 0) pick = eos;
      REQUIRE(a.advance_token(s, pick));
      if (pick == eos) {
        docs.push_back(out);
        break;
      }
      out += a.vocab().bytes(pick);
    }
  }
  return docs;
}

const char* test_schema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "color": {"enum": ["red", "green", 3, null]},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    "pos": {"$ref": "#/$defs/point"},
    "note": {"anyOf": [{"type": "null"}, {"type": "number"}]}
  },
  "required": ["name", "color", "age", "tags"],
  "additionalProperties": false,
  "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"const": "up"}},
                      "required": ["x"], "additionalProperties": false}}
})";

}  // namespace

TEST_CASE("grammar: json_object accepts objects and rejects other documents") {
  automaton a(json_object_grammar(), toy_vocab());
  for (const char* ok : {"{}", "{ }", R"({"a":1})", R"( {"a": [1, 2.5e-3, true, null, "x\"y\u00e9"], "b": {"c": {}}})",
                         "{\"é\":\"\xE2\x82\xAC\"}", "{\n  \"a\": -0.5E+2\n}"})
    CHECK_MESSAGE(accepts_text(a, ok), ok);
  for (const char* bad : {"[]", "1", "\"x\"", "{", R"({"a"})", R"({"a":01})", R"({"a":1,})", R"({a:1})",
                          "{\"a\":\"\xED\xA0\x80\"}", "{\"a\":\"\x01\"}", "{} {}", R"({"a":tru})"})
    CHECK_MESSAGE(!accepts_text(a, bad), bad);
  CHECK(accepts_text(a, R"({"a": [1, {"b")", false));  // a prefix
}

TEST_CASE("grammar: the mask equals trying every token on a copy of the state") {
  auto vocab = toy_vocab();
  for (int which = 0; which < 2; ++which) {
    automaton a(which ? compile_json_schema(test_schema) : json_object_grammar(), vocab);
    const std::string doc = which ? R"({"name": "ab", "color": "red", "age": -12, "tags": [true], "pos": {"x": 0.5}})"
                                  : R"({"a": [1, {"b": "x\u00e9"}, null], "c": true})";
    state s = a.initial(), n;
    check_mask_against_brute_force(a, s);
    for (size_t i = 0; i < doc.size(); ++i) {
      a.advance_byte(s, uint8_t(doc[i]), n);
      REQUIRE_MESSAGE(!n.empty(), doc.substr(0, i + 1));
      s.swap(n);
      if (i % 3 == 0 || i + 1 == doc.size()) check_mask_against_brute_force(a, s);
    }
    CHECK(automaton::accepting(s));
    CHECK(bit(a.mask(s), vocab->eos_id()));
    CHECK(a.stats().mask_hits > 0);  // the reference's repeated states hit the cache
  }
}

TEST_CASE("grammar: every completed random walk of a schema parses and validates") {
  const json::value schema = json::parse(test_schema);
  automaton a(compile_json_schema(test_schema), toy_vocab());
  auto docs = random_documents(a, 200, 400, 7);
  CHECK(docs.size() > 50);
  for (const auto& d : docs) {
    json::value v;
    REQUIRE_NOTHROW_MESSAGE(v = json::parse(d), d);
    CHECK_MESSAGE(validate(v, schema, schema), d);
  }
  // And the schema's own examples: valid ones accepted, invalid ones refused.
  CHECK(accepts_text(a, R"({"name":"","color":null,"age":0,"tags":[false,true,true]})"));
  CHECK(accepts_text(a, R"({"name":"abcdef","color":3,"age":7,"tags":[true],"pos":{"x":1,"y":"up"},"note":null})"));
  CHECK(!accepts_text(a, R"({"name":"abcdefg","color":3,"age":7,"tags":[true]})"));          // maxLength
  CHECK(!accepts_text(a, R"({"name":"a","color":"blue","age":7,"tags":[true]})"));          // enum
  CHECK(!accepts_text(a, R"({"name":"a","color":3,"age":7.5,"tags":[true]})"));             // integer
  CHECK(!accepts_text(a, R"({"name":"a","color":3,"age":7,"tags":[]})"));                   // minItems
  CHECK(!accepts_text(a, R"({"name":"a","color":3,"age":7,"tags":[true,true,true,true]})"));  // maxItems
  CHECK(!accepts_text(a, R"({"name":"a","color":3,"age":7})"));                             // required
  CHECK(!accepts_text(a, R"({"name":"a","color":3,"age":7,"tags":[true],"extra":1})"));     // additional
  CHECK(!accepts_text(a, R"({"color":3,"name":"a","age":7,"tags":[true]})"));               // order
}

TEST_CASE("grammar: unsupported schema keywords are refused naming the keyword and its path") {
  auto msg = [](const char* s) {
    try {
      compile_json_schema(s);
    } catch (const tandem::error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(msg(R"({"type":"object","properties":{"a":{"type":"string","pattern":"^x"}}})").find("'pattern'") !=
        std::string::npos);
  CHECK(msg(R"({"type":"object","properties":{"a":{"type":"string","pattern":"^x"}}})").find("/properties/a") !=
        std::string::npos);
  CHECK(msg(R"({"type":"integer","minimum":3})").find("'minimum'") != std::string::npos);
  CHECK(msg(R"({"type":"object","required":["b"],"properties":{"a":{}}})").find("'b'") != std::string::npos);
  CHECK(msg(R"({"$ref":"#/$defs/missing"})").find("points to nothing") != std::string::npos);
  CHECK(msg(R"({"type":"strin"})").find("'strin'") != std::string::npos);
  CHECK(msg("{not json").find("not valid JSON") != std::string::npos);
  CHECK(msg(R"({"type":"string","maxLength":100000})").find("maxLength") != std::string::npos);
  CHECK(msg(R"({"type":"boolean"})").empty());
}

TEST_CASE("grammar: recursive $ref and type lists compile and match") {
  const char* s = R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":["integer","null"]},
                      "kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"]}},
                      "$ref":"#/$defs/node"})";
  automaton a(compile_json_schema(s), toy_vocab());
  CHECK(accepts_text(a, R"({"v":1,"kids":[{"v":null},{"v":2,"kids":[{"v":3}]}]})"));
  CHECK(accepts_text(a, R"({"v":1})"));
  CHECK(!accepts_text(a, R"({"v":"x"})"));
  CHECK(!accepts_text(a, R"({"kids":[]})"));
}

TEST_CASE("grammar: builder lowers bounded repetition and refuses left recursion") {
  grammar_builder b;
  uint32_t r = b.add("root", expr::repeat(expr::literal("ab"), 1, 3));
  automaton a(b.finish(r), toy_vocab());
  CHECK(accepts_text(a, "ab"));
  CHECK(accepts_text(a, "ababab"));
  CHECK(!accepts_text(a, ""));
  CHECK(!accepts_text(a, "abababab"));
  grammar_builder lr;
  uint32_t x = lr.declare("x");
  lr.define(x, expr::alt({expr::seq({expr::ref(x), expr::literal("a")}), expr::literal("a")}));
  CHECK_THROWS_AS(lr.finish(x), tandem::error);
}

TEST_CASE("grammar: sessions mask, advance per token and replay a sequence they have not seen") {
  auto vocab = toy_vocab();
  grammar_sessions gs(vocab, {.max_grammars = 2, .max_seqs = 2});
  grammar_spec spec{grammar_kind::json_object, ""};
  std::vector<float> logits(size_t(vocab->n_vocab()), 0.0f);
  gs.constrain("a", spec, {}, logits);
  // Only tokens that can start an object (after optional whitespace) stay.
  auto find = [&](std::string_view s) {
    for (int32_t i = 0; i < vocab->n_vocab(); ++i)
      if (vocab->bytes(i) == s) return i;
    return -1;
  };
  CHECK(logits[size_t(find("{"))] == 0.0f);
  CHECK(logits[size_t(find("{\""))] == 0.0f);
  CHECK(std::isinf(logits[size_t(find("["))]));
  CHECK(std::isinf(logits[size_t(vocab->eos_id())]));
  gs.accepted("a", find("{"));
  std::vector<int32_t> gen{find("{")};
  gs.constrain("a", spec, gen, logits);
  CHECK(gs.stats().replays == 0);
  gen.push_back(find("}"));
  // A new name with history: replayed, and then EOS is the only way on.
  std::fill(logits.begin(), logits.end(), 0.0f);
  gs.constrain("b", spec, gen, logits);
  CHECK(gs.stats().replays == 1);
  CHECK(logits[size_t(vocab->eos_id())] == 0.0f);
  CHECK(std::isinf(logits[size_t(find(" "))]));
  // A history that breaks the grammar is an error naming the request.
  std::vector<int32_t> bad{find("[")};
  CHECK_THROWS_WITH_AS(gs.constrain("c", spec, bad, logits), doctest::Contains("request c"), tandem::error);
  CHECK(gs.n_seqs() <= 2);
}

TEST_CASE("grammar: a full stack table is an overloaded error, and sessions rebuild the automaton once") {
  auto vocab = toy_vocab();
  const std::string doc = R"({"a":[[[[{"b":[[[1]]]}]]]]})";
  {
    automaton a(json_object_grammar(), vocab, {.max_stacks = 8});
    try {
      accepts_text(a, doc);
      FAIL("no error");
    } catch (const tandem::error& e) {
      CHECK(e.kind() == error_kind::overloaded);
    }
  }
  // Each sequence alone fits the table; all of them together do not: the sessions drop the
  // full automaton and replay on a fresh one instead of failing.
  grammar_spec spec{grammar_kind::json_object, ""};
  auto find = [&](std::string_view s) {
    for (int32_t i = 0; i < vocab->n_vocab(); ++i)
      if (vocab->bytes(i) == s) return i;
    return -1;
  };
  std::vector<std::vector<int32_t>> gens;
  for (int n = 0; n < 12; ++n) {
    std::vector<int32_t> gen{find("{\"")};
    for (int k = 0; k <= n; ++k) gen.push_back(find("a"));  // a different key each: different stacks
    gen.push_back(find("\":"));
    for (int d = 0; d < 1 + n % 4; ++d) gen.push_back(find("["));
    gens.push_back(gen);
  }
  std::vector<float> logits(size_t(vocab->n_vocab()));
  size_t need = 0;
  for (const auto& g : gens) {
    grammar_sessions one(vocab);
    one.constrain("x", spec, g, logits);
    need = std::max(need, one.automaton_for(spec)->n_stacks());
  }
  session_limits lim;
  lim.tables.max_stacks = need + 8;
  grammar_sessions gs(vocab, lim);
  for (size_t n = 0; n < gens.size(); ++n) CHECK_NOTHROW(gs.constrain("s" + std::to_string(n), spec, gens[n], logits));
  CHECK(gs.stats().rebuilds > 0);
}

TEST_CASE("grammar: a schema that lowers to too many elements is refused") {
  std::string many = R"({"type":"object","properties":{)";
  for (int i = 0; i < 40; ++i) many += fmt::format(R"({}"p{}":{{"type":"string","maxLength":1000}})", i ? "," : "", i);
  many += "}}";
  schema_limits lim;
  lim.max_elements = 20000;
  CHECK_THROWS_WITH_AS(compile_json_schema(many, lim), doctest::Contains("more than 20000 grammar elements"),
                       tandem::error);
  CHECK_NOTHROW(compile_json_schema(R"({"type":"string","maxLength":1000})", lim));
}
