// KV transfers of pools in device memory over real UCX on loopback: the pools belong to a fake
// device (tests/fake_device.h: host memory it calls its own, staging copies counted and run
// only when waited for), so every page crosses through the engine's pinned staging slots
// (transport/ucx/kv_staging.h): bytes exact, the area bounded, every slot back at the end.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include "kernels/base/error.h"
#include "tests/fake_device.h"
#include "tests/ucx/small_layout.h"
#include "transport/ucx/kv_engine.h"

using namespace tandem;
using namespace tandem::ucx;

namespace {

using test::small_layout;

/// One side: 16 pages per pool, on the fake device when `dev` is set (then `slots` staging
/// slots per pool), else in UCX memory.
struct side {
  std::map<transfer_id, std::pair<pool_pages, bool>> released;
  std::unique_ptr<kv_engine> engine;
  side(const manual_clock& clock, const std::string& name, engine_options opt,
       std::shared_ptr<test::fake_device_state> dev, int32_t slots = 16) {
    if (dev) {
      opt.device = test::make_fake_device(dev);
      opt.staging_bytes = size_t(slots) * small_layout().page_bytes();
    }
    const kv_pools_layout set = kv_pools_layout::single(small_layout());
    const std::vector<int32_t> n{16};
    engine = std::make_unique<kv_engine>(clock, n, kv_identity{name, "r15m", "f32", small_layout(), set},
                                         std::move(opt),
                                         [this](transfer_id id, transfer_role, const pool_pages& p, bool ok) {
                                           released[id] = {p, ok};
                                         });
  }
  kv_pool& pool() { return engine->pool(); }
};

template <class F>
bool pump(side& a, side& b, F done) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done()) {
    a.engine->progress();
    b.engine->progress();
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return true;
}

void fill(kv_pool& pool, int32_t page, uint8_t seed) {
  uint8_t* d = pool.page_data(page);
  for (size_t i = 0; i < pool.layout().page_bytes(); ++i) d[i] = uint8_t(seed + i * 29);
}

/// Connects decode to prefill (decode dials) and returns prefill's peer id of decode.
peer_id connect(side& prefill, side& decode, transfer_id probe, peer_id& to_prefill) {
  uint16_t port = prefill.engine->listen("127.0.0.1");
  to_prefill = decode.engine->add_peer("127.0.0.1", port);
  decode.engine->table().start_receive(probe, to_prefill, pool_pages{{15}});
  REQUIRE(pump(prefill, decode, [&] { return prefill.engine->peer_named("decode-0").has_value(); }));
  return *prefill.engine->peer_named("decode-0");
}

/// Sends `src` (prefill) to `dst` (decode) as transfer `id` and waits for both ends.
void start_transfer(side& prefill, side& decode, peer_id to_decode, peer_id to_prefill, transfer_id id,
                    const pool_pages& src, const pool_pages& dst) {
  decode.engine->table().start_receive(id, to_prefill, dst);
  prefill.engine->table().start_send(id, to_decode, src);
  prefill.engine->table().source_ready(id);
}

}  // namespace

TEST_CASE("kv_engine staging: device pools on both sides, pages byte-exact, every slot back") {
  for (bool src_dev : {true, false})
    for (bool dst_dev : {true, false}) {
      if (!src_dev && !dst_dev) continue;  // test_kv_engine covers host to host
      CAPTURE(src_dev);
      CAPTURE(dst_dev);
      manual_clock clock;
      engine_options opt;
      opt.tls = "tcp";
      auto sd = src_dev ? std::make_shared<test::fake_device_state>() : nullptr;
      auto dd = dst_dev ? std::make_shared<test::fake_device_state>() : nullptr;
      side prefill(clock, "prefill-0", opt, sd);
      side decode(clock, "decode-0", opt, dd);
      CHECK((prefill.engine->staging() != nullptr) == src_dev);
      CHECK((decode.engine->staging() != nullptr) == dst_dev);
      peer_id to_prefill = 0;
      peer_id to_decode = connect(prefill, decode, 100, to_prefill);
      const pool_pages src = {{2, 3, 4, 9}}, dst = {{5, 6, 7, 1}};
      for (size_t i = 0; i < 4; ++i) fill(prefill.pool(), src[0][i], uint8_t(17 * i + 3));
      start_transfer(prefill, decode, to_decode, to_prefill, 42, src, dst);
      REQUIRE(pump(prefill, decode, [&] { return decode.released.count(42) && prefill.released.count(42); }));
      CHECK(decode.released[42].second);
      CHECK(prefill.released[42].second);
      for (size_t i = 0; i < 4; ++i)
        CHECK(std::memcmp(prefill.pool().page_data(src[0][i]), decode.pool().page_data(dst[0][i]),
                          prefill.pool().page_bytes()) == 0);
      const int64_t pb = int64_t(prefill.pool().page_bytes());
      // Each staged side copied the 4 pages once, through its slots; every slot is back.
      for (auto* s : {&prefill, &decode}) {
        const auto* staging = s->engine->staging();
        if (!staging) continue;
        CHECK(staging->in_use() == 1 - int32_t(s == &prefill));  // decode still holds probe 100's slot
        CHECK(staging->waits() == 0);
      }
      if (sd) {
        CHECK(sd->staged_copies == 4);
        CHECK(sd->staged_bytes == 4 * pb);
        CHECK(sd->quiesces == 1);
        CHECK(sd->pins == 1);
      }
      if (dd) {
        CHECK(dd->staged_copies == 4);
        CHECK(dd->staged_bytes == 4 * pb);
        CHECK(dd->queue.empty());
      }
      decode.engine->table().abort(100);
      REQUIRE(pump(prefill, decode, [&] { return decode.released.count(100) > 0; }));
      if (auto* s = decode.engine->staging()) CHECK(s->in_use() == 0);
      prefill.engine.reset();
      decode.engine.reset();
      if (sd) CHECK(sd->unpins == 1);
      if (dd) CHECK(dd->unpins == 1);
    }
}

TEST_CASE(
    "kv_engine staging: a full staging area makes a transfer wait, never grow, and refuses one too large") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  auto sd = std::make_shared<test::fake_device_state>();
  auto dd = std::make_shared<test::fake_device_state>();
  side prefill(clock, "prefill-0", opt, sd, 4);
  side decode(clock, "decode-0", opt, dd, 4);
  REQUIRE(decode.engine->staging()->capacity(0) == 4);
  peer_id to_prefill = 0;
  peer_id to_decode = connect(prefill, decode, 100, to_prefill);  // holds 1 of decode's 4 slots
  // Two transfers of 3 pages: the second waits on both sides until the first returns its slots.
  const pool_pages a_src = {{0, 1, 2}}, a_dst = {{0, 1, 2}}, b_src = {{3, 4, 5}}, b_dst = {{3, 4, 5}};
  for (int32_t p = 0; p < 6; ++p) fill(prefill.pool(), p, uint8_t(11 * p + 1));
  start_transfer(prefill, decode, to_decode, to_prefill, 1, a_src, a_dst);
  start_transfer(prefill, decode, to_decode, to_prefill, 2, b_src, b_dst);
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(1) && decode.released.count(2); }));
  REQUIRE(pump(prefill, decode, [&] { return prefill.released.count(1) && prefill.released.count(2); }));
  CHECK(decode.released[1].second);
  CHECK(decode.released[2].second);
  for (int32_t p = 0; p < 6; ++p)
    CHECK(std::memcmp(prefill.pool().page_data(p), decode.pool().page_data(p), prefill.pool().page_bytes()) ==
          0);
  // The destination had 3 free slots: transfer 2 waited for transfer 1's.
  CHECK(decode.engine->staging()->waits() > 0);
  CHECK(decode.engine->staging()->capacity(0) == 4);
  CHECK(decode.engine->staging()->in_use() == 1);  // probe 100
  CHECK(prefill.engine->staging()->in_use() == 0);
  const auto m = kv_staging::metrics_of(decode.engine->staging());
  CHECK(m[0].name == "kv_staging_slots");
  CHECK(m[0].value == 4);
  CHECK(m[2].value == double(decode.engine->staging()->waits()));
  // Five pages can never fit in four slots: refused at the start, naming the fix.
  CHECK_THROWS_WITH_AS(decode.engine->staging()->check(pool_pages{{0, 1, 2, 3, 4}}),
                       doctest::Contains("TANDEM_KV_STAGING_MB"), tandem::error);
  CHECK_NOTHROW(decode.engine->staging()->check(pool_pages{{0, -1, 2, 3, 4}}));  // -1 moves nothing
}

TEST_CASE("kv_engine staging: an aborted transfer waiting for slots returns them once it ends") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  auto dd = std::make_shared<test::fake_device_state>();
  side prefill(clock, "prefill-0", opt, nullptr);
  side decode(clock, "decode-0", opt, dd, 2);
  peer_id to_prefill = 0;
  connect(prefill, decode, 100, to_prefill);                                // 1 of 2 slots
  decode.engine->table().start_receive(7, to_prefill, pool_pages{{3, 4}});  // needs 2: waits
  REQUIRE(pump(prefill, decode, [&] { return decode.engine->staging()->waits() > 0; }));
  CHECK(decode.engine->staging()->leases() == 1);
  decode.engine->table().abort(7);
  decode.engine->table().abort(100);
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(7) && decode.released.count(100); }));
  for (int i = 0; i < 10; ++i) decode.engine->progress();  // the waiting step finds it ended
  CHECK(decode.engine->staging()->in_use() == 0);
  CHECK(decode.engine->staging()->leases() == 0);
}
