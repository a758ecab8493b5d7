// The one limits table (actors/common/limits_table.h): every field of `limits` is in it once,
// its bounds are what validate(), the config checker and the serve flags enforce, and
// docs/config.md shows it as it is.
#include <doctest/doctest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "actors/common/limits_table.h"
#include "actors/config/cluster_config.h"

using namespace tandem;

TEST_CASE("limits table: keys unique, defaults within their own bounds, validate() passes the defaults") {
  std::set<std::string> keys;
  for (const auto& f : limit_fields()) {
    CHECK_MESSAGE(keys.insert(f.key).second, f.key);
    CHECK_MESSAGE(int(f.i32 != nullptr) + int(f.i64 != nullptr) + int(f.boolean != nullptr) == 1, f.key);
    if (f.is_integer()) CHECK_MESSAGE(check_limit(f, f.get(limits{})).empty(), f.key);
    CHECK_MESSAGE(std::string(f.fix).size() > 0, f.key);
  }
  CHECK(limits{}.validate().empty());
}

TEST_CASE("limits table: validate() refuses each integer field just outside its range, naming it and the fix") {
  for (const auto& f : limit_fields()) {
    if (!f.is_integer()) continue;
    limits l;
    f.set(l, f.min - 1);
    const std::string msg = l.validate();
    CHECK_MESSAGE(msg.find(std::string("limits.") + f.key + " = " + std::to_string(f.min - 1)) == 0, msg);
    CHECK_MESSAGE(msg.find(f.fix) != std::string::npos, msg);
    if (f.max < INT32_MAX) {
      limits h;
      f.set(h, f.max + 1);
      CHECK_MESSAGE(h.validate().find(std::string("limits.") + f.key) == 0, f.key);
    }
  }
}

TEST_CASE("limits table: the config file reads every key with the table's bounds") {
  for (const auto& f : limit_fields()) {
    if (!f.is_integer()) continue;
    const std::string text = "[limits]\n" + std::string(f.key) + " = " + std::to_string(f.min - 1) + "\n";
    auto c = check_cluster_config(text, "t.toml", machine_info{});
    bool named = false;
    for (const auto& e : c.errors) named = named || e.find(std::string("limits.") + f.key) != std::string::npos;
    CHECK_MESSAGE(named, f.key);
  }
}

TEST_CASE("limits table: docs/config.md shows the table as it is") {
  std::ifstream in(std::string(TANDEM_SOURCE_DIR) + "/docs/config.md");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string doc = ss.str();
  const std::string begin_marker = "<!-- limits table: generated from actors/common/limits_table.cpp (tests/config/test_limits_table.cpp) -->\n";
  const std::string end_marker = "<!-- end of limits table -->";
  const size_t b = doc.find(begin_marker);
  const size_t e = doc.find(end_marker);
  REQUIRE(b != std::string::npos);
  REQUIRE(e != std::string::npos);
  const std::string shown = doc.substr(b + begin_marker.size(), e - b - begin_marker.size());
  const std::string expected = limits_markdown();
  if (shown != expected) {
    // Print what to paste, so updating the docs is one copy.
    MESSAGE("docs/config.md's limits table differs from the code; replace it with:\n" << expected);
  }
  CHECK(shown == expected);
}
