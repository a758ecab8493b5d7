#include "kernels/grammar/json_schema.h"

#include <fmt/format.h>

#include <map>
#include <optional>
#include <set>

#include "kernels/base/error.h"
#include "kernels/base/json.h"

namespace tandem::grammar {

namespace {

using K = json::kind;

const std::set<std::string_view> annotation_keys = {"title",   "description", "default",  "examples",
                                                    "$schema", "$id",         "$comment", "deprecated",
                                                    "readOnly", "writeOnly",  "strict",   "$defs",
                                                    "definitions"};
const std::set<std::string_view> handled_keys = {
    "type",     "properties", "required",  "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "enum",      "const",                "anyOf", "oneOf",    "allOf",
    "$ref"};

[[noreturn]] void refuse(const std::string& path, const std::string& what) {
  throw tandem::error(error_kind::failed, fmt::format("json_schema at {}: {}", path.empty() ? "/" : path, what));
}

/// The rules every JSON grammar shares, made on first use.
class json_rules {
 public:
  explicit json_rules(grammar_builder& b) : b_(b) {}
  expr ws() {
    if (!ws_) {
      byte_set blank;
      blank.add(' ');
      blank.add('\t');
      ws_ = b_.add("ws", expr::alt({expr::literal(""), expr::literal(" "),
                                    expr::seq({expr::literal("\n"), expr::repeat(expr::bytes(blank), 0, 20)})}));
    }
    return expr::ref(*ws_);
  }
  expr ch() {
    if (!char_) {
      byte_set plain;
      plain.add_range(0x20, 0x7f);
      plain.w[0x22 >> 6] &= ~(uint64_t(1) << (0x22 & 63));  // '"'
      plain.w[0x5c >> 6] &= ~(uint64_t(1) << (0x5c & 63));  // '\\'
      byte_set esc;
      for (char c : std::string_view("\"\\/bfnrt")) esc.add(uint8_t(c));
      byte_set hex;
      hex.add_range('0', '9');
      hex.add_range('a', 'f');
      hex.add_range('A', 'F');
      auto cont = expr::range(0x80, 0xBF);
      // Well-formed UTF-8 only (no overlongs, surrogates or code points past U+10FFFF).
      char_ = b_.add(
          "char",
          expr::alt({expr::bytes(plain),
                     expr::seq({expr::byte('\\'), expr::alt({expr::bytes(esc),
                                                              expr::seq({expr::byte('u'), u_escape(hex)})})}),
                     expr::seq({expr::range(0xC2, 0xDF), cont}),
                     expr::seq({expr::byte(0xE0), expr::range(0xA0, 0xBF), cont}),
                     expr::seq({expr::range(0xE1, 0xEC), cont, cont}),
                     expr::seq({expr::byte(0xED), expr::range(0x80, 0x9F), cont}),
                     expr::seq({expr::range(0xEE, 0xEF), cont, cont}),
                     expr::seq({expr::byte(0xF0), expr::range(0x90, 0xBF), cont, cont}),
                     expr::seq({expr::range(0xF1, 0xF3), cont, cont, cont}),
                     expr::seq({expr::byte(0xF4), expr::range(0x80, 0x8F), cont, cont})}));
    }
    return expr::ref(*char_);
  }
  /// The 4 hex digits of a \u escape, surrogates excluded (JSON parsers differ on lone ones;
  /// characters past U+FFFF can be written as UTF-8).
  static expr u_escape(const byte_set& hex) {
    byte_set lead, low8, high;
    for (char c : std::string_view("0123456789abcABC")) lead.add(uint8_t(c));
    low8.add_range('0', '7');
    for (char c : std::string_view("efEF")) high.add(uint8_t(c));
    auto h = expr::bytes(hex);
    return expr::alt({expr::seq({expr::bytes(lead), h, h, h}), expr::seq({expr::range('d', 'd'), expr::bytes(low8), h, h}),
                      expr::seq({expr::range('D', 'D'), expr::bytes(low8), h, h}), expr::seq({expr::bytes(high), h, h, h})});
  }
  expr string() {
    if (!string_) string_ = b_.add("string", expr::seq({expr::byte('"'), expr::star(ch()), expr::byte('"')}));
    return expr::ref(*string_);
  }
  expr string_len(int32_t lo, int32_t hi) {
    return expr::seq({expr::byte('"'), expr::repeat(ch(), lo, hi), expr::byte('"')});
  }
  expr integer() {
    if (!integer_)
      integer_ = b_.add("integer", expr::seq({expr::opt(expr::byte('-')),
                                              expr::alt({expr::byte('0'), expr::seq({expr::range('1', '9'),
                                                                                     expr::repeat(expr::range('0', '9'), 0, 15)})})}));
    return expr::ref(*integer_);
  }
  /// At most 16 digits before the point and a 2-digit exponent: every number fits a double
  /// (strict parsers refuse 1e400).
  expr number() {
    if (!number_) {
      byte_set e;
      e.add('e');
      e.add('E');
      byte_set sign;
      sign.add('+');
      sign.add('-');
      auto digits = expr::repeat(expr::range('0', '9'), 1, 16);
      number_ = b_.add("number", expr::seq({integer(), expr::opt(expr::seq({expr::byte('.'), digits})),
                                            expr::opt(expr::seq({expr::bytes(e), expr::opt(expr::bytes(sign)),
                                                                 expr::repeat(expr::range('0', '9'), 1, 2)}))}));
    }
    return expr::ref(*number_);
  }
  /// Any JSON value (objects and arrays of any values).
  expr value() {
    if (!value_) {
      value_ = b_.declare("value");
      const uint32_t obj = b_.declare("object"), arr = b_.declare("array");
      object_ = obj;
      auto member = expr::seq({string(), ws(), expr::byte(':'), ws(), expr::ref(*value_), ws()});
      b_.define(obj, expr::seq({expr::byte('{'), ws(),
                                expr::opt(expr::seq({member, expr::star(expr::seq({expr::byte(','), ws(), member}))})),
                                expr::byte('}')}));
      auto item = expr::seq({expr::ref(*value_), ws()});
      b_.define(arr, expr::seq({expr::byte('['), ws(),
                                expr::opt(expr::seq({item, expr::star(expr::seq({expr::byte(','), ws(), item}))})),
                                expr::byte(']')}));
      b_.define(*value_, expr::alt({expr::ref(obj), expr::ref(arr), string(), number(), expr::literal("true"),
                                    expr::literal("false"), expr::literal("null")}));
    }
    return expr::ref(*value_);
  }
  expr object() {
    value();
    return expr::ref(*object_);
  }

 private:
  grammar_builder& b_;
  std::optional<uint32_t> ws_, char_, string_, integer_, number_, value_, object_;
};

class schema_compiler {
 public:
  schema_compiler(const json::value& root, const schema_limits& lim) : root_(root), lim_(lim), j_(b_) {}

  grammar run() {
    expr body = visit(root_, "");
    uint32_t r = b_.add("root", expr::seq({j_.ws(), body}));
    check_size();
    return b_.finish(r);
  }

 private:
  void check_size() {
    if (b_.n_elements() > lim_.max_elements)
      throw tandem::error(error_kind::failed, fmt::format("json_schema: the schema compiles to more than {} grammar "
                                                          "elements; simplify it",
                                                          lim_.max_elements));
  }

  int32_t bound(const json::value& s, std::string_view key, int32_t dflt, const std::string& path) {
    const json::value* v = s.find(key);
    if (!v) return dflt;
    if (v->k != K::number || v->s.find_first_of(".eE-") != std::string::npos || v->s.size() > 9)
      refuse(path, fmt::format("'{}' must be a non-negative integer", key));
    const int32_t n = std::stoi(v->s);
    if (n > lim_.max_repeat) refuse(path, fmt::format("'{}' = {} exceeds the supported {}", key, n, lim_.max_repeat));
    return n;
  }

  expr ref(const std::string& target, const std::string& path) {
    auto it = refs_.find(target);
    if (it != refs_.end()) return expr::ref(it->second);
    if (target.empty() || target[0] != '#') refuse(path, fmt::format("$ref '{}' is not local; only #/... is supported", target));
    const json::value* at = &root_;
    size_t i = 1;
    while (i < target.size()) {
      if (target[i] != '/') refuse(path, fmt::format("$ref '{}' is not a JSON pointer", target));
      size_t j = target.find('/', i + 1);
      if (j == std::string::npos) j = target.size();
      std::string key;
      for (size_t k = i + 1; k < j; ++k) {
        if (target[k] == '~' && k + 1 < j) key += target[++k] == '1' ? '/' : '~';
        else key += target[k];
      }
      at = at->k == K::object ? at->find(key) : nullptr;
      if (!at) refuse(path, fmt::format("$ref '{}' points to nothing", target));
      i = j;
    }
    const uint32_t r = b_.declare("ref" + std::to_string(refs_.size()));
    refs_.emplace(target, r);
    b_.define(r, visit(*at, target.substr(1)));
    return expr::ref(r);
  }

  expr visit(const json::value& s, const std::string& path) {
    check_size();
    if (s.k == K::boolean) {
      if (!s.b) refuse(path, "the schema 'false' matches nothing");
      return j_.value();
    }
    if (s.k != K::object) refuse(path, "a schema must be an object or a boolean");
    for (const auto& [key, v] : s.obj)
      if (!annotation_keys.count(key) && !handled_keys.count(key))
        refuse(path, fmt::format("keyword '{}' is not supported; remove it (Tandem supports type, properties, required, "
                                 "additionalProperties, items, minItems, maxItems, minLength, maxLength, enum, const, "
                                 "anyOf, oneOf, allOf of one schema and local $ref; docs/api.md)",
                                 key));
    if (const json::value* r = s.find("$ref")) {
      if (r->k != K::string) refuse(path, "'$ref' must be a string");
      return ref(r->s, path);
    }
    if (const json::value* c = s.find("const")) return expr::literal(c->dump());
    if (const json::value* e = s.find("enum")) {
      if (e->k != K::array || e->arr.empty()) refuse(path, "'enum' must be a non-empty array");
      std::vector<expr> alts;
      for (const auto& v : e->arr) alts.push_back(expr::literal(v.dump()));
      return expr::alt(std::move(alts));
    }
    for (std::string_view key : {"anyOf", "oneOf", "allOf"}) {
      const json::value* a = s.find(key);
      if (!a) continue;
      if (a->k != K::array || a->arr.empty()) refuse(path, fmt::format("'{}' must be a non-empty array", key));
      if (key == "allOf" && a->arr.size() != 1)
        refuse(path, "'allOf' with more than one schema is not supported; merge them into one schema");
      std::vector<expr> alts;
      for (size_t i = 0; i < a->arr.size(); ++i) alts.push_back(visit(a->arr[i], fmt::format("{}/{}/{}", path, key, i)));
      return expr::alt(std::move(alts));
    }
    const json::value* t = s.find("type");
    if (!t) {
      if (s.find("properties") || s.find("additionalProperties")) return object(s, path);
      if (s.find("items")) return array(s, path);
      return j_.value();
    }
    if (t->k == K::array) {
      std::vector<expr> alts;
      for (const auto& one : t->arr) {
        if (one.k != K::string) refuse(path, "'type' entries must be strings");
        alts.push_back(typed(s, one.s, path));
      }
      if (alts.empty()) refuse(path, "'type' must not be empty");
      return expr::alt(std::move(alts));
    }
    if (t->k != K::string) refuse(path, "'type' must be a string or an array of strings");
    return typed(s, t->s, path);
  }

  expr typed(const json::value& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      const int32_t lo = bound(s, "minLength", 0, path), hi = bound(s, "maxLength", -1, path);
      if (hi >= 0 && hi < lo) refuse(path, "maxLength is below minLength");
      if (lo == 0 && hi < 0) return j_.string();
      return j_.string_len(lo, hi);
    }
    if (type == "integer") return j_.integer();
    if (type == "number") return j_.number();
    if (type == "boolean") return expr::alt({expr::literal("true"), expr::literal("false")});
    if (type == "null") return expr::literal("null");
    if (type == "object") return object(s, path);
    if (type == "array") return array(s, path);
    refuse(path, fmt::format("type '{}' is not a JSON schema type", type));
  }

  expr array(const json::value& s, const std::string& path) {
    const json::value* it = s.find("items");
    expr item = it ? expr::ref(b_.add("item", visit(*it, path + "/items"))) : j_.value();
    const int32_t lo = bound(s, "minItems", 0, path), hi = bound(s, "maxItems", -1, path);
    if (hi >= 0 && hi < lo) refuse(path, "maxItems is below minItems");
    if (hi == 0) return expr::seq({expr::byte('['), j_.ws(), expr::byte(']')});
    auto one = expr::seq({item, j_.ws()});
    auto more = expr::repeat(expr::seq({expr::byte(','), j_.ws(), one}), lo > 0 ? lo - 1 : 0, hi < 0 ? -1 : hi - 1);
    auto items = expr::seq({one, more});
    return expr::seq({expr::byte('['), j_.ws(), lo > 0 ? items : expr::opt(items), expr::byte(']')});
  }

  expr object(const json::value& s, const std::string& path) {
    const json::value* props = s.find("properties");
    const json::value* addl = s.find("additionalProperties");
    if (props && props->k != K::object) refuse(path, "'properties' must be an object");
    std::set<std::string> required;
    if (const json::value* r = s.find("required")) {
      if (r->k != K::array) refuse(path, "'required' must be an array of names");
      for (const auto& n : r->arr) {
        if (n.k != K::string) refuse(path, "'required' must be an array of names");
        if (!props || !props->find(n.s))
          refuse(path, fmt::format("required property '{}' is not in 'properties'; add it there", n.s));
        required.insert(n.s);
      }
    }
    if (!props || props->obj.empty()) {
      if (addl && addl->k == K::object) {
        // A map: string keys, values of the additionalProperties schema.
        expr val = expr::ref(b_.add("mapval", visit(*addl, path + "/additionalProperties")));
        auto member = expr::seq({j_.string(), j_.ws(), expr::byte(':'), j_.ws(), val, j_.ws()});
        return expr::seq({expr::byte('{'), j_.ws(),
                          expr::opt(expr::seq({member, expr::star(expr::seq({expr::byte(','), j_.ws(), member}))})),
                          expr::byte('}')});
      }
      if (addl && addl->k == K::boolean && !addl->b) return expr::seq({expr::byte('{'), j_.ws(), expr::byte('}')});
      return j_.object();
    }
    // kv_i ::= "name" ws ":" ws value_i ws; tail_i ::= ("," ws kv_i)[?] tail_{i+1}.
    const size_t n = props->obj.size();
    std::vector<expr> kv;
    std::vector<bool> req;
    for (const auto& [name, sub] : props->obj) {
      expr val = expr::ref(b_.add("prop", visit(sub, path + "/properties/" + name)));
      const std::string key = json::quote(name, /*escape_del=*/false);
      kv.push_back(expr::ref(
          b_.add("kv", expr::seq({expr::literal(key), j_.ws(), expr::byte(':'), j_.ws(), val, j_.ws()}))));
      req.push_back(required.count(name) > 0);
    }
    std::vector<uint32_t> tail(n + 1);
    tail[n] = b_.add("tail", expr::literal(""));
    for (size_t i = n; i-- > 0;) {
      auto sep = expr::seq({expr::byte(','), j_.ws(), kv[i]});
      tail[i] = b_.add("tail", expr::seq({req[i] ? sep : expr::opt(sep), expr::ref(tail[i + 1])}));
    }
    // The first property written is any one up to the first required one.
    std::vector<expr> firsts;
    bool all_optional = true;
    for (size_t i = 0; i < n; ++i) {
      firsts.push_back(expr::seq({kv[i], expr::ref(tail[i + 1])}));
      if (req[i]) {
        all_optional = false;
        break;
      }
    }
    if (all_optional) firsts.push_back(expr::literal(""));
    return expr::seq({expr::byte('{'), j_.ws(), expr::alt(std::move(firsts)), expr::byte('}')});
  }

  const json::value& root_;
  schema_limits lim_;
  grammar_builder b_;
  json_rules j_;
  std::map<std::string, uint32_t> refs_;
};

}  // namespace

grammar compile_json_schema(std::string_view schema_text, const schema_limits& lim) {
  json::value root;
  try {
    root = json::parse(schema_text);
  } catch (const json::parse_error& e) {
    throw tandem::error(error_kind::failed, fmt::format("json_schema is not valid JSON: {}", e.what()));
  }
  return schema_compiler(root, lim).run();
}

grammar json_object_grammar() {
  grammar_builder b;
  json_rules j(b);
  uint32_t r = b.add("root", expr::seq({j.ws(), j.object()}));
  return b.finish(r);
}

grammar compile_grammar(const grammar_spec& spec, const schema_limits& lim) {
  switch (spec.kind) {
    case grammar_kind::json_object:
      return json_object_grammar();
    case grammar_kind::json_schema:
      return compile_json_schema(spec.source, lim);
    case grammar_kind::none:
      break;
  }
  throw tandem::error(error_kind::failed, fmt::format("compile_grammar: grammar kind {} is not json_object (1) or "
                                                      "json_schema (2); is this node older than the sender?",
                                                      int(spec.kind)));
}

}  // namespace tandem::grammar
