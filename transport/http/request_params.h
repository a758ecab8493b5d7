#pragma once
/// Which top-level fields the OpenAI routes honour, ignore by design or refuse, so that no
/// parameter a client sends is silently dropped; and the defaults that depend on the prompt.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "actors/common/limits.h"
#include "transport/http/generation.h"
#include "transport/http/json.h"

namespace tandem::transport {

/// How the HTTP front end treats one top-level request field.
enum class field_policy {
  honoured,  ///< parsed and acted on
  advisory,  ///< accepted and ignored by design (documented in docs/api.md)
  refused,   ///< a known OpenAI parameter Tandem does not honour: 422 unless at its neutral value
  unknown,   ///< not an OpenAI parameter of this route: 422
};

/// The policy for field `name` on the chat (`chat`) or the completions route.
field_policy classify_field(std::string_view name, bool chat);

/// True when `v` is the value that asks for nothing (e.g. `presence_penalty: 0`, `echo: false`,
/// `logit_bias: {}`): clients such as LangChain send those by default, so they are accepted.
bool is_neutral_value(std::string_view name, const json::value& v);

/// The first field of `body` that is refused or unknown (its value not neutral), as a 422
/// naming it; nullopt when every field is honoured or advisory.
std::optional<param_error> check_fields(const json::value& body, bool chat);

/// A request field with the wrong JSON type (400, invalid_type) or out of range (422, invalid_value).
struct field_error {
  unsigned status;
  std::string param;
  std::string message;
  std::string code;
};

/// Reads presence_penalty, frequency_penalty, repetition_penalty, min_p and logit_bias into
/// `s`, checking types, ranges and (logit_bias) token ids against the vocabulary of `n_vocab`.
std::optional<field_error> parse_sampling_extras(const json::value& body, sampling_params& s, int32_t n_vocab);

/// max_tokens when the request sends none: what is left of the context after the prompt,
/// bounded by limits.max_new_tokens (as vLLM). At least 1, so an over-long prompt still gets
/// check_params' message naming the context.
int32_t default_max_tokens(size_t prompt_tokens, int32_t max_context, const limits& lim);

}  // namespace tandem::transport
