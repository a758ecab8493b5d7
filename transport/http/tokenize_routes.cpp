#include "transport/http/tokenize_routes.h"

#include <fmt/format.h>

#include "kernels/tokenizer/tokenizer.h"
#include "transport/http/json.h"

namespace tandem::transport {

namespace {

json::value parse_object(std::string_view body) {
  json::value v;
  try {
    v = json::parse(body);
  } catch (const json::parse_error& e) {
    throw tokenize_error{fmt::format("the request body is not valid JSON: {}", e.what()), "", "invalid_json"};
  }
  if (v.k != json::kind::object)
    throw tokenize_error{fmt::format("the request body must be a JSON object, got {}", json::kind_name(v.k)), "",
                         "invalid_type"};
  return v;
}

bool get_bool(const json::value& o, std::string_view name, bool def) {
  const json::value* v = o.find(name);
  if (v == nullptr || v->k == json::kind::null) return def;
  if (v->k != json::kind::boolean)
    throw tokenize_error{fmt::format("'{}' must be a boolean, got {}", name, json::kind_name(v->k)), std::string(name),
                         "invalid_type"};
  return v->b;
}

/// Replaces each invalid UTF-8 sequence with U+FFFD (one per byte that starts no valid one).
std::string sanitize(std::string_view s) {
  if (json::valid_utf8(s)) return std::string(s);
  std::string out;
  for (size_t i = 0; i < s.size();) {
    size_t n = 1;
    for (size_t k = 4; k >= 1; --k)
      if (i + k <= s.size() && json::valid_utf8(s.substr(i, k))) {
        n = k;
        break;
      }
    if (n == 1 && static_cast<unsigned char>(s[i]) >= 0x80) out += "\xEF\xBF\xBD";
    else out.append(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

std::string tokenize_response(const tokenizer& tok, std::string_view body) {
  const json::value o = parse_object(body);
  const json::value* c = o.find("content");
  if (c == nullptr || c->k == json::kind::null)
    throw tokenize_error{"'content' is required: send {\"content\": \"text to tokenize\"}", "content", "missing_field"};
  if (c->k != json::kind::string)
    throw tokenize_error{fmt::format("'content' must be a string, got {}", json::kind_name(c->k)), "content",
                         "invalid_type"};
  const bool add_special = get_bool(o, "add_special", false);
  const bool parse_special = get_bool(o, "parse_special", true);
  const bool with_pieces = get_bool(o, "with_pieces", false);
  const auto ids = tok.encode(c->s, add_special, parse_special);
  json::writer w;
  w.begin_object().key("tokens").begin_array();
  for (int32_t id : ids) {
    if (!with_pieces) {
      w.num(id);
      continue;
    }
    w.begin_object().key("id").num(id).key("piece");
    const std::string piece = tok.token_text(id);
    if (json::valid_utf8(piece)) {
      w.str(piece);
    } else {
      // Part of a character: the bytes, as llama-server does.
      w.begin_array();
      for (unsigned char b : piece) w.num(b);
      w.end_array();
    }
    w.end_object();
  }
  w.end_array().end_object();
  return w.take();
}

std::string detokenize_response(const tokenizer& tok, std::string_view body) {
  const json::value o = parse_object(body);
  const json::value* t = o.find("tokens");
  if (t == nullptr || t->k == json::kind::null)
    throw tokenize_error{"'tokens' is required: send {\"tokens\": [token ids]}", "tokens", "missing_field"};
  if (t->k != json::kind::array)
    throw tokenize_error{fmt::format("'tokens' must be an array of token ids, got {}", json::kind_name(t->k)), "tokens",
                         "invalid_type"};
  std::string bytes;
  for (const json::value& e : t->arr) {
    if (e.k != json::kind::number || !e.is_int)
      throw tokenize_error{fmt::format("'tokens' must hold integer token ids, got {}", json::kind_name(e.k)), "tokens",
                           "invalid_type"};
    if (e.i < 0 || e.i >= tok.n_vocab())
      throw tokenize_error{fmt::format("token id {} is out of range; ids are 0 to {}", e.i, tok.n_vocab() - 1), "tokens",
                           "invalid_value"};
    bytes += tok.token_text(static_cast<int32_t>(e.i));
  }
  json::writer w;
  w.begin_object().key("content").str(sanitize(bytes)).end_object();
  return w.take();
}

}  // namespace tandem::transport
