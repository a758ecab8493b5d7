// KvLayout with its pools on the wire: one codec for the UCX handshake and the handoff.
#include <doctest/doctest.h>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>

#include "actors/common/kv_layout_wire.h"
#include "kernels/base/error.h"

using namespace tandem;

namespace {

kv_layout page(int32_t layers) {
  return kv_layout{.n_layers = layers, .n_kv_heads = 2, .head_dim = 8, .page_size = 16};
}

/// gemma2-like: global layers 1, 3 in "full", sliding layers 0, 2 in "window".
kv_pools_layout gemma_like(int32_t window) {
  return kv_pools_layout{.pools = {{.name = "full", .page = page(2), .window_tokens = 0, .layers = {1, 3}},
                                   {.name = "window", .page = page(2), .window_tokens = window, .layers = {0, 2}}}};
}

kj::Array<capnp::word> bytes_of(capnp::MallocMessageBuilder& mb) { return capnp::messageToFlatArray(mb); }

/// Writes `set`, then lets `edit` spoil the message before it is read back.
template <class Edit>
std::string read_error(const kv_pools_layout& set, Edit edit) {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<schema::KvLayout>();
  write_kv_pools_layout(b, set);
  edit(b);
  try {
    read_kv_pools_layout(b.asReader());
  } catch (const tandem::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("kv layout wire: a one-pool set writes exactly the single layout's bytes") {
  const kv_layout l = page(4);
  capnp::MallocMessageBuilder a, b;
  write_kv_layout(a.initRoot<schema::KvLayout>(), l);
  write_kv_pools_layout(b.initRoot<schema::KvLayout>(), kv_pools_layout::single(l));
  const auto wa = bytes_of(a), wb = bytes_of(b);
  REQUIRE(wa.size() == wb.size());
  CHECK(std::memcmp(wa.begin(), wb.begin(), wa.size() * sizeof(capnp::word)) == 0);
  // And a message written by the single-layout codec reads as the one-pool set.
  CHECK(read_kv_pools_layout(a.getRoot<schema::KvLayout>().asReader()) == kv_pools_layout::single(l));
}

TEST_CASE("kv layout wire: a set of pools round-trips, its fields are pool 0's page") {
  capnp::MallocMessageBuilder mb;
  auto b = mb.initRoot<schema::KvLayout>();
  write_kv_pools_layout(b, gemma_like(32));
  CHECK(read_kv_layout(b.asReader()) == page(2));  // a reader that predates pools sees pool 0
  CHECK(read_kv_pools_layout(b.asReader()) == gemma_like(32));
  // One pool holding a window is not the plain single pool: its pools are written.
  kv_pools_layout one_window{.pools = {{.name = "window", .page = page(2), .window_tokens = 8, .layers = {0, 1}}}};
  capnp::MallocMessageBuilder m2;
  auto b2 = m2.initRoot<schema::KvLayout>();
  write_kv_pools_layout(b2, one_window);
  CHECK(b2.getPools().size() == 1);
  CHECK(read_kv_pools_layout(b2.asReader()) == one_window);
}

TEST_CASE("kv layout wire: untrusted sets are refused naming the field") {
  const auto set = gemma_like(32);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].getLayers().set(0, 1); }).find("layer 1") != std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].getLayers().set(1, 9); }).find("layer 9") != std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].getLayers().set(0, 2); }).find("must ascend") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].setName("full"); }).find("two pools are named full") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].setName(""); }).find("needs a name") != std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].getPage().setPageSize(32); }).find("page size 32") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].setWindowTokens(-1); }).find("window_tokens -1") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[0].getPage().setHeadDim(16); }).find("pool 0 (full) has page") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].getPage().initPools(1); }).find("nests pools") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.getPools()[1].initLayers(1).set(0, 0); }).find("lists 1 layers") !=
        std::string::npos);
  CHECK(read_error(set, [](auto b) { b.initPools(9); }).find("9 pools, at most 8") != std::string::npos);
}

TEST_CASE("kv layout wire: a mismatch names both sides' values per pool") {
  CHECK(explain_kv_pools_mismatch(gemma_like(32), gemma_like(32), "decode-1").empty());
  CHECK(explain_kv_pools_mismatch(gemma_like(32), gemma_like(64), "decode-1") ==
        "pool 1 (window): window_tokens 32 here, 64 on decode-1");
  auto other = gemma_like(32);
  other.pools[0].page.dtype = kv_dtype::f16;
  other.pools[1].page.dtype = kv_dtype::f16;
  const std::string dt = explain_kv_pools_mismatch(gemma_like(32), other, "the handoff");
  CHECK(dt.find("pool 0 (full): dtype f32 here, f16 on the handoff") != std::string::npos);
  CHECK(dt.find("pool 1 (window): dtype f32 here, f16 on the handoff") != std::string::npos);
  const std::string n = explain_kv_pools_mismatch(kv_pools_layout::single(page(4)), gemma_like(32), "prefill-0");
  CHECK(n.find("1 pools here (full), 2 on prefill-0 (full, window)") != std::string::npos);
  CHECK(n.find("pool 0 (full): layers [0,1,2,3] here, [1,3] on prefill-0") != std::string::npos);
}
