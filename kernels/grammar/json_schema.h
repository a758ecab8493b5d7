#pragma once
/// JSON schema -> grammar, and the generic JSON grammars.
///
/// This is the one call for "constrain the output to this JSON schema": response_format
/// json_schema sends the schema itself; tool calling with tool_choice "required" or a named
/// function sends the schema of the call, e.g.
///   {"type":"object","properties":{"name":{"const":"get_weather"},"arguments":<parameters>},
///    "required":["name","arguments"],"additionalProperties":false}
/// (an anyOf of those for "required" with several tools) as a grammar_spec of kind
/// json_schema; the worker compiles it with `compile_grammar` and masks every step.
///
/// Supported: type (string, number, integer, boolean, null, object, array, or a list of them),
/// properties/required (emitted in schema order; properties outside `required` optional),
/// additionalProperties (false, or a schema for map-like objects without properties; other
/// properties are never generated, which the schema allows either way), items, minItems,
/// maxItems, minLength, maxLength, enum, const, anyOf, oneOf (as anyOf), allOf of one schema,
/// $ref to #/$defs/..., #/definitions/... or # (recursion allowed), and the annotations
/// title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
/// writeOnly, strict. Any other keyword (pattern, format, minimum, ...) is refused with an
/// error naming it and where it is. Whitespace between tokens is bounded (at most a newline
/// and 20 spaces/tabs) so a sampler cannot wander in it; numbers have at most 16 integer digits
/// and a 2-digit exponent (every one fits a double).
#include <string_view>

#include "kernels/grammar/grammar.h"
#include "kernels/grammar/grammar_spec.h"

namespace tandem::grammar {

struct schema_limits {
  size_t max_elements = size_t(1) << 17;  ///< grammar size after lowering
  int32_t max_repeat = 1000;              ///< bound on minLength/maxLength/minItems/maxItems
};

/// Throws tandem::error (error_kind::failed) whose message names the bad keyword and its path.
grammar compile_json_schema(std::string_view schema_text, const schema_limits& lim = {});
/// Any JSON object, optionally after whitespace (response_format json_object).
grammar json_object_grammar();
/// Compiles a request's spec (kind none is an error).
grammar compile_grammar(const grammar_spec& spec, const schema_limits& lim = {});

}  // namespace tandem::grammar
