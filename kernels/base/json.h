#pragma once
/// The one strict JSON reader and writer: the HTTP front end's request bodies, the grammar
/// compiler's JSON schemas and the chat templates' JSON values all go through it. Strict on
/// purpose: the request bodies are untrusted, so the parser rejects invalid UTF-8, lone
/// surrogates, control characters in strings, duplicate keys, trailing garbage and nesting
/// deeper than a bound, and it keeps integers exact (token ids, seeds) instead of going through
/// double. It lives in kernels/base because kernels/ may not include transport/.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::json {

/// Thrown by parse(); `what()` says what is wrong and at which byte offset.
class parse_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class kind : uint8_t { null, boolean, number, string, array, object };

/// Lower-case JSON type name ("string", "number", ...) for error messages.
std::string_view kind_name(kind k);

struct member;

struct value {
  kind k = kind::null;
  bool b = false;
  double num = 0;
  bool is_int = false;  ///< number written without fraction/exponent that fits int64
  int64_t i = 0;        ///< valid iff is_int
  /// A string's value, or a number's source text as written (so a schema's enum/const value
  /// is emitted unchanged); empty for the other kinds.
  std::string s;
  std::vector<value> arr;
  /// In document order; duplicates rejected. (A struct, not std::pair: a pair of the
  /// incomplete `value` does not compile with clang and libstdc++.)
  std::vector<member> obj;

  /// Member of an object, or nullptr (also when this is not an object).
  const value* find(std::string_view key) const;
  /// Compact JSON text: numbers as written in the source, strings as json.dumps writes them
  /// (append_quoted with DEL left raw).
  std::string dump() const;
};

struct member {
  member(std::string k, value v) : first(std::move(k)), second(std::move(v)) {}
  std::string first;
  value second;
};

/// Parses one JSON document. Throws parse_error.
value parse(std::string_view text, int max_depth = 64);

/// True if `s` is valid UTF-8 (no overlongs, no surrogates, <= U+10FFFF).
bool valid_utf8(std::string_view s);

/// Appends `s` as a JSON string literal, quotes included: `"`, `\\` and the control characters
/// escaped (\n \r \t \b \f by name, the others as \u00XX). `escape_del` also writes DEL
/// (0x7f) as \u007f, as the HTTP front end's writer always has; Python's json.dumps leaves it
/// raw, so the chat templates' `tojson` passes false to match jinja2, and so does dump() (the
/// grammar compiler's literals).
void append_quoted(std::string& out, std::string_view s, bool escape_del = true);

/// `s` as a JSON string literal, quotes included (see append_quoted).
std::string quote(std::string_view s, bool escape_del = true);

/// Builds JSON text; the caller is responsible for calling in a valid order.
class writer {
 public:
  writer& begin_object();
  writer& end_object();
  writer& begin_array();
  writer& end_array();
  writer& key(std::string_view k);
  writer& str(std::string_view v);
  writer& num(int64_t v);
  writer& real(double v);
  writer& boolean(bool v);
  writer& null();
  /// Inserts already-encoded JSON as one value.
  writer& raw(std::string_view json);
  const std::string& text() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void sep();
  std::string out_;
  bool need_comma_ = false;
};

}  // namespace tandem::json
