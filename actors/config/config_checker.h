#pragma once
/// The checker of the cluster config's TOML values: typed reads with ranges and the error
/// format "<file>:<line>:<col>: <key> = <value>: <why>; <fix>". Shared by the files that
/// check the config's tables (cluster_config.cpp, cache_table.cpp); internal to actors/config.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <vector>

#include "actors/config/cluster_config.h"
#include "actors/config/toml.h"

namespace tandem::config_detail {

using toml::value;
using toml::value_type;

inline constexpr double gib = 1024.0 * 1024.0 * 1024.0;

inline std::string fmt_gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / gib); }

inline std::string article_type(value_type t) {
  return t == value_type::integer || t == value_type::array ? std::string("an ") + toml::type_name(t)
                                                            : std::string("a ") + toml::type_name(t);
}

class checker {
 public:
  checker(std::string src, std::vector<std::string>& errors) : src_(std::move(src)), errors_(errors) {}

  /// "<file>:<line>:<col>: <key> = <value>: <why>; <fix>"
  void error(toml::position p, const std::string& key, const value* v, const std::string& why_and_fix) {
    std::string head = v ? fmt::format("{} = {}", key, v->to_source()) : key;
    errors_.push_back(fmt::format("{}:{}:{}: {}: {}", src_, p.line, p.column, head, why_and_fix));
  }

  /// Every key of `t` must be in `known`; reports the others with a suggestion.
  void known_keys(const value& t, const std::string& table, const std::vector<std::string>& known) {
    for (const auto& e : t.entries) {
      if (std::find(known.begin(), known.end(), e.key) != known.end()) continue;
      std::string full = table.empty() ? e.key : table + "." + e.key;
      std::string guess = did_you_mean(e.key, known);
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      error(e.key_pos, full, nullptr,
            guess.empty() ? fmt::format("unknown key; {} takes: {}", table.empty() ? "the top level" : "[" + table + "]", list)
                          : fmt::format("unknown key; did you mean '{}'?", guess));
    }
  }

  /// Integer key within [lo, hi]; false if absent or wrong (already reported).
  bool integer(const value& t, const std::string& table, const std::string& key, int64_t lo, int64_t hi,
               const std::string& fix, int64_t& out) {
    const value* v = t.find(key);
    if (!v) return false;
    std::string full = table + "." + key;
    if (v->type != value_type::integer) {
      error(v->pos, full, v, fmt::format("expected an integer, got {}; {}", article_type(v->type), type_fix(*v, fix)));
      return false;
    }
    if (v->integer < lo || v->integer > hi) {
      error(v->pos, full, v, fmt::format("out of range {}; {}", range(lo, hi), fix));
      return false;
    }
    out = v->integer;
    return true;
  }

  bool real(const value& t, const std::string& table, const std::string& key, double lo, double hi,
            const std::string& fix, double& out) {
    const value* v = t.find(key);
    if (!v) return false;
    std::string full = table + "." + key;
    double d = 0;
    if (v->type == value_type::integer) {
      d = double(v->integer);
    } else if (v->type == value_type::floating) {
      d = v->floating;
    } else {
      error(v->pos, full, v, fmt::format("expected a number, got {}; {}", article_type(v->type), type_fix(*v, fix)));
      return false;
    }
    if (!(d >= lo && d <= hi)) {
      error(v->pos, full, v, fmt::format("out of range {} .. {}; {}", lo, hi == HUGE_VAL ? "inf" : fmt::format("{}", hi), fix));
      return false;
    }
    out = d;
    return true;
  }

  bool boolean(const value& t, const std::string& table, const std::string& key, bool& out) {
    const value* v = t.find(key);
    if (!v) return false;
    if (v->type != value_type::boolean) {
      error(v->pos, table + "." + key, v,
            fmt::format("expected a boolean, got {}; write {} = true or {} = false (no quotes)", article_type(v->type),
                        key, key));
      return false;
    }
    out = v->boolean;
    return true;
  }

  bool string(const value& t, const std::string& table, const std::string& key, std::string& out) {
    const value* v = t.find(key);
    if (!v) return false;
    if (v->type != value_type::string) {
      error(v->pos, table + "." + key, v,
            fmt::format("expected a string, got {}; put the value in double quotes", article_type(v->type)));
      return false;
    }
    out = v->str;
    return true;
  }

  /// String key that must be one of `choices`.
  bool choice(const value& t, const std::string& table, const std::string& key, const std::vector<std::string>& choices,
              std::string& out) {
    std::string s;
    if (!string(t, table, key, s)) return false;
    if (std::find(choices.begin(), choices.end(), s) != choices.end()) {
      out = s;
      return true;
    }
    std::string list;
    for (const auto& c : choices) list += (list.empty() ? "" : ", ") + c;
    std::string guess = did_you_mean(s, choices);
    error(t.find(key)->pos, table + "." + key, t.find(key),
          fmt::format("not a known value; {}use one of: {}", guess.empty() ? "" : "did you mean '" + guess + "'? ", list));
    return false;
  }

  /// A table-valued top-level key, or nullptr (absent or reported).
  const value* table(const value& root, const std::string& key) {
    const value* v = root.find(key);
    if (!v) return nullptr;
    if (v->type != value_type::table) {
      error(v->pos, key, v,
            fmt::format("expected a table, got {}; write a [{}] header with its keys on the lines below",
                        v->from_array_of_tables ? std::string("an array of tables") : article_type(v->type), key));
      return nullptr;
    }
    return v;
  }

 private:
  static std::string range(int64_t lo, int64_t hi) {
    if (hi == INT64_MAX) return fmt::format("(must be >= {})", lo);
    return fmt::format("{} .. {}", lo, hi);
  }
  static std::string type_fix(const value& v, const std::string& fix) {
    if (v.type == value_type::string) return "remove the quotes if it is a number; " + fix;
    return fix;
  }

  std::string src_;
  std::vector<std::string>& errors_;
};

}  // namespace tandem::config_detail
