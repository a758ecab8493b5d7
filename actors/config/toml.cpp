// TOML through Debian's toml++ (libtomlplusplus-dev, TOML 1.0): this file converts its tree into
// tandem::toml::value, which keeps every key and value's line:column for the config checker's
// messages and the keys of each table in file order (toml++ keeps them sorted).
#include "actors/config/toml.h"

#define TOML_EXCEPTIONS 1
#define TOML_ENABLE_FORMATTERS 0
#include <toml++/toml.h>

#include <algorithm>

#include <fmt/format.h>

namespace tandem::toml {

const char* type_name(value_type t) {
  switch (t) {
    case value_type::string: return "string";
    case value_type::integer: return "integer";
    case value_type::floating: return "float";
    case value_type::boolean: return "boolean";
    case value_type::array: return "array";
    case value_type::table: return "table";
  }
  return "value";
}

const value* value::find(std::string_view key) const {
  if (type != value_type::table) return nullptr;
  for (const auto& e : entries)
    if (e.key == key) return &e.val;
  return nullptr;
}

namespace {

std::string quote(const std::string& s) {
  std::string r = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    if (c == '\n') {
      r += "\\n";
      continue;
    }
    r += c;
  }
  return r + "\"";
}

position at(const ::toml::source_region& r) { return {int32_t(r.begin.line), int32_t(r.begin.column)}; }

bool before(const position& a, const position& b) {
  return a.line != b.line ? a.line < b.line : a.column < b.column;
}

/// The converter: every node toml++ can hold, refusing what a config has no use for (dates and
/// times) at its position, so no value is silently read as something else.
class converter {
 public:
  explicit converter(const std::string& source) : source_(source) {}

  value convert(const ::toml::node& n) {
    value v;
    v.pos = at(n.source());
    switch (n.type()) {
      case ::toml::node_type::string: v.type = value_type::string; v.str = std::string(*n.as_string()); break;
      case ::toml::node_type::integer: v.type = value_type::integer; v.integer = n.as_integer()->get(); break;
      case ::toml::node_type::floating_point: v.type = value_type::floating; v.floating = n.as_floating_point()->get(); break;
      case ::toml::node_type::boolean: v.type = value_type::boolean; v.boolean = n.as_boolean()->get(); break;
      case ::toml::node_type::array: {
        const auto& a = *n.as_array();
        v.type = value_type::array;
        v.from_array_of_tables = a.is_array_of_tables();
        for (const auto& item : a) {
          v.items.push_back(convert(item));
          if (v.from_array_of_tables) v.items.back().from_array_of_tables = true;
        }
        break;
      }
      case ::toml::node_type::table: convert_table(*n.as_table(), v); break;
      case ::toml::node_type::date:
      case ::toml::node_type::time:
      case ::toml::node_type::date_time:
        throw parse_error(source_, v.pos, "dates and times are not supported in a Tandem config; quote the value if it is text");
      case ::toml::node_type::none: break;
    }
    return v;
  }

 private:
  void convert_table(const ::toml::table& t, value& v) {
    v.type = value_type::table;
    for (const auto& [k, node] : t) {
      table_entry e;
      e.key = std::string(k.str());
      e.key_pos = at(k.source());
      e.val = convert(node);
      v.entries.push_back(std::move(e));
    }
    std::stable_sort(v.entries.begin(), v.entries.end(),
                     [](const table_entry& a, const table_entry& b) { return before(a.key_pos, b.key_pos); });
  }

  const std::string& source_;
};

/// toml++'s description without its "Error while parsing X: " preamble, plus the hint a
/// config author needs most often.
std::string why(std::string_view description) {
  std::string d(description);
  static constexpr std::string_view pre = "Error while parsing ";
  if (d.rfind(pre, 0) == 0) {
    const size_t colon = d.find(": ");
    if (colon != std::string::npos) d = d.substr(pre.size(), colon - pre.size()) + ": " + d.substr(colon + 2);
  }
  if (d.find("could not determine value type") != std::string::npos)
    d += " (strings need quotes; numbers start with a digit or sign)";
  if (d.find("unescaped control characters") != std::string::npos) d += " (is the string closed on its line?)";
  return d;
}

}  // namespace

std::string value::to_source() const {
  switch (type) {
    case value_type::string: return quote(str);
    case value_type::integer: return std::to_string(integer);
    case value_type::floating: return fmt::format("{}", floating);
    case value_type::boolean: return boolean ? "true" : "false";
    case value_type::array: {
      std::string r = "[";
      for (size_t i = 0; i < items.size(); ++i) r += (i ? ", " : "") + items[i].to_source();
      return r + "]";
    }
    case value_type::table: return "{table}";
  }
  return "";
}

parse_error::parse_error(const std::string& source, position pos, const std::string& why)
    : tandem::error(error_kind::failed, fmt::format("{}:{}:{}: {}", source, pos.line, pos.column, why)), pos_(pos) {}

value parse(std::string_view text, const std::string& source_name) {
  ::toml::table root;
  try {
    root = ::toml::parse(text, std::string_view(source_name));
  } catch (const ::toml::parse_error& e) {
    throw parse_error(source_name, at(e.source()), why(e.description()));
  }
  value v = converter(source_name).convert(root);
  v.pos = {1, 1};
  return v;
}

}  // namespace tandem::toml
