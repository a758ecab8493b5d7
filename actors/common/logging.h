#pragma once
/// One spdlog logger per actor, all writing to a sink the cluster owns (no global registry).
#include <spdlog/formatter.h>
#include <spdlog/logger.h>
#include <spdlog/sinks/sink.h>

#include <memory>
#include <string>

namespace tandem {

/// A logger named `name` on `sink` at `level` ("trace".."off"); never registered globally.
std::shared_ptr<spdlog::logger> make_actor_logger(const std::string& name,
                                                  std::shared_ptr<spdlog::sinks::sink> sink,
                                                  const std::string& level);

/// A sink writing to stderr; `json` selects one JSON object per line (json_log_formatter).
std::shared_ptr<spdlog::sinks::sink> make_stderr_sink(bool json);

/// One JSON object per line: {"ts","level","actor","request_id"?,"msg"}, every string escaped.
/// `request_id` is taken from messages that follow the house convention "request <id>: ...".
std::unique_ptr<spdlog::formatter> make_json_log_formatter();

}  // namespace tandem
