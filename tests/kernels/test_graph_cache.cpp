// Which decode steps run as graphs (kernels/backend/graph_cache.h): a key's first step is
// eager, later ones are captured; failed keys stay eager; the graphs kept are bounded (least
// recently used dropped, each dropped handle destroyed once); the counters add up.
#include <doctest/doctest.h>

#include <map>
#include <vector>

#include "kernels/backend/graph_cache.h"

using namespace tandem::backend;

namespace {

/// Handles are ints cast to pointers; destroy counts per handle.
struct handles {
  std::map<intptr_t, int> destroyed;
  graph_cache make(size_t max) {
    return graph_cache(max, [this](void* g) { ++destroyed[reinterpret_cast<intptr_t>(g)]; });
  }
};
void* h(intptr_t i) { return reinterpret_cast<void*>(i); }

}  // namespace

TEST_CASE("graph cache: context buckets double from 256") {
  CHECK(context_bucket(1) == 256);
  CHECK(context_bucket(256) == 256);
  CHECK(context_bucket(257) == 512);
  CHECK(context_bucket(4096) == 4096);
  CHECK(context_bucket(4097) == 8192);
  CHECK(context_bucket(1 << 30) == (1 << 30));
}

TEST_CASE("graph cache: first step eager, then capture, and a kept graph is found and replaced") {
  handles hs;
  {
    graph_cache c(4, [&](void* g) { ++hs.destroyed[reinterpret_cast<intptr_t>(g)]; });
    const graph_key a{.batch = 8, .ctx_bucket = 512}, b{.batch = 8, .ctx_bucket = 1024};
    CHECK(c.on_step(a) == graph_cache::action::eager);
    CHECK(c.on_step(a) == graph_cache::action::capture);
    CHECK(c.graph(a) == nullptr);
    c.keep(a, h(1));
    CHECK(c.on_step(a) == graph_cache::action::capture);
    CHECK(c.graph(a) == h(1));
    c.replayed();
    CHECK(c.on_step(b) == graph_cache::action::eager);
    // A re-instantiated graph replaces the old one, which is destroyed.
    c.keep(a, h(2));
    CHECK(hs.destroyed[1] == 1);
    CHECK(c.graph(a) == h(2));
    const graph_stats s = c.stats();
    CHECK(s.eager == 2);
    CHECK(s.captures == 2);
    CHECK(s.replays == 1);
    CHECK(s.graphs == 1);
    CHECK(s.failures == 0);
  }
  // The cache destroys what it still holds.
  CHECK(hs.destroyed[2] == 1);
}

TEST_CASE("graph cache: a failed key stays eager and loses its graph") {
  handles hs;
  graph_cache c = hs.make(4);
  const graph_key k{.batch = 1, .ctx_bucket = 256};
  c.on_step(k);
  CHECK(c.on_step(k) == graph_cache::action::capture);
  c.keep(k, h(7));
  c.failed(k);
  CHECK(hs.destroyed[7] == 1);
  CHECK(c.graph(k) == nullptr);
  for (int i = 0; i < 3; ++i) CHECK(c.on_step(k) == graph_cache::action::eager);
  CHECK(c.stats().failures == 1);
  CHECK(c.stats().eager == 4);
}

TEST_CASE("graph cache: at most max graphs, least recently used evicted, 0 turns graphs off") {
  handles hs;
  graph_cache c = hs.make(2);
  const graph_key k1{.batch = 1, .ctx_bucket = 256}, k2{.batch = 2, .ctx_bucket = 256}, k3{.batch = 3, .ctx_bucket = 256};
  for (const graph_key& k : {k1, k2, k3}) c.on_step(k);
  c.keep(k1, h(1));
  c.keep(k2, h(2));
  CHECK(c.graph(k1) == h(1));  // k1 now most recent: k2 goes next
  c.keep(k3, h(3));
  CHECK(c.stats().evictions == 1);
  CHECK(c.stats().graphs == 2);
  CHECK(hs.destroyed[2] == 1);
  CHECK(c.graph(k2) == nullptr);
  CHECK(c.graph(k1) == h(1));
  CHECK(c.graph(k3) == h(3));
  // An evicted key captures again on its next step (it was seen).
  CHECK(c.on_step(k2) == graph_cache::action::capture);

  graph_cache off = hs.make(0);
  for (int i = 0; i < 3; ++i) CHECK(off.on_step(k1) == graph_cache::action::eager);
  CHECK(off.stats().eager == 3);
}
