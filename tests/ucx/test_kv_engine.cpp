// KV page transfer over real UCX on loopback: two engines (contexts, workers) in one process.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "kernels/base/error.h"
#include "tests/ucx/small_layout.h"
#include "transport/ucx/kv_engine.h"

using namespace tandem;
using namespace tandem::ucx;

namespace {

using test::small_layout;

/// One side: a heap KV pool registered with its engine, or (ucx_memory) a pool the engine
/// allocates in UCX memory.
struct node {
  std::optional<kv_pool> heap_pool;
  std::map<transfer_id, std::pair<pool_pages, bool>> released;
  std::map<int32_t, int> release_count;  ///< pool 0's pages
  std::unique_ptr<kv_engine> engine_ptr;
  kv_engine& engine;
  kv_pool& pool;
  node(const manual_clock& clock, const std::string& name, kv_layout layout, engine_options opt,
       bool ucx_memory = false)
      : engine_ptr(make(clock, name, layout, std::move(opt), ucx_memory)), engine(*engine_ptr), pool(engine.pool()) {}
  /// Every pool of `set` in UCX memory, 16 pages each.
  node(const manual_clock& clock, const std::string& name, const kv_pools_layout& set, engine_options opt)
      : engine_ptr(make_set(clock, name, set, std::move(opt))), engine(*engine_ptr), pool(engine.pool()) {}
  transfer_table::release_fn release() {
    return [this](transfer_id id, transfer_role, const pool_pages& pages, bool delivered) {
      released[id] = {pages, delivered};
      for (int32_t p : pages.at(0)) ++release_count[p];
    };
  }
  std::unique_ptr<kv_engine> make(const manual_clock& clock, const std::string& name, kv_layout layout,
                                  engine_options opt, bool ucx_memory) {
    kv_identity id{name, "r15m", "f32", layout};
    if (ucx_memory) return std::make_unique<kv_engine>(clock, 16, id, std::move(opt), release());
    heap_pool.emplace(layout, 16);
    return std::make_unique<kv_engine>(clock, *heap_pool, id, std::move(opt), release());
  }
  std::unique_ptr<kv_engine> make_set(const manual_clock& clock, const std::string& name, const kv_pools_layout& set,
                                      engine_options opt) {
    kv_identity id{name, "r15m", "f32", set.pools.front().page, set};
    const std::vector<int32_t> n(set.pools.size(), 16);
    return std::make_unique<kv_engine>(clock, n, id, std::move(opt), release());
  }
};

/// Progresses both engines until `done` holds; fails the test after 20 s of wall time (a
/// hang guard, not a timing assumption).
template <class F>
bool pump(node& a, node& b, F done) {
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done()) {
    a.engine.progress();
    b.engine.progress();
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return true;
}

void fill(kv_pool& pool, int32_t page, uint8_t seed) {
  uint8_t* d = pool.page_data(page);
  for (size_t i = 0; i < pool.layout().page_bytes(); ++i) d[i] = uint8_t(seed + i * 31);
}

void transfer_pages(const std::string& tls, put_mode mode, bool ucx_memory = false) {
  manual_clock clock;
  engine_options opt;
  opt.tls = tls;
  opt.mode = mode;
  node prefill(clock, "prefill-0", small_layout(), opt, ucx_memory);
  node decode(clock, "decode-0", small_layout(), opt, ucx_memory);
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id to_prefill = decode.engine.add_peer("127.0.0.1", port);

  // Pages 2,3,4 (consecutive) and 9 go to 5,6,7 and 1.
  std::vector<int32_t> src = {2, 3, 4, 9}, dst = {5, 6, 7, 1};
  for (size_t i = 0; i < src.size(); ++i) fill(prefill.pool, src[i], uint8_t(17 * i + 3));
  decode.engine.table().start_receive(42, to_prefill, pool_pages{dst});
  REQUIRE(pump(prefill, decode, [&] { return prefill.engine.peer_named("decode-0").has_value(); }));
  peer_id to_decode = *prefill.engine.peer_named("decode-0");
  prefill.engine.table().start_send(42, to_decode, pool_pages{src});
  prefill.engine.table().source_ready(42);
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(42) && prefill.released.count(42); }));
  CHECK(decode.released[42].second);
  CHECK(prefill.released[42].second);
  for (size_t i = 0; i < src.size(); ++i)
    CHECK(std::memcmp(prefill.pool.page_data(src[i]), decode.pool.page_data(dst[i]),
                      prefill.pool.layout().page_bytes()) == 0);
  // Untouched destination pages stay zero.
  std::vector<uint8_t> zero(decode.pool.layout().page_bytes(), 0);
  CHECK(std::memcmp(decode.pool.page_data(0), zero.data(), zero.size()) == 0);
  CHECK(prefill.engine.puts_issued() == (mode == put_mode::batched ? 2u : 4u * 3u));
  CHECK(decode.engine.table().completed() == 1);
}

}  // namespace

TEST_CASE("kv_engine: pages arrive byte-exact over UCX_TLS=tcp") { transfer_pages("tcp", put_mode::batched); }

TEST_CASE("kv_engine: pages arrive byte-exact over UCX's default transports") {
  transfer_pages("", put_mode::batched);
}

TEST_CASE("kv_engine: layer-by-layer puts arrive byte-exact") { transfer_pages("tcp", put_mode::per_layer); }

TEST_CASE("kv_engine: pools in UCX-allocated memory arrive byte-exact (shared memory), both modes") {
  transfer_pages("", put_mode::batched, true);
  transfer_pages("", put_mode::per_layer, true);
  transfer_pages("tcp", put_mode::batched, true);
}

TEST_CASE("kv_engine: a layout mismatch fails the handshake naming both sides' values") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  kv_layout other = small_layout();
  other.head_dim = 16;
  node prefill(clock, "prefill-0", small_layout(), opt);
  node decode(clock, "decode-0", other, opt);
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id p = decode.engine.add_peer("127.0.0.1", port);
  decode.engine.table().start_receive(1, p, {{0, 1}});
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(1) > 0; }));
  CHECK_FALSE(decode.released[1].second);
  for (const std::string& msg : {decode.engine.last_peer_error(), decode.engine.table().last_error()}) {
    CAPTURE(msg);
    CHECK(msg.find("KV layout mismatch") != std::string::npos);
    CHECK(msg.find("head_dim: here 16 vs peer 8") != std::string::npos);
    CHECK(msg.find("'prefill-0'") != std::string::npos);
    CHECK(msg.find("'decode-0'") != std::string::npos);
  }
  REQUIRE(pump(prefill, decode, [&] { return !prefill.engine.last_peer_error().empty(); }));
  CHECK(prefill.engine.last_peer_error().find("head_dim: here 8 vs peer 16") != std::string::npos);
}

TEST_CASE("kv_engine: a lost completion notification quarantines the pages until the source answers") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  engine_options faulty = opt;
  int dropped = 0;
  faulty.faults = [&](fault_point fp, transfer_id, notify_kind k) {
    if (fp == fault_point::notify && k == notify_kind::done) {
      ++dropped;
      return fault_decision{fault_action::drop, 0};
    }
    return fault_decision{};
  };
  node prefill(clock, "prefill-0", small_layout(), faulty);
  node decode(clock, "decode-0", small_layout(), opt);
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id p = decode.engine.add_peer("127.0.0.1", port);
  fill(prefill.pool, 3, 9);
  decode.engine.table().start_receive(5, p, {{8}});
  REQUIRE(pump(prefill, decode, [&] { return prefill.engine.peer_named("decode-0").has_value(); }));
  prefill.engine.table().start_send(5, *prefill.engine.peer_named("decode-0"), {{3}});
  prefill.engine.table().source_ready(5);
  REQUIRE(pump(prefill, decode, [&] { return prefill.released.count(5) > 0; }));
  CHECK(dropped == 1);
  CHECK(decode.released.count(5) == 0);
  // The destination gives up; it must not free page 8 until the source says nothing is in flight.
  clock.advance_ms(opt.limits.transferring_ms + opt.limits.waiting_ms);
  decode.engine.progress();
  CHECK(decode.engine.table().quarantined(5));
  CHECK(decode.released.count(5) == 0);
  // The source no longer knows transfer 5: it answers the cancel with `failed`, which
  // releases the quarantine; a late event is counted, not fatal.
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(5) > 0; }));
  CHECK_FALSE(decode.released[5].second);
  CHECK(decode.release_count[8] == 1);
  CHECK(prefill.engine.table().late_events() >= 1);
}

TEST_CASE("kv_engine: listening without tcp in UCX_TLS says how to fix it") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "posix";
  kv_pool pool(small_layout(), 2);
  kv_engine e(clock, pool, kv_identity{"n", "m", "f32", small_layout()}, opt, nullptr);
  CHECK_THROWS_WITH_AS(e.listen("127.0.0.1"), doctest::Contains("needs the tcp transport"), tandem::error);
}

TEST_CASE("kv_engine: a peer that goes away fails the transfer and its pages come back once") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  auto prefill = std::make_unique<node>(clock, "prefill-0", small_layout(), opt);
  node decode(clock, "decode-0", small_layout(), opt);
  uint16_t port = prefill->engine.listen("127.0.0.1");
  peer_id p = decode.engine.add_peer("127.0.0.1", port);
  decode.engine.table().start_receive(3, p, {{4, 5}});
  REQUIRE(pump(*prefill, decode, [&] { return decode.engine.table().phase(3) == transfer_phase::waiting; }));
  // Descriptors are out: the prefill side could be writing. Kill it.
  prefill.reset();
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!decode.released.count(3) && std::chrono::steady_clock::now() < until) decode.engine.progress();
  REQUIRE(decode.released.count(3));
  CHECK_FALSE(decode.released[3].second);
  CHECK(decode.release_count[4] == 1);
  CHECK(decode.release_count[5] == 1);
  CHECK(decode.engine.table().quarantined_transfers() == 0);
  CHECK(decode.engine.last_peer_error().find("disconnected") != std::string::npos);
}

namespace {

/// gemma2-like: layer 1 in the full pool, layers 0 and 2 in a window pool of `window` tokens.
kv_pools_layout two_pools(int32_t window) {
  kv_layout page = small_layout();
  kv_pool_spec full{.name = "full", .page = page, .window_tokens = 0, .layers = {1}};
  kv_pool_spec win{.name = "window", .page = page, .window_tokens = window, .layers = {0, 2}};
  full.page.n_layers = 1;
  win.page.n_layers = 2;
  return kv_pools_layout{.pools = {full, win}};
}

// Pool 0: pages 2,3,4,9 -> 5,6,7,1. Pool 1 (window): blocks 0 and 1 released (-1 on both
// sides), 5,6 -> 0,11.
const pool_pages two_pool_src = {{2, 3, 4, 9}, {-1, -1, 5, 6}};
const pool_pages two_pool_dst = {{5, 6, 7, 1}, {-1, -1, 0, 11}};

/// Runs one 2-pool transfer (id 9) from prefill to decode; returns when both sides released it.
void two_pool_transfer(node& prefill, node& decode) {
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id to_prefill = decode.engine.add_peer("127.0.0.1", port);
  for (size_t k = 0; k < 2; ++k)
    for (size_t i = 0; i < two_pool_src[k].size(); ++i)
      if (two_pool_src[k][i] >= 0) fill(prefill.engine.pools()[k], two_pool_src[k][i], uint8_t(40 * k + 17 * i + 3));
  decode.engine.table().start_receive(9, to_prefill, two_pool_dst);
  REQUIRE(pump(prefill, decode, [&] { return prefill.engine.peer_named("decode-0").has_value(); }));
  prefill.engine.table().start_send(9, *prefill.engine.peer_named("decode-0"), two_pool_src);
  prefill.engine.table().source_ready(9);
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(9) && prefill.released.count(9); }));
}

void two_pools_byte_identical(put_mode mode) {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  opt.mode = mode;
  node prefill(clock, "prefill-0", two_pools(8), opt);
  node decode(clock, "decode-0", two_pools(8), opt);
  two_pool_transfer(prefill, decode);
  CHECK(decode.released[9].second);
  CHECK(prefill.released[9].second);
  CHECK(decode.released[9].first == two_pool_dst);  // the pages come back as given, holes included
  for (size_t k = 0; k < 2; ++k) {
    kv_pool &src = prefill.engine.pools()[k], &dst = decode.engine.pools()[k];
    CAPTURE(k);
    for (size_t i = 0; i < two_pool_src[k].size(); ++i)
      if (two_pool_src[k][i] >= 0)
        CHECK(std::memcmp(src.page_data(two_pool_src[k][i]), dst.page_data(two_pool_dst[k][i]), src.page_bytes()) ==
              0);
    // Released blocks move nothing: every page not named stays zero.
    std::vector<uint8_t> zero(dst.page_bytes(), 0);
    for (int32_t p = 0; p < dst.n_pages(); ++p)
      if (std::find(two_pool_dst[k].begin(), two_pool_dst[k].end(), p) == two_pool_dst[k].end())
        CHECK(std::memcmp(dst.page_data(p), zero.data(), zero.size()) == 0);
  }
  CHECK(decode.engine.table().completed() == 1);
  // The destination hashed exactly the pages it received.
  CHECK(decode.engine.manifest_bytes() ==
        4 * decode.engine.pools()[0].page_bytes() + 2 * decode.engine.pools()[1].page_bytes());
}

/// A source whose put fault hits pool `pool` of every transfer.
engine_options pool_fault(fault_action a, int32_t pool) {
  engine_options opt;
  opt.tls = "tcp";
  opt.faults = [a, pool](fault_point fp, transfer_id, notify_kind) {
    return fp == fault_point::put ? fault_decision{a, 0, pool} : fault_decision{};
  };
  return opt;
}

}  // namespace

TEST_CASE("kv_engine: a 2-pool transfer is byte-identical per pool, released window blocks included") {
  two_pools_byte_identical(put_mode::batched);
  two_pools_byte_identical(put_mode::per_layer);
}

TEST_CASE("kv_engine: a transfer that drops the window pool's puts fails naming the window pool") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  node prefill(clock, "prefill-0", two_pools(8), pool_fault(fault_action::drop, 1));
  node decode(clock, "decode-0", two_pools(8), opt);
  two_pool_transfer(prefill, decode);
  CHECK_FALSE(decode.released[9].second);
  CHECK(decode.released[9].first == two_pool_dst);  // the caller's again, to free or recompute
  CHECK(decode.engine.table().failed(fail_reason::manifest) == 1);
  const std::string why = decode.engine.table().last_error();
  CAPTURE(why);
  CHECK(why.find("pool 1 (window): the source wrote 0 pages, 2 were expected") != std::string::npos);
  // The full pool did land; the transfer fails all the same.
  CHECK(std::memcmp(prefill.engine.pools()[0].page_data(2), decode.engine.pools()[0].page_data(5),
                    prefill.engine.pools()[0].page_bytes()) == 0);
}

TEST_CASE("kv_engine: a byte flipped in transit fails the transfer on its checksum, naming the pool") {
  for (int32_t pool : {0, 1}) {
    CAPTURE(pool);
    manual_clock clock;
    engine_options opt;
    opt.tls = "tcp";
    node prefill(clock, "prefill-0", two_pools(8), pool_fault(fault_action::corrupt, pool));
    node decode(clock, "decode-0", two_pools(8), opt);
    two_pool_transfer(prefill, decode);
    CHECK_FALSE(decode.released[9].second);
    CHECK(decode.engine.table().failed(fail_reason::checksum) == 1);
    const std::string why = decode.engine.table().last_error();
    CAPTURE(why);
    CHECK(why.find(pool == 0 ? "pool 0 (full): checksum" : "pool 1 (window): checksum") != std::string::npos);
    bool counted = false;
    for (auto& m : decode.engine.table().metrics())
      if (m.name == "kv_transfer_failed_total" && m.labels == "reason=\"checksum\"") counted = m.value == 1;
    CHECK(counted);
    // The source's own pages are untouched: the flip happened on a copy in flight.
    std::vector<uint8_t> expect(prefill.engine.pools()[size_t(pool)].page_bytes());
    for (size_t i = 0; i < expect.size(); ++i) expect[i] = uint8_t(uint8_t(40 * pool + 17 * (pool ? 2 : 0) + 3) + i * 31);
    CHECK(std::memcmp(prefill.engine.pools()[size_t(pool)].page_data(two_pool_src[size_t(pool)][pool ? 2 : 0]),
                      expect.data(), expect.size()) == 0);
  }
}

TEST_CASE("kv_engine: peers whose window differs are refused naming both windows") {
  manual_clock clock;
  engine_options opt;
  opt.tls = "tcp";
  node prefill(clock, "prefill-0", two_pools(8), opt);
  node decode(clock, "decode-0", two_pools(16), opt);
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id p = decode.engine.add_peer("127.0.0.1", port);
  decode.engine.table().start_receive(1, p, {{0}, {1}});
  REQUIRE(pump(prefill, decode, [&] { return decode.released.count(1) > 0; }));
  CHECK_FALSE(decode.released[1].second);
  const std::string here = decode.engine.last_peer_error();
  CAPTURE(here);
  CHECK(here.find("KV layout mismatch") != std::string::npos);
  CHECK(here.find("pool 1 (window): window_tokens 16 here, 8 on prefill-0") != std::string::npos);
  REQUIRE(pump(prefill, decode, [&] { return !prefill.engine.last_peer_error().empty(); }));
  CHECK(prefill.engine.last_peer_error().find("pool 1 (window): window_tokens 8 here, 16 on decode-0") !=
        std::string::npos);
  // A one-pool peer against the 2-pool set: refused too, naming the pool counts.
  node one(clock, "decode-1", small_layout(), opt);
  peer_id q = one.engine.add_peer("127.0.0.1", port);
  one.engine.table().start_receive(2, q, {{0}});
  REQUIRE(pump(prefill, one, [&] { return one.released.count(2) > 0; }));
  CHECK(one.engine.last_peer_error().find("1 pools here (full), 2 on prefill-0 (full, window)") != std::string::npos);
}
