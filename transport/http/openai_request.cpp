#include "transport/http/openai_request.h"

#include <algorithm>
#include <climits>

#include <fmt/format.h>

#include "transport/http/openai_errors.h"

namespace tandem::openai {

const json::value* field(const json::value& o, std::string_view k) {
  auto* v = o.find(k);
  return (v && v->k == json::kind::null) ? nullptr : v;
}

[[noreturn]] void wrong_type(std::string_view name, std::string_view want, const json::value& v) {
  throw bad_request(fmt::format("'{}' must be {}, got {}", name, want, json::kind_name(v.k)), std::string(name),
                    "invalid_type");
}

std::optional<double> get_number(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k != json::kind::number) wrong_type(k, "a number", *v);
  return v->num;
}

std::optional<int64_t> get_int(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k == json::kind::number && !v->is_int)
    throw bad_request(fmt::format("'{}' must be an integer, got {}", k, v->num), std::string(k), "invalid_type");
  if (v->k != json::kind::number) wrong_type(k, "an integer", *v);
  return v->i;
}

std::optional<bool> get_bool(const json::value& o, std::string_view k) {
  auto* v = field(o, k);
  if (!v) return std::nullopt;
  if (v->k != json::kind::boolean) wrong_type(k, "a boolean", *v);
  return v->b;
}

int32_t clamp_i32(int64_t v) { return static_cast<int32_t>(std::clamp<int64_t>(v, INT32_MIN, INT32_MAX)); }

void parse_common(const json::value& body, parsed_request& r, bool chat) {
  if (auto t = get_number(body, "temperature")) r.gen.sampling.temperature = static_cast<float>(*t);
  if (auto t = get_number(body, "top_p")) r.gen.sampling.top_p = static_cast<float>(*t);
  if (auto t = get_int(body, "top_k")) {
    // OpenAI-style clients send -1 for "off".
    r.gen.sampling.top_k = *t == -1 ? 0 : clamp_i32(*t);
  }
  if (auto t = get_int(body, "seed")) r.gen.sampling.seed = static_cast<uint64_t>(*t);
  // max_completion_tokens is OpenAI's newer name for max_tokens; both routes take either.
  std::optional<int64_t> mt = get_int(body, "max_tokens");
  if (auto mct = get_int(body, "max_completion_tokens")) {
    if (mt && *mt != *mct)
      throw http_error{422, fmt::format("max_tokens = {} and max_completion_tokens = {} disagree; send one of them", *mt, *mct),
                       "invalid_request_error", "max_completion_tokens", "invalid_value", std::nullopt};
    mt = mct;
  }
  if (mt) r.gen.max_tokens = clamp_i32(*mt), r.max_tokens_set = true;
  if (auto* s = field(body, "stop")) {
    if (s->k == json::kind::string) {
      r.gen.stop.push_back(s->s);
    } else if (s->k == json::kind::array) {
      for (auto& e : s->arr) {
        if (e.k != json::kind::string) wrong_type("stop", "a string or a list of strings", e);
        r.gen.stop.push_back(e.s);
      }
    } else {
      wrong_type("stop", "a string or a list of strings", *s);
    }
  }
  if (auto b = get_bool(body, "stream")) r.stream = *b;
  if (auto* so = field(body, "stream_options")) {
    if (so->k != json::kind::object) wrong_type("stream_options", "an object", *so);
    if (auto b = get_bool(*so, "include_usage")) r.include_usage = *b;
  }
  if (auto b = get_bool(body, "ignore_eos")) r.gen.ignore_eos = *b;
  if (auto* m = field(body, "model"); m && m->k != json::kind::string) wrong_type("model", "a string", *m);
}

}  // namespace tandem::openai
