#pragma once
/// A small JSON document model for the schema compiler (kernels may not use transport's JSON
/// parser). Numbers keep their source text, so an enum/const value is emitted as written.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::grammar {

struct json_member;

struct json_doc {
  enum class kind : uint8_t { null, boolean, number, string, array, object };
  kind k = kind::null;
  bool b = false;
  std::string s;  ///< string value, or a number's source text
  std::vector<json_doc> arr;
  /// In document order. (A struct, not std::pair: a pair of the incomplete json_doc does not
  /// compile with clang and libstdc++.)
  std::vector<json_member> obj;
  const json_doc* find(std::string_view key) const;
  /// Compact JSON text (strings escaped as JSON requires).
  std::string dump() const;
  /// Throws tandem::error naming the offset on bad input; nesting bounded by `max_depth`.
  static json_doc parse(std::string_view text, int max_depth = 64);
};

struct json_member {
  json_member(std::string k, json_doc v) : first(std::move(k)), second(std::move(v)) {}
  std::string first;
  json_doc second;
};

/// `s` as a JSON string literal, quotes included.
std::string json_quote(std::string_view s);

}  // namespace tandem::grammar
