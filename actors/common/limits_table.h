#pragma once
/// The one table of `limits`' fields: each field's [limits] key, member, bounds, unit, the
/// `tandem serve` flag that sets it (if any), its meaning and the fix a message names.
/// limits::validate(), the config checker, the serve flags and the [limits] table of
/// docs/config.md (limits_markdown(), compared by a test) all come from it, so a limit is
/// written once.
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "actors/common/limits.h"

namespace tandem {

/// One field of `limits`. Exactly one of `i32`, `i64`, `boolean` is set.
struct limit_field {
  const char* key;                     ///< [limits] key, and the name in messages
  int32_t limits::*i32 = nullptr;
  int64_t limits::*i64 = nullptr;
  bool limits::*boolean = nullptr;
  int64_t min = 1;                     ///< inclusive bounds (integers)
  int64_t max = std::numeric_limits<int32_t>::max();
  const char* unit = "";               ///< "ms", "bytes", "tokens", ... ("" = a count)
  const char* serve_flag = nullptr;    ///< `tandem serve --NAME` without a config, or nullptr
  const char* meaning = "";            ///< one line for the docs and the flag's help
  const char* fix = "";                ///< what a message about a bad value tells the user

  bool is_integer() const { return boolean == nullptr; }
  int64_t get(const limits& l) const { return i32 ? l.*i32 : i64 ? l.*i64 : int64_t(l.*boolean); }
  void set(limits& l, int64_t v) const;
  /// The default (of a value-initialised `limits`) as text: "4096", "true".
  std::string default_text() const;
  /// "1..4096", ">= 0", ">= 1"
  std::string range_text() const;
};

/// Every field of `limits`, in the order of docs/config.md.
std::span<const limit_field> limit_fields();
/// The field of `key`, or nullptr.
const limit_field* find_limit(std::string_view key);
/// Empty if `v` is within the field's bounds, else "SUBJECT = V must be RANGE; FIX", where the
/// subject names the value as the user gave it (default "limits.KEY"; a flag: "flag --NAME").
std::string check_limit(const limit_field& f, int64_t v, const std::string& subject = "");
/// The [limits] table of docs/config.md: key, type, default, range, serve flag, meaning.
std::string limits_markdown();

}  // namespace tandem
