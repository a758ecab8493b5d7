#pragma once
/// `response_format` (both routes: {"type": "text" | "json_object" | "json_schema",
/// "json_schema": {"name", "schema", "strict", "description"}}; json_object with a "schema"
/// member as vLLM/llama-server take it) and llama-server's top-level `json_schema` on
/// /v1/completions, read into the request's grammar_spec. The schema is compiled here once so a
/// keyword the compiler does not support is a 422 naming it before anything is queued.
#include <optional>

#include "actors/common/limits.h"
#include "kernels/grammar/grammar_spec.h"
#include "transport/http/json.h"
#include "transport/http/request_params.h"

namespace tandem::transport {

/// Fills `out` (left as none for text or when absent); an error names `response_format` (or
/// `json_schema`) with 400 for a wrong JSON type and 422 for an unsupported or too large schema.
std::optional<field_error> parse_response_format(const json::value& body, bool chat, grammar_spec& out,
                                                 const limits& lim);

/// `v` as compact JSON text.
std::string to_json_text(const json::value& v);

}  // namespace tandem::transport
