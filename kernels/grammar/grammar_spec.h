#pragma once
/// What a request asks its output to match, as it travels with the sampling parameters
/// (SamplingParams.grammar on the wire); each worker compiles it (kernels/grammar/json_schema.h).
#include <cstdint>
#include <string>

namespace tandem {

enum class grammar_kind : uint8_t {
  none = 0,
  json_object = 1,  ///< any JSON object (response_format json_object)
  json_schema = 2,  ///< `source` is a JSON schema (response_format json_schema, tool calls)
};

struct grammar_spec {
  grammar_kind kind = grammar_kind::none;
  std::string source;  ///< the schema text for json_schema; empty otherwise
  bool active() const { return kind != grammar_kind::none; }
  bool operator==(const grammar_spec&) const = default;
};

}  // namespace tandem
