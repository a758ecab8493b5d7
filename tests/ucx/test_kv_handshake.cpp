// The KV handshake and descriptor messages as untrusted input (what tests/fuzz/fuzz_kv fuzzes).
#include <doctest/doctest.h>

#include "kernels/base/error.h"
#include "transport/ucx/kv_handshake.h"

using namespace tandem::ucx;

namespace {

kv_hello hello() {
  kv_hello h;
  h.id.node = "p";
  h.id.model = "r15m";
  h.id.layout.n_layers = 2;
  h.id.layout.n_kv_heads = 2;
  h.id.layout.head_dim = 8;
  h.id.layout.page_size = 16;
  h.n_pages = 4;
  h.rkey = {1, 2};
  return h;
}

std::string decode_error(const std::vector<uint8_t>& b) {
  try {
    decode_hello(b.data(), b.size());
  } catch (const tandem::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("kv handshake: a hello round-trips, and no pages, truncation or trailing bytes are refused") {
  auto b = encode_hello(hello());
  auto h = decode_hello(b.data(), b.size());
  CHECK(h.id.model == "r15m");
  CHECK(h.n_pages == 4);
  CHECK(h.rkey == std::vector<uint8_t>{1, 2});

  auto none = hello();
  none.n_pages = 0;
  CHECK(decode_error(encode_hello(none)).find("offers a pool of 0 pages") != std::string::npos);
  auto trailing = b;
  trailing.push_back(0);
  CHECK(decode_error(trailing).find("trailing bytes") != std::string::npos);
  auto truncated = b;
  truncated.pop_back();
  CHECK(decode_error(truncated).find("truncated KV handshake") != std::string::npos);
}

TEST_CASE("kv descriptors: exact sizes, and page ids checked against the pool") {
  auto b = encode_descriptors({42, {{0, 3, 1}}});
  auto d = decode_descriptors(b.data(), b.size());
  CHECK(d.transfer == 42);
  CHECK(d.pages == tandem::pool_pages{{0, 3, 1}});
  CHECK(check_page_ids(d.pages[0], 4).empty());
  CHECK(check_page_ids({0, 4}, 4) == "page id 4 (entry 1) is outside the pool of 4 pages");
  CHECK(check_page_ids({-1}, 4).find("page id -1") != std::string::npos);
  b.push_back(0);
  CHECK_THROWS_WITH(decode_descriptors(b.data(), b.size()), "malformed KV descriptor message");
  CHECK_THROWS_WITH(decode_descriptors(b.data(), 11), "short KV descriptor message");
  // Several pools, released blocks included; a count past the message is refused.
  const tandem::pool_pages two = {{4, 5}, {-1, 7, 8}};
  auto b2 = encode_descriptors({43, two});
  CHECK(decode_descriptors(b2.data(), b2.size()).pages == two);
  b2[12] = 200;  // pool 0 claims 200 pages
  CHECK_THROWS_WITH(decode_descriptors(b2.data(), b2.size()), "malformed KV descriptor message");
  auto none = encode_descriptors({44, {}});
  CHECK_THROWS_WITH(decode_descriptors(none.data(), none.size()), "malformed KV descriptor message");
}

namespace {

tandem::kv_pools_layout window_set(int32_t window) {
  tandem::kv_layout page = hello().id.layout;
  page.n_layers = 1;
  return tandem::kv_pools_layout{.pools = {{.name = "full", .page = page, .window_tokens = 0, .layers = {1}},
                                           {.name = "window", .page = page, .window_tokens = window, .layers = {0}}}};
}

}  // namespace

TEST_CASE("kv handshake: a layout set travels with one region per pool, and a different window is named") {
  auto h = hello();
  h.id.pools = window_set(32);
  h.id.layout = h.id.pools.pools[0].page;
  h.extra_pools = {{0x1000, 6, {7, 7}}};
  const auto b = encode_hello(h);
  const auto got = decode_hello(b.data(), b.size());
  CHECK(got.id.set() == h.id.set());
  REQUIRE(got.extra_pools.size() == 1);
  CHECK(got.extra_pools[0].base == 0x1000);
  CHECK(got.extra_pools[0].n_pages == 6);
  CHECK(got.extra_pools[0].rkey == std::vector<uint8_t>{7, 7});
  CHECK(check_compatible(h.id, got.id).empty());
  CHECK(got.id.describe().find("window: layers=[0]") != std::string::npos);

  auto other = h;
  other.id.node = "decode-1";
  other.id.pools = window_set(64);
  const std::string why = check_compatible(h.id, other.id);
  CAPTURE(why);
  CHECK(why.find("pool 1 (window): window_tokens 32 here, 64 on decode-1") != std::string::npos);
  CHECK(why.find("serve the same model") != std::string::npos);

  // A region missing for a pool, or one of no pages, is refused.
  auto missing = h;
  missing.extra_pools.clear();
  CHECK(decode_error(encode_hello(missing)).find("offers 1 pool regions for a layout set of 2 pools") !=
        std::string::npos);
  auto empty = h;
  empty.extra_pools[0].n_pages = 0;
  CHECK(decode_error(encode_hello(empty)).find("0 pages for pool 1 (window)") != std::string::npos);
}

TEST_CASE("kv handshake: the page element type travels, and an f16 node refuses an f32 peer by name") {
  auto f16 = hello();
  f16.id.layout.dtype = tandem::kv_dtype::f16;
  f16.id.dtype = "f16";
  auto b = encode_hello(f16);
  auto h = decode_hello(b.data(), b.size());
  CHECK(h.id.dtype == "f16");
  CHECK(h.id.layout.dtype == tandem::kv_dtype::f16);
  CHECK(h.id.layout == f16.id.layout);
  CHECK(check_compatible(f16.id, h.id).empty());
  const auto f32 = hello();
  const std::string why = check_compatible(f16.id, f32.id);
  CHECK(why.find("dtype: here f16 vs peer f32") != std::string::npos);
  CHECK(why.find("kv=f16") != std::string::npos);  // the layout, as each side describes it
}

TEST_CASE("kv handshake: a latent layout's components travel, and a standard peer is refused naming both") {
  auto mla = hello();
  mla.id.layout.n_kv_heads = 1;
  mla.id.layout.head_dim = 80;
  mla.id.layout.components = {tandem::kv_component{"latent", 1, 80, 4}};
  const auto b = encode_hello(mla);
  const auto h = decode_hello(b.data(), b.size());
  CHECK(h.id.layout == mla.id.layout);
  CHECK(check_compatible(mla.id, h.id).empty());
  // The same head count and size without the component: the pages mean different things.
  auto standard = mla;
  standard.id.layout.components.clear();
  const std::string why = check_compatible(mla.id, standard.id);
  CHECK(why.find("components: here latent:1x80x4 vs peer standard K/V") != std::string::npos);
  // A component that could not be a real one is refused at decode.
  auto bad = mla;
  bad.id.layout.components[0].elem_bytes = 3;
  const auto bb = encode_hello(bad);
  CHECK(decode_error(bb).find("component latent has 3 bytes per element") != std::string::npos);
}
