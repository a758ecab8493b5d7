// The staging path of a device-resident KV pool (kernels/backend/page_staging.h) on a fake
// device (tests/fake_device.h): bounded slots, and page copies through the pinned ring that
// arrive byte-exact, count their copies and leave every buffer free.
#include <doctest/doctest.h>

#include <cstring>
#include <random>

#include "kernels/backend/page_staging.h"
#include "kernels/base/error.h"
#include "tests/fake_device.h"

using namespace tandem;
using namespace tandem::backend;

namespace {

kv_pools_layout one_pool() {
  kv_layout l;
  l.n_layers = 2;
  l.n_kv_heads = 2;
  l.head_dim = 8;
  l.page_size = 4;
  return kv_pools_layout::single(l);
}

void fill(uint8_t* p, size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  for (size_t i = 0; i < n; ++i) p[i] = uint8_t(g());
}

}  // namespace

TEST_CASE("staging_slots: a fixed number of slots, all or none, refusals counted, double release refused") {
  staging_slots s(4);
  auto a = s.acquire(3);
  REQUIRE(a);
  CHECK(*a == std::vector<int32_t>{0, 1, 2});
  CHECK(s.in_use() == 3);
  CHECK_FALSE(s.acquire(2));  // only one left: none taken
  CHECK(s.in_use() == 3);
  CHECK(s.refused() == 1);
  auto b = s.acquire(1);
  REQUIRE(b);
  CHECK(s.high_water() == 4);
  s.release(*a);
  CHECK(s.in_use() == 1);
  CHECK_THROWS_AS(s.release(*a), tandem::error);
  CHECK_THROWS_AS(s.release(std::vector<int32_t>{7}), tandem::error);
  s.release(*b);
  CHECK(s.in_use() == 0);
  CHECK(s.capacity() == 4);
  auto c = s.acquire(4);  // every slot is back
  REQUIRE(c);
  CHECK(*c == std::vector<int32_t>{0, 1, 2, 3});
}

TEST_CASE("page_stager: a host-tier round trip of a device pool through a ring of 3 pinned buffers") {
  auto st = std::make_shared<test::fake_device_state>();
  const backend::device dev = test::make_fake_device(st);
  const kv_pools_layout set = one_pool();
  const std::vector<int32_t> dev_pages{24}, host_pages{16};
  auto pools = dev.make_pools(set, dev_pages);
  kv_pools host(set, host_pages);
  kv_pool& d = (*pools)[0];
  kv_pool& h = host[0];
  const size_t pb = d.page_bytes();
  for (int32_t p = 0; p < 16; ++p) fill(d.page_data(p), pb, uint32_t(p + 1));
  {
    // Buffers of 100 bytes: each page goes in several parts, the ring wraps many times.
    page_stager stager(dev.staging, 3, 100);
    CHECK(st->pinned_allocs == 3);
    // Device pages 2..9 out to host pages 9..2 (write-back to the host tier).
    std::vector<page_copy> out;
    for (int32_t i = 0; i < 8; ++i) out.push_back({h.page_data(9 - i), d.page_data(2 + i), pb});
    stager.to_host(out);
    CHECK(stager.busy() == 0);
    for (int32_t i = 0; i < 8; ++i) CHECK(std::memcmp(h.page_data(9 - i), d.page_data(2 + i), pb) == 0);
    CHECK(st->queue.empty());
    CHECK(stager.buffer_waits() > 0);  // the ring of 3 was full many times, never grown
    CHECK(st->pinned_allocs == 3);
    // ... and back into other device pages (a load-back on a hit).
    std::vector<page_copy> in;
    for (int32_t i = 0; i < 8; ++i) in.push_back({d.page_data(23 - i), h.page_data(9 - i), pb});
    stager.to_device(in);
    CHECK(stager.busy() == 0);
    for (int32_t i = 0; i < 8; ++i) CHECK(std::memcmp(d.page_data(23 - i), d.page_data(2 + i), pb) == 0);
    const int64_t parts = int64_t((pb + 99) / 100) * 16;
    CHECK(stager.copies() == parts);
    CHECK(st->staged_copies == parts);
    CHECK(stager.bytes() == int64_t(16 * pb));
    CHECK(st->plain_copies == 0);
    CHECK(st->quiesces == 2);
  }
  CHECK(st->pinned_frees == 3);  // every buffer returned
  CHECK(st->pinned_ranges.empty());
}

TEST_CASE("page_stager: copies that bypass the pinned buffers are refused by the fake device") {
  auto st = std::make_shared<test::fake_device_state>();
  const backend::device dev = test::make_fake_device(st);
  std::vector<uint8_t> a(64), b(64);
  // Host to host is no staging copy: the fake device throws, as a misuse must be visible.
  CHECK_THROWS(dev.staging.copy_async(a.data(), b.data(), 64));
  CHECK_THROWS_AS(page_stager(dev.staging, 0, 64), tandem::error);
  CHECK_THROWS_AS(page_stager(backend::staging_ops{}, 2, 64), tandem::error);
}
