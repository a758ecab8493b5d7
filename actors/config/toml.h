#pragma once
/// TOML 1.0 as Debian's toml++ reads it, converted to a tree that keeps each key's and value's
/// line and column (for the checker's messages) and each table's keys in file order. Dates
/// and times, which no config key takes, are refused at their position. Syntax errors are
/// parse_error "<source>:<line>:<column>: <why>".
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/base/error.h"

namespace tandem::toml {

/// 1-based line and column of a value or key in the source text.
struct position {
  int32_t line = 0;
  int32_t column = 0;
};

enum class value_type : uint8_t { string, integer, floating, boolean, array, table };

/// "string", "integer", "float", "boolean", "array", "table".
const char* type_name(value_type t);

struct table_entry;

/// One parsed value. Tables keep their keys in file order.
struct value {
  value_type type = value_type::table;
  position pos;
  std::string str;
  int64_t integer = 0;
  double floating = 0;
  bool boolean = false;
  std::vector<value> items;          ///< array items
  std::vector<table_entry> entries;  ///< table entries, in file order
  /// True for tables that are elements of an array of tables (`[[name]]`).
  bool from_array_of_tables = false;

  /// Entry `key` of a table; nullptr if absent (or if this is not a table).
  const value* find(std::string_view key) const;
  /// The value as TOML source text, for error messages ("\"abc\"", "12", "[1, 2]").
  std::string to_source() const;
};

struct table_entry {
  std::string key;
  position key_pos;
  value val;
};

/// A syntax error; what() is "<source>:<line>:<column>: <why>".
class parse_error : public tandem::error {
 public:
  parse_error(const std::string& source, position pos, const std::string& why);
  position pos() const { return pos_; }

 private:
  position pos_;
};

/// Parses a whole document into its root table. Throws parse_error.
value parse(std::string_view text, const std::string& source_name = "<config>");

}  // namespace tandem::toml
