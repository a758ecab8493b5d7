#include "actors/common/logging.h"

#include <spdlog/sinks/stdout_sinks.h>

namespace tandem {

std::shared_ptr<spdlog::logger> make_actor_logger(const std::string& name,
                                                  std::shared_ptr<spdlog::sinks::sink> sink,
                                                  const std::string& level) {
  auto lg = std::make_shared<spdlog::logger>(name, std::move(sink));
  lg->set_level(spdlog::level::from_str(level));
  return lg;
}

std::shared_ptr<spdlog::sinks::sink> make_stderr_sink(bool json) {
  auto s = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  if (json)
    s->set_pattern(R"({"ts":"%Y-%m-%dT%H:%M:%S.%e","level":"%l","actor":"%n","msg":"%v"})");
  else
    s->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [%n] %v");
  return s;
}

}  // namespace tandem
