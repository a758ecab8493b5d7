// The per-pool transfer manifest: XXH3 digests of pages, its wire form and its check.
#include <doctest/doctest.h>
#include <xxhash.h>

#include <cstring>

#include "kernels/base/error.h"
#include "transport/ucx/kv_manifest.h"
#include "transport/ucx/kv_port_ucx.h"

using namespace tandem;
using namespace tandem::ucx;

namespace {

kv_layout tiny() { return kv_layout{.n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .page_size = 2}; }

kv_pools_layout two_named() {
  kv_layout a = tiny(), b = tiny();
  a.n_layers = b.n_layers = 1;
  return kv_pools_layout{.pools = {{.name = "full", .page = a, .window_tokens = 0, .layers = {0}},
                                   {.name = "window", .page = b, .window_tokens = 4, .layers = {1}}}};
}

}  // namespace

TEST_CASE("kv manifest: a digest is XXH3-64 of the listed pages' bytes in order, holes skipped") {
  kv_pool pool(tiny(), 6);
  for (int32_t p = 0; p < 6; ++p)
    for (size_t i = 0; i < pool.page_bytes(); ++i) pool.page_data(p)[i] = uint8_t(p * 13 + i);
  // Reference: the pages concatenated, hashed in one call.
  std::vector<uint8_t> cat;
  for (int32_t p : {4, 1, 3}) cat.insert(cat.end(), pool.page_data(p), pool.page_data(p) + pool.page_bytes());
  const pool_digest d = digest_pages(pool, std::vector<int32_t>{-1, 4, 1, -1, 3});
  CHECK(d.pages == 3);
  CHECK(d.hash == XXH3_64bits(cat.data(), cat.size()));
  // Order matters, one flipped bit matters, nothing is the empty hash.
  CHECK(digest_pages(pool, std::vector<int32_t>{1, 4, 3}).hash != d.hash);
  pool.page_data(1)[5] ^= 0x10;
  CHECK(digest_pages(pool, std::vector<int32_t>{4, 1, 3}).hash != d.hash);
  CHECK(digest_pages(pool, std::vector<int32_t>{-1}) == pool_digest{0, XXH3_64bits(nullptr, 0)});
}

TEST_CASE("kv manifest: notifications round-trip and malformed ones are refused") {
  const kv_notify done{77, notify_kind::done, {{3, 0x1122334455667788ull}, {0, 9}}};
  const auto b = encode_notify(done);
  CHECK(b.size() == 10 + 2 * 12);
  const kv_notify got = decode_notify(b.data(), b.size());
  CHECK(got.transfer == 77);
  CHECK(got.kind == notify_kind::done);
  CHECK(got.manifest == done.manifest);
  const auto c = encode_notify({78, notify_kind::cancel, {}});
  CHECK(c.size() == 9);
  CHECK(decode_notify(c.data(), c.size()).kind == notify_kind::cancel);
  auto longer = c;
  longer.push_back(0);
  CHECK_THROWS_WITH(decode_notify(longer.data(), longer.size()), "malformed KV notification");
  CHECK_THROWS_WITH(decode_notify(b.data(), b.size() - 1), "malformed KV manifest");
  auto many = b;
  many[9] = 9;  // more pools than a set has
  CHECK_THROWS_WITH(decode_notify(many.data(), many.size()), "malformed KV manifest");
  auto kind = c;
  kind[8] = 7;
  CHECK_THROWS_WITH(decode_notify(kind.data(), kind.size()), "unknown KV notification kind");
}

TEST_CASE("kv manifest: the check names the pool and says count or checksum") {
  const kv_manifest here = {{4, 10}, {2, 20}};
  fail_reason r{};
  CHECK(check_manifest(here, here, two_named(), r).empty());
  std::string why = check_manifest({{4, 10}, {0, 0}}, here, two_named(), r);
  CHECK(r == fail_reason::manifest);
  CHECK(why.find("pool 1 (window): the source wrote 0 pages, 2 were expected") != std::string::npos);
  why = check_manifest({{4, 10}}, here, two_named(), r);
  CHECK(r == fail_reason::manifest);
  CHECK(why.find("pool 1 (window) is missing") != std::string::npos);
  why = check_manifest({{4, 11}, {2, 20}}, here, two_named(), r);
  CHECK(r == fail_reason::checksum);
  CHECK(why.find("pool 0 (full): checksum 000000000000000a of the 4 pages received differs from the source's "
                 "000000000000000b") != std::string::npos);
}

TEST_CASE("kv manifest: TANDEM_KV_FAULT names a pool to drop or flip in every transfer") {
  const fault_hook drop = fault_hook_from_spec("put:drop-pool:1");
  for (transfer_id id : {1, 2}) {
    const fault_decision d = drop(fault_point::put, id, notify_kind::started);
    CHECK(d.action == fault_action::drop);
    CHECK(d.pool == 1);
  }
  CHECK(drop(fault_point::notify, 1, notify_kind::done).action == fault_action::pass);
  const fault_decision f = fault_hook_from_spec("put:flip-pool:0")(fault_point::put, 3, notify_kind::started);
  CHECK(f.action == fault_action::corrupt);
  CHECK(f.pool == 0);
  // The whole-transfer faults keep pool -1.
  CHECK(fault_hook_from_spec("put:drop:1")(fault_point::put, 1, notify_kind::started).pool == -1);
  for (const char* bad : {"put:flip-pool:8", "notify:drop-pool:1", "put:drop-pool:x", "put:flip-pool:-1"})
    CHECK_THROWS_WITH_AS(fault_hook_from_spec(bad), doctest::Contains("put:drop-pool:P"), tandem::error);
}
