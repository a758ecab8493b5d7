#include "actors/common/logging.h"

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <string_view>

namespace tandem {

namespace {

void put(spdlog::memory_buf_t& out, std::string_view s) { out.append(s.data(), s.data() + s.size()); }

void append_json_string(spdlog::memory_buf_t& out, std::string_view s) {
  out.push_back('"');
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      put(out, "\\n");
    } else if (c == '\t') {
      put(out, "\\t");
    } else if (c == '\r') {
      put(out, "\\r");
    } else if (u < 0x20) {
      fmt::format_to(std::back_inserter(out), "\\u{:04x}", unsigned(u));
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
}

class json_log_formatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    using namespace std::chrono;
    auto t = msg.time;
    auto ms = duration_cast<milliseconds>(t.time_since_epoch()).count() % 1000;
    std::time_t secs = system_clock::to_time_t(t);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    fmt::format_to(std::back_inserter(dest), R"({{"ts":"{:%Y-%m-%dT%H:%M:%S}.{:03d}Z","level":)", tm, int(ms));
    auto level = spdlog::level::to_string_view(msg.level);
    append_json_string(dest, std::string_view(level.data(), level.size()));
    put(dest, R"(,"actor":)");
    append_json_string(dest, std::string_view(msg.logger_name.data(), msg.logger_name.size()));
    std::string_view text(msg.payload.data(), msg.payload.size());
    constexpr std::string_view prefix = "request ";
    if (text.substr(0, prefix.size()) == prefix) {
      auto end = text.find(':', prefix.size());
      auto id = end == std::string_view::npos ? std::string_view{} : text.substr(prefix.size(), end - prefix.size());
      if (!id.empty() && id.find(' ') == std::string_view::npos) {
        put(dest, R"(,"request_id":)");
        append_json_string(dest, id);
      }
    }
    put(dest, R"(,"msg":)");
    append_json_string(dest, text);
    put(dest, "}\n");
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<json_log_formatter>(); }
};

}  // namespace

std::unique_ptr<spdlog::formatter> make_json_log_formatter() { return std::make_unique<json_log_formatter>(); }

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
    s->set_formatter(make_json_log_formatter());
  else
    s->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ [%n] %v");
  return s;
}

}  // namespace tandem
