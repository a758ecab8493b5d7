#pragma once
/// Exit codes of the `tandem` binary, in one place (docs/operations.md, "Exit codes"). Config
/// and usage errors have codes of their own (sysexits.h's) so that a process manager can tell
/// "this will fail the same way every time" from a crash: deploy/systemd's units list them in
/// RestartPreventExitStatus= and stop at once instead of restarting into the same error.
#include <string>

#include "kernels/base/error.h"

namespace tandem::cli {

inline constexpr int exit_ok = 0;
/// Runtime failures (a node whose supervisor gave up, an I/O error, a crash's exception).
inline constexpr int exit_failure = 1;
/// EX_USAGE: unknown command or flag, a flag value out of range, flags that conflict.
inline constexpr int exit_usage = 64;
/// EX_CONFIG: the cluster config is invalid or unreadable, or names no such node.
inline constexpr int exit_config = 78;

/// A command line that cannot work: main exits with exit_usage.
class usage_error : public tandem::error {
 public:
  explicit usage_error(const std::string& message) : tandem::error(error_kind::failed, message) {}
};

/// A config that cannot work: main exits with exit_config.
class config_error : public tandem::error {
 public:
  explicit config_error(const std::string& message) : tandem::error(error_kind::failed, message) {}
};

}  // namespace tandem::cli
