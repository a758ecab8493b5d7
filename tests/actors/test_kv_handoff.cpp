// The source side's KV send table (actors/worker/kv_handoff.h): ids per node, the bound with
// its rejection, and which completions free pages.
#include <doctest/doctest.h>

#include <set>

#include "actors/worker/kv_handoff.h"
#include "kernels/base/error.h"

using namespace tandem;

TEST_CASE("kv_send_table: ids carry the node's base and count up from the seed") {
  kv_send_table t("p0", 100, 8);
  const uint64_t a = t.start("r1"), b = t.start("r2");
  CHECK((a >> 32) == (kv_send_table::id_base("p0") >> 32));
  CHECK((a & 0xffffffffull) == 101);
  CHECK((b & 0xffffffffull) == 102);
  CHECK(kv_send_table::id_base("p0") != kv_send_table::id_base("p1"));
  CHECK(kv_send_table::id_base("") != 0);
  CHECK(t.find("r1") == a);
  CHECK(t.find("r2") == b);
  CHECK(t.find("r3") == 0);
  CHECK(t.live() == 2);
}

TEST_CASE("kv_send_table: a completion frees its request's pages once, late and unknown ones nothing") {
  kv_send_table t("p0", 0, 8);
  const uint64_t a = t.start("r1"), b = t.start("r2");
  auto done = t.finish(a, true);
  REQUIRE(done);
  CHECK(*done == "r1");
  CHECK_FALSE(t.finish(a, true));  // duplicate
  CHECK_FALSE(t.finish(12345, false));  // never started
  CHECK(t.find("r1") == 0);
  auto gone = t.finish(b, false);
  REQUIRE(gone);
  CHECK(*gone == "r2");
  CHECK(t.delivered() == 1);
  CHECK(t.failed() == 1);
  CHECK(t.live() == 0);
}

TEST_CASE("kv_send_table: the old send of a request sent again does not hide the new one") {
  kv_send_table t("p0", 0, 8);
  const uint64_t first = t.start("r1");
  const uint64_t second = t.start("r1");  // recomputed and handed off again while the first ends
  CHECK(t.find("r1") == second);
  REQUIRE(t.finish(first, false));
  CHECK(t.find("r1") == second);  // still abortable
  REQUIRE(t.finish(second, true));
  CHECK(t.find("r1") == 0);
}

TEST_CASE("kv_send_table: more than max_live sends are refused as overloaded naming the limit") {
  kv_send_table t("p0", 0, 2);
  const uint64_t a = t.start("r1");
  t.start("r2");
  try {
    t.start("r3");
    FAIL("a third send was accepted");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::overloaded);
    CHECK(std::string(e.what()).find("kv_transfer_max_live") != std::string::npos);
  }
  CHECK(t.find("r3") == 0);
  REQUIRE(t.finish(a, true));
  CHECK(t.start("r3") != 0);  // room again
}
