#include "transport/http/request_params.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

namespace tandem::transport {
namespace {

enum route_mask : uint8_t { completions = 1, chat_route = 2, both = 3 };

struct field_rule {
  std::string_view name;
  uint8_t routes;
  field_policy policy;
  std::string_view neutral;  ///< what to send instead, for refused fields ("" = remove it)
};

// One table so that honouring a parameter later is a one-line change here (plus docs/api.md).
constexpr field_rule rules[] = {
    // honoured
    {"model", both, field_policy::honoured, ""},
    {"max_tokens", both, field_policy::honoured, ""},
    {"max_completion_tokens", both, field_policy::honoured, ""},
    {"temperature", both, field_policy::honoured, ""},
    {"top_p", both, field_policy::honoured, ""},
    {"top_k", both, field_policy::honoured, ""},
    {"seed", both, field_policy::honoured, ""},
    {"stop", both, field_policy::honoured, ""},
    {"stream", both, field_policy::honoured, ""},
    {"stream_options", both, field_policy::honoured, ""},
    {"ignore_eos", both, field_policy::honoured, ""},
    {"n", both, field_policy::honoured, ""},  // 1 to limits.max_choices: checked where parsed
    {"prompt", completions, field_policy::honoured, ""},
    {"messages", chat_route, field_policy::honoured, ""},
    {"response_format", both, field_policy::honoured, ""},  // transport/http/response_format.h
    {"json_schema", completions, field_policy::honoured, ""},  // llama-server's
    // advisory: bookkeeping for OpenAI's own platform, meaningless to a self-hosted server
    {"user", both, field_policy::advisory, ""},
    {"metadata", both, field_policy::advisory, ""},
    {"store", both, field_policy::advisory, ""},
    {"service_tier", both, field_policy::advisory, ""},
    {"prompt_cache_key", both, field_policy::advisory, ""},
    {"safety_identifier", both, field_policy::advisory, ""},
    // refused (not honoured yet)
    {"logprobs", both, field_policy::honoured, ""},
    {"top_logprobs", chat_route, field_policy::honoured, ""},
    {"presence_penalty", both, field_policy::honoured, ""},
    {"frequency_penalty", both, field_policy::honoured, ""},
    {"repetition_penalty", both, field_policy::honoured, ""},
    {"min_p", both, field_policy::honoured, ""},
    {"logit_bias", both, field_policy::honoured, ""},
    {"best_of", completions, field_policy::refused, "1"},
    {"echo", completions, field_policy::honoured, ""},
    {"suffix", completions, field_policy::honoured, ""},  // needs a model with FIM tokens: checked where parsed
    // Chat: rendered by the model's chat template (transport/chat); a model without one refuses
    // them there, naming --chat-template-file. The reply's calls are parsed (transport/chat/tool_call_parser.h).
    {"tools", chat_route, field_policy::honoured, ""},
    {"tools", completions, field_policy::refused, "[]"},
    {"tool_choice", chat_route, field_policy::honoured, ""},  // transport/http/tool_choice.h
    {"tool_choice", completions, field_policy::refused, "\"none\""},
    {"parallel_tool_calls", both, field_policy::refused, ""},
    {"functions", chat_route, field_policy::refused, "[]"},
    {"function_call", chat_route, field_policy::refused, "\"none\""},
    {"prediction", chat_route, field_policy::refused, ""},
    {"audio", chat_route, field_policy::refused, ""},
    {"modalities", chat_route, field_policy::refused, "[\"text\"]"},
    {"reasoning_effort", chat_route, field_policy::refused, ""},
    {"web_search_options", chat_route, field_policy::refused, ""},
    {"verbosity", chat_route, field_policy::refused, ""},
};

const field_rule* find_rule(std::string_view name, bool chat) {
  const uint8_t route = chat ? chat_route : completions;
  for (const auto& r : rules)
    if (r.name == name && (r.routes & route)) return &r;
  return nullptr;
}

bool number_is(const json::value& v, double x) { return v.k == json::kind::number && v.num == x; }

}  // namespace

field_policy classify_field(std::string_view name, bool chat) {
  const field_rule* r = find_rule(name, chat);
  return r ? r->policy : field_policy::unknown;
}

bool is_neutral_value(std::string_view name, const json::value& v) {
  if (v.k == json::kind::null) return true;  // null means "absent" throughout the API
  if (name == "presence_penalty" || name == "frequency_penalty" || name == "min_p" || name == "top_logprobs")
    return number_is(v, 0);
  if (name == "repetition_penalty" || name == "best_of") return number_is(v, 1);
  if (name == "logprobs" || name == "echo") return v.k == json::kind::boolean && !v.b;
  if (name == "logit_bias") return v.k == json::kind::object && v.obj.empty();
  if (name == "tools" || name == "functions") return v.k == json::kind::array && v.arr.empty();
  if (name == "tool_choice" || name == "function_call")
    return v.k == json::kind::string && (v.s == "none" || v.s == "auto");  // without tools both mean plain text
  if (name == "parallel_tool_calls") return v.k == json::kind::boolean;  // meaningless without tools
  if (name == "response_format") {
    auto* t = v.find("type");
    return v.k == json::kind::object && v.obj.size() == 1 && t && t->k == json::kind::string && t->s == "text";
  }
  if (name == "modalities")
    return v.k == json::kind::array && v.arr.size() == 1 && v.arr[0].k == json::kind::string && v.arr[0].s == "text";
  return false;
}

std::optional<param_error> check_fields(const json::value& body, bool chat) {
  const std::string_view route = chat ? "/v1/chat/completions" : "/v1/completions";
  for (const auto& m : body.obj) {
    const field_rule* r = find_rule(m.first, chat);
    if (!r)
      return param_error{m.first, fmt::format("'{}' is not a parameter of {} in Tandem; remove it (docs/api.md lists "
                                              "every parameter)", m.first, route)};
    if (r->policy != field_policy::refused || is_neutral_value(m.first, m.second)) continue;
    std::string instead = r->neutral.empty() ? "remove it" : fmt::format("remove it or send {}", r->neutral);
    return param_error{m.first, fmt::format("'{}' is not supported by Tandem on {}; {} (docs/api.md lists every "
                                            "parameter)", m.first, route, instead)};
  }
  return std::nullopt;
}

std::optional<field_error> parse_sampling_extras(const json::value& body, sampling_params& s, int32_t n_vocab) {
  auto number = [&](std::string_view name, float lo, float hi, bool lo_open, std::string_view off,
                    float& out) -> std::optional<field_error> {
    const json::value* v = body.find(name);
    if (!v || v->k == json::kind::null) return std::nullopt;
    if (v->k != json::kind::number)
      return field_error{400, std::string(name), fmt::format("'{}' must be a number, got {}", name, json::kind_name(v->k)),
                         "invalid_type"};
    const double x = v->num;
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
      return field_error{422, std::string(name),
                         fmt::format("{} = {} is out of range; use a value in {}{}, {}] ({} = off)", name, x,
                                     lo_open ? "(" : "[", lo, hi, off),
                         "invalid_value"};
    out = static_cast<float>(x);
    return std::nullopt;
  };
  if (auto e = number("presence_penalty", -2, 2, false, "0", s.presence_penalty)) return e;
  if (auto e = number("frequency_penalty", -2, 2, false, "0", s.frequency_penalty)) return e;
  if (auto e = number("repetition_penalty", 0, 2, true, "1", s.repetition_penalty)) return e;
  if (auto e = number("min_p", 0, 1, false, "0", s.min_p)) return e;
  const json::value* lb = body.find("logit_bias");
  if (!lb || lb->k == json::kind::null) return std::nullopt;
  if (lb->k != json::kind::object)
    return field_error{400, "logit_bias", fmt::format("'logit_bias' must be an object of token id -> bias, got {}",
                                                      json::kind_name(lb->k)), "invalid_type"};
  if (lb->obj.size() > max_logit_bias_entries)
    return field_error{422, "logit_bias", fmt::format("logit_bias has {} entries; at most {} are allowed",
                                                      lb->obj.size(), max_logit_bias_entries), "invalid_value"};
  for (const auto& m : lb->obj) {
    // Keys are decimal token ids ("50256"), as OpenAI's.
    int64_t id = -1;
    if (!m.first.empty() && m.first.size() <= 10 &&
        std::all_of(m.first.begin(), m.first.end(), [](char c) { return c >= '0' && c <= '9'; }))
      id = std::stoll(m.first);
    if (id < 0 || id >= n_vocab)
      return field_error{422, "logit_bias", fmt::format("logit_bias key '{}' is not a token id; ids are 0 to {}",
                                                        m.first, n_vocab - 1), "invalid_value"};
    if (m.second.k != json::kind::number)
      return field_error{400, "logit_bias", fmt::format("logit_bias['{}'] must be a number, got {}", m.first,
                                                        json::kind_name(m.second.k)), "invalid_type"};
    if (!(m.second.num >= -100 && m.second.num <= 100))
      return field_error{422, "logit_bias", fmt::format("logit_bias['{}'] = {} is out of range; use a value in [-100, 100]",
                                                        m.first, m.second.num), "invalid_value"};
    s.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(m.second.num));
  }
  return std::nullopt;
}

int32_t default_max_tokens(size_t prompt_tokens, int32_t max_context, const limits& lim) {
  const int64_t left = static_cast<int64_t>(max_context) - static_cast<int64_t>(prompt_tokens);
  return static_cast<int32_t>(std::clamp<int64_t>(left, 1, lim.max_new_tokens));
}

}  // namespace tandem::transport
