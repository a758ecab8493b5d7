// JSON log lines (`tandem serve --log-format json`): escaped, one object per line, request ids.
#include <doctest/doctest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <sstream>

#include "actors/common/logging.h"

using namespace tandem;

TEST_CASE("logging: the JSON formatter escapes messages and lifts the request id") {
  std::ostringstream os;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(os);
  sink->set_formatter(make_json_log_formatter());
  auto log = make_actor_logger("prefill", sink, "debug");
  log->info("request r-17: prompt \"{}\" \\ has\ttabs\nand a newline", "quoted");
  log->warn("no request here: {}", 3);
  log->debug("request with spaces: not an id");
  log->flush();
  std::string out = os.str();
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  REQUIRE(lines.size() == 3);
  CHECK(lines[0].rfind(R"({"ts":")", 0) == 0);
  CHECK(lines[0].find(R"("level":"info","actor":"prefill","request_id":"r-17","msg":"request r-17: prompt \"quoted\" \\ has\ttabs\nand a newline"})") !=
        std::string::npos);
  CHECK(lines[1].find(R"("level":"warning","actor":"prefill","msg":"no request here: 3"})") != std::string::npos);
  CHECK(lines[2].find("request_id") == std::string::npos);
}
