#pragma once
/// The keys of the [limits] table: each field of `limits` with its lower bound and the fix a
/// message names. One table, so the parser, the unknown-key list and the docs agree.
#include <cstdint>
#include <vector>

#include "actors/common/limits.h"

namespace tandem::config_detail {

struct i32_field {
  const char* name;
  int32_t limits::*member;
  int64_t lo;
  const char* fix;
};

struct i64_field {
  const char* name;
  int64_t limits::*member;
  const char* fix;
};

/// The int32 fields of [limits].
const std::vector<i32_field>& limits_i32_fields();
/// The int64 fields of [limits].
const std::vector<i64_field>& limits_i64_fields();

}  // namespace tandem::config_detail
