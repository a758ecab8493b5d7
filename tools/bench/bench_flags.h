#pragma once
/// What every benchmark mode does with its flags first.
#include <cstdio>
#include <string>

#include "kernels/base/error.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

/// Parses a mode's flags. --help prints "usage: tandem bench SYNOPSIS" and the flags and
/// returns false; a positional argument is refused (files are passed as --model FILE).
inline bool parse_bench_flags(flags& f, args a, const std::string& synopsis) {
  if (!f.parse(a)) {
    std::printf("usage: tandem bench %s\n\n%s", synopsis.c_str(), f.help().c_str());
    return false;
  }
  if (!f.positional().empty())
    throw tandem::error("unexpected argument '" + f.positional().front() + "': options are --name value");
  return true;
}

/// --model FILE, which the mode needs.
inline std::string bench_model_path(const flags& f) {
  std::string path = f.str("model");
  if (path.empty()) throw tandem::error("missing --model FILE: make one with tandem make-model --preset small-110m");
  return path;
}

}  // namespace tandem::cli
