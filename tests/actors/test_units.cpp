// Unit tests of the actor layer's data structures: page allocator, radix cache, mailbox gate, wire.
#include <doctest/doctest.h>

#include "actors/common/protocol.h"
#include "actors/cache_tier/page_allocator.h"
#include "actors/cache_tier/radix_cache.h"
#include "actors/common/bounded_mailbox.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/common/wire.h"
#include "actors/worker/worker.h"

using namespace tandem;

TEST_CASE("page_allocator: alloc, refcount, free, exhaustion, double free") {
  page_allocator a(4);
  CHECK(a.n_free() == 4);
  auto p = a.alloc(3);
  REQUIRE(p.size() == 3);
  CHECK(a.n_free() == 1);
  CHECK(a.refcount(p[0]) == 1);
  a.ref(p[0]);
  CHECK(a.refcount(p[0]) == 2);
  CHECK_FALSE(a.unref(p[0]));
  CHECK(a.unref(p[0]));
  CHECK(a.n_free() == 2);
  // Exhaustion is explicit and allocates nothing.
  CHECK_FALSE(a.try_alloc(3).has_value());
  CHECK(a.n_free() == 2);
  try {
    a.alloc(3);
    FAIL("alloc beyond the pool must throw");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::overloaded);
  }
  CHECK(a.alloc_failures() == 2);
  // Double free and bad ids are detected.
  try {
    a.unref(p[0]);
    FAIL("double free must throw");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::failed);
    CHECK(std::string(e.what()).find("double free") != std::string::npos);
  }
  CHECK_THROWS_AS(a.ref(p[0]), tandem::error);
  CHECK_THROWS_AS(a.unref(99), tandem::error);
  a.unref_all(std::vector<int32_t>{p[1], p[2]});
  CHECK(a.n_free() == 4);
  CHECK_THROWS_AS(page_allocator(0), tandem::error);
}

TEST_CASE("radix_cache: insert, match whole pages, pinning and LRU eviction") {
  page_allocator a(8);
  radix_cache c(a, nullptr, radix_cache::options{.page_size = 2});
  std::vector<copy_op> ops;
  std::vector<int32_t> t1 = {1, 2, 3, 4, 5};
  auto p1 = a.alloc(3);  // 3 pages for 5 tokens; only 2 are full
  CHECK(c.insert(t1, p1, ops) == 2);
  CHECK(c.cached_pages() == 2);
  CHECK(a.refcount(p1[0]) == 2);
  CHECK(a.refcount(p1[2]) == 1);  // partial page not cached
  a.unref_all(p1);                // the request ends: cached pages stay, the partial one is free
  CHECK(a.n_free() == 6);

  auto m = c.match(std::vector<int32_t>{1, 2, 3, 4, 9}, 100, ops);
  CHECK(m.tokens == 4);
  CHECK(m.device_tokens == 4);
  CHECK(m.pages == std::vector<int32_t>{p1[0], p1[1]});
  CHECK(a.refcount(p1[0]) == 2);  // the match's reference for the caller
  c.finish_match(m, {});
  a.unref_all(m.pages);
  auto m2 = c.match(std::vector<int32_t>{1, 2, 3, 4}, 3, ops);  // max_tokens caps at whole pages
  CHECK(m2.tokens == 2);
  c.finish_match(m2, {});
  a.unref_all(m2.pages);
  auto m3 = c.match(std::vector<int32_t>{7, 2}, 100, ops);
  CHECK(m3.tokens == 0);
  c.finish_match(m3, {});

  // Inserting an already cached chunk keeps the existing page.
  auto p2 = a.alloc(2);
  CHECK(c.insert(std::vector<int32_t>{1, 2, 8, 8}, p2, ops) == 1);
  CHECK(a.refcount(p2[0]) == 1);
  a.unref_all(p2);
  CHECK(c.cached_pages() == 3);

  // Pin the {1,2,3,4} path (a request uses it): only the {8,8} leaf can go.
  auto pin = c.match(std::vector<int32_t>{1, 2, 3, 4}, 100, ops);
  c.finish_match(pin, {});
  auto all = c.alloc_device(a.n_free() + 1, ops);  // needs one eviction
  REQUIRE(all.has_value());
  CHECK(c.cached_pages() == 2);
  CHECK_FALSE(c.alloc_device(1, ops).has_value());  // everything left is pinned
  a.unref_all(*all);
  a.unref_all(pin.pages);
  // LRU: leaf {3,4} goes before its parent {1,2}.
  auto one = c.alloc_device(a.n_free() + 1, ops);
  REQUIRE(one.has_value());
  a.unref_all(*one);
  auto m4 = c.match(std::vector<int32_t>{1, 2, 3, 4}, 100, ops);
  CHECK(m4.tokens == 2);
  c.finish_match(m4, {});
  a.unref_all(m4.pages);
  CHECK(ops.empty());  // no host tier: nothing to copy
  c.clear();
  CHECK(c.cached_pages() == 0);
  CHECK(a.n_free() == 8);
}

TEST_CASE("radix_cache: least recently used leaf is evicted first") {
  page_allocator a(4);
  radix_cache c(a, nullptr, radix_cache::options{.page_size = 1});
  std::vector<copy_op> ops;
  auto pa = a.alloc(1), pb = a.alloc(1);
  c.insert(std::vector<int32_t>{10}, pa, ops);
  c.insert(std::vector<int32_t>{20}, pb, ops);
  a.unref_all(pa);
  a.unref_all(pb);
  auto m = c.match(std::vector<int32_t>{10}, 1, ops);  // {10} is now more recent than {20}
  c.finish_match(m, {});
  a.unref_all(m.pages);
  auto got = c.alloc_device(3, ops);
  REQUIRE(got.has_value());
  CHECK(c.cached_pages() == 1);
  a.unref_all(*got);
  auto m2 = c.match(std::vector<int32_t>{10}, 1, ops);
  CHECK(m2.tokens == 1);
  c.finish_match(m2, {});
  a.unref_all(m2.pages);
  CHECK(c.evictions(0) == 1);
}

TEST_CASE("mailbox_gate: bound hit gives overloaded, depth returns to 0") {
  mailbox_gate g("decode", 3);
  CHECK(g.try_enter());
  CHECK(g.try_enter());
  CHECK(g.try_enter());
  CHECK_FALSE(g.try_enter());
  CHECK(g.rejected() == 1);
  CHECK(g.depth() == 3);
  auto e = g.overloaded_error();
  CHECK(e.kind() == error_kind::overloaded);
  CHECK(std::string(e.what()).find("limits.decode_mailbox") != std::string::npos);
  g.enter_control();  // control messages are counted but never refused
  CHECK(g.depth() == 4);
  CHECK(g.high_water() == 4);
  for (int i = 0; i < 4; ++i) g.leave();
  CHECK(g.depth() == 0);
  CHECK(g.try_enter());
  g.leave();
  CHECK(g.depth() == 0);
  CHECK_THROWS_AS(mailbox_gate("x", 0), tandem::error);
}

TEST_CASE("wire: request round trip and malformed bytes") {
  seq_request r;
  r.id = "req-1";
  r.prompt = {1, 2, 3};
  r.generated = {7};
  r.stop_tokens = {9};
  r.sampling.temperature = 0.5f;
  r.sampling.seed = 42;
  r.max_tokens = 5;
  r.deadline_ms = 1234;
  r.admit_order = 3;
  auto w = make_role_wire<router_role, msg::submit>([&](schema::SubmitRequest::Builder b) { r.write(b); });
  // Unaligned copy: the reader must not depend on the vector's alignment.
  wire shifted;
  shifted.bytes = w.bytes;
  wire_reader rd(shifted);
  auto back = seq_request::read(rd.root().getRouter().getSubmit());
  CHECK(back.id == "req-1");
  CHECK(back.all_tokens() == std::vector<int32_t>{1, 2, 3, 7});
  CHECK(back.sampling.seed == 42);
  CHECK(back.deadline_ms == 1234);
  wire bad{{1, 2, 3}};
  CHECK_THROWS_AS(wire_reader{bad}, tandem::error);
  wire junk{std::vector<uint8_t>(64, 0xff)};
  CHECK_THROWS_AS(wire_reader{junk}, tandem::error);
}

TEST_CASE("stop rules: stop token, EOS, max_tokens, context") {
  model_facts m{2, 10, 64};
  seq_request r;
  r.prompt = {1, 1, 1, 1, 1, 1, 1};
  r.max_tokens = 5;
  r.stop_tokens = {9};
  CHECK(apply_token(r, 5, m) == finish_reason::none);
  CHECK(apply_token(r, 9, m) == finish_reason::stop);
  CHECK(r.generated.size() == 1);  // stop tokens are not part of the completion
  CHECK(apply_token(r, 2, m) == finish_reason::stop);
  r.ignore_eos = true;
  CHECK(apply_token(r, 2, m) == finish_reason::none);
  CHECK(apply_token(r, 3, m) == finish_reason::length);  // 7 + 3 = context 10
  CHECK(token_seed(1, 0) != token_seed(1, 1));
  CHECK(token_seed(1, 5) == token_seed(1, 5));
}

TEST_CASE("metrics: prometheus rendering") {
  histogram h("ttft_ms", "Time to first token", {1, 10});
  h.observe(0.5);
  h.observe(5);
  h.observe(50);
  auto w = make_stats_wire("router", {{"requests_total", "", 3, "counter", "Requests"}}, {&h});
  auto s = read_stats(w);
  auto text = render_prometheus({s});
  CHECK(text.find("# TYPE tandem_requests_total counter") != std::string::npos);
  CHECK(text.find("tandem_requests_total 3") != std::string::npos);
  CHECK(text.find("tandem_ttft_ms_bucket{le=\"1\"} 1") != std::string::npos);
  CHECK(text.find("tandem_ttft_ms_bucket{le=\"10\"} 2") != std::string::npos);
  CHECK(text.find("tandem_ttft_ms_bucket{le=\"+Inf\"} 3") != std::string::npos);
  CHECK(text.find("tandem_ttft_ms_count 3") != std::string::npos);
}
