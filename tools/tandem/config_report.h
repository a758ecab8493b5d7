#pragma once
/// Printing of config problems, shared by `check-config` and `serve --config` so both say the same.
#include "actors/config/cluster_config.h"

namespace tandem::cli {

/// Every error and note of `c` on stderr, one per line.
void print_config_problems(const config_check& c);

}  // namespace tandem::cli
