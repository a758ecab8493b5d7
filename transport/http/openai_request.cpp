#include "transport/http/openai_request.h"

#include <algorithm>
#include <climits>

#include <fmt/format.h>

#include "kernels/model/logprobs.h"
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

void parse_output_options(const json::value& body, parsed_request& r, bool chat) {
  auto invalid = [](std::string_view param, std::string msg) {
    return http_error{422, std::move(msg), "invalid_request_error", std::string(param), "invalid_value", std::nullopt};
  };
  auto top_count = [&](std::string_view name) -> int32_t {
    const int64_t n = *get_int(body, name);
    if (n < 0 || n > max_top_logprobs)
      throw invalid(name, fmt::format("{} = {} is out of range; use 0 to {}", name, n, max_top_logprobs));
    return static_cast<int32_t>(n);
  };
  if (chat) {
    const bool want = get_bool(body, "logprobs").value_or(false);
    const auto* top = field(body, "top_logprobs");
    const int32_t n = top ? top_count("top_logprobs") : 0;
    if (n > 0 && !want)
      throw invalid("top_logprobs", fmt::format("top_logprobs = {} needs logprobs: true; send both", n));
    if (want) r.logprobs = n;
    // Tool calls are parsed from the reply when tools are offered and not switched off.
    const auto* tools = field(body, "tools");
    const auto* choice = field(body, "tool_choice");
    const bool none = choice && choice->k == json::kind::string && choice->s == "none";
    r.parse_tools = tools && tools->k == json::kind::array && !tools->arr.empty() && !none;
    return;
  }
  if (const auto* lp = field(body, "logprobs")) {
    // Some clients send a boolean; true is the chosen token's log-probability alone.
    if (lp->k == json::kind::boolean) r.logprobs = lp->b ? 0 : -1;
    else r.logprobs = top_count("logprobs");
  }
  r.echo = get_bool(body, "echo").value_or(false);
  if (r.echo && r.logprobs >= 0)
    throw invalid("echo", "echo with logprobs would need the prompt's log-probabilities, which Tandem does not "
                          "compute; send echo without logprobs, or logprobs without echo");
}

}  // namespace tandem::openai
