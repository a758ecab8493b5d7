// KV layouts of several pools through the cache tier: a sequence's window pages (rotation in
// chunked prefill, release of blocks no step reads), the radix cache keeping a page per pool and
// block (a prefix is reused only with the window its next token reads, in any tier), and a
// gemma2 model served with its sliding-window layers in a pool of rings.
// The served-model cases run on the test scheduler (tests/actors/cluster_rig.h): the forward
// passes run on the test's thread.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>

#include "actors/cache_tier/radix_cache.h"
#include "actors/common/seq_pages.h"
#include "actors/runtime/embedded_cluster.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/actors/model_files.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"
#include "tests/kernels/pool_sets.h"

using namespace tandem;
using namespace tandem::test;

namespace {

int count(const std::vector<copy_op>& ops, copy_op::kind_t k, int32_t pool) {
  int n = 0;
  for (const auto& o : ops) n += o.kind == k && o.pool == pool;
  return n;
}

}  // namespace

TEST_CASE("radix_cache(pools): a prefix is reused only with its window, never longer, and window pages evict alone") {
  const auto set = two_small_pools(4);
  page_allocator dev(8), win(8);
  radix_cache::options o;
  o.page_size = 2;
  o.pools = set;
  radix_cache c({&dev, &win}, nullptr, o);
  std::vector<copy_op> ops;
  // A finished sequence of 10 tokens: 5 full blocks; its window pool kept blocks 3 and 4.
  std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto p = dev.alloc(5);
  auto w = win.alloc(2);
  std::vector<std::vector<int32_t>> x = {{-1, -1, -1, w[0], w[1]}};
  CHECK(c.insert(t, p, ops, true, x) == 5);
  dev.unref_all(p);
  win.unref_all(w);
  CHECK(c.cached_pool_pages(1) == 2);
  CHECK(win.n_evictable() == 2);

  // The next turn (t ++ 2 tokens): resuming at 10 reads window blocks 3, 4: reused.
  auto t2 = t;
  t2.push_back(11);
  t2.push_back(12);
  auto m = c.match(t2, 11, ops);
  CHECK(m.tokens == 10);
  REQUIRE(m.xpages.size() == 1);
  CHECK(m.xpages[0] == std::vector<int32_t>{-1, -1, -1, w[0], w[1]});
  CHECK(c.finish_match(m, {}) == 10);
  CHECK(win.refcount(w[0]) == 2);
  dev.unref_all(m.pages);
  for (auto v : m.xpages[0])
    if (v >= 0) win.unref(v);

  // A prompt that leaves at block 4: resuming at 8 needs blocks 2, 3; block 2's window state
  // was released, and so for every shorter end: a miss, never a wrong answer.
  std::vector<int32_t> t3 = {1, 2, 3, 4, 5, 6, 7, 8, 99, 98, 97};
  auto m3 = c.match(t3, 10, ops);
  CHECK(m3.tokens == 0);
  CHECK(m3.pages.empty());
  c.finish_match(m3, {});

  // Window pressure: all 8 window pages wanted; the 2 cached go, pool 0's pages stay.
  auto all = c.alloc_pool(1, 8, ops);
  REQUIRE(all.has_value());
  CHECK(c.cached_pool_pages(1) == 0);
  CHECK(c.cached_pages() == 5);
  CHECK_FALSE(c.alloc_pool(1, 1, ops).has_value());
  win.unref_all(*all);
  auto m4 = c.match(t2, 11, ops);
  CHECK(m4.tokens == 0);  // the window is gone: the prefix is not usable any more
  c.finish_match(m4, {});
  c.clear();
  CHECK(dev.n_free() == 8);
  CHECK(win.n_free() == 8);
}

TEST_CASE("radix_cache(pools): host slots and disk files carry the window pages, loads bring back the live ones") {
  const auto set = two_small_pools(4);
  page_allocator dev(8), win(8), host(8);
  radix_cache::options o;
  o.page_size = 2;
  o.pools = set;
  o.policy = cache_write_policy::write_through;
  o.disk_pages = 16;
  radix_cache c({&dev, &win}, &host, o);
  std::vector<copy_op> ops;
  std::vector<int32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto p = dev.alloc(5);
  auto w = win.alloc(2);
  std::vector<std::vector<int32_t>> x = {{-1, -1, -1, w[0], w[1]}};
  c.insert(t, p, ops, true, x);
  dev.unref_all(p);
  win.unref_all(w);
  CHECK(count(ops, copy_op::device_to_host, 0) == 5);
  CHECK(count(ops, copy_op::device_to_host, 1) == 2);
  CHECK(count(ops, copy_op::host_to_disk, 0) == 5);
  CHECK(count(ops, copy_op::host_to_disk, 1) == 2);
  ops.clear();

  // Device evicted (every pool-0 page wanted): blocks live on in host slots with their window.
  auto d = c.alloc_device(8, ops);
  REQUIRE(d.has_value());
  CHECK(c.cached_pages() == 0);
  CHECK(c.cached_pool_pages(1) == 0);
  CHECK(win.n_free() == 8);
  dev.unref_all(*d);
  ops.clear();
  auto t2 = t;
  t2.push_back(11);
  t2.push_back(12);
  auto m = c.match(t2, 11, ops);
  CHECK(m.tokens == 10);
  CHECK(m.host_tokens == 10);
  CHECK(count(ops, copy_op::host_to_device, 0) == 5);
  CHECK(count(ops, copy_op::host_to_device, 1) == 2);  // only the blocks the window reads
  CHECK(m.xpages[0][0] == -1);
  CHECK(m.xpages[0][3] >= 0);
  CHECK(c.finish_match(m, {}) == 10);
  dev.unref_all(m.pages);
  for (auto v : m.xpages[0])
    if (v >= 0) win.unref(v);

  // Memory tiers gone (a restart): disk files per pool bring the prefix back.
  c.clear();
  ops.clear();
  auto md = c.match(t2, 11, ops);
  CHECK(md.tokens == 10);
  CHECK(md.disk_tokens == 10);
  CHECK(count(ops, copy_op::disk_to_host, 1) == 2);
  CHECK(c.finish_match(md, {}) == 10);
  CHECK(c.cached_pool_pages(1) == 2);
  dev.unref_all(md.pages);
  for (auto v : md.xpages[0])
    if (v >= 0) win.unref(v);

  // A window file that fails to read: the whole match is given up (-1), the entry dropped.
  c.clear();
  ops.clear();
  auto mf = c.match(t2, 11, ops);
  REQUIRE(mf.disk.size() == 5);
  const uint32_t bad = static_cast<uint32_t>(mf.disk[4].xop[0]);
  CHECK(c.finish_match(mf, std::span<const uint32_t>(&bad, 1)) == -1);
  CHECK(c.disk_read_failures() == 1);
  dev.unref_all(mf.pages);
  for (auto v : mf.xpages[0])
    if (v >= 0) win.unref(v);
  c.clear();
  CHECK(dev.n_free() == 8);
  CHECK(win.n_free() == 8);
  CHECK(host.n_free() == 8);
}

TEST_CASE("radix_cache(pools): each pool has host pages of its own, a window host page is evicted alone") {
  // Window 4 tokens = 2 blocks of 2: a 5-block prefix reads blocks 3 and 4 of the window pool.
  const auto set = two_small_pools(4);
  page_allocator dev(8), win(8), host(8), whost(2);  // the window pool's host share: 2 pages
  radix_cache::options o;
  o.page_size = 2;
  o.pools = set;
  o.policy = cache_write_policy::write_through;
  radix_cache c({&dev, &win}, std::vector<page_allocator*>{&host, &whost}, o);
  std::vector<copy_op> ops;
  auto insert = [&](const std::vector<int32_t>& t) {
    auto p = dev.alloc(int32_t(t.size() / 2));
    auto w = win.alloc(2);
    std::vector<std::vector<int32_t>> x(1, std::vector<int32_t>(p.size(), -1));
    x[0][p.size() - 2] = w[0];
    x[0][p.size() - 1] = w[1];
    c.insert(t, p, ops, true, x);
    dev.unref_all(p);
    win.unref_all(w);
  };
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  insert(a);
  // Every block's pool-0 page backed up into pool 0's host pages, the two window pages into the
  // window pool's own: no window host page for blocks without a window page.
  CHECK(count(ops, copy_op::device_to_host, 0) == 5);
  CHECK(count(ops, copy_op::device_to_host, 1) == 2);
  CHECK(host.n_free() == 3);
  CHECK(whost.n_free() == 0);
  CHECK(c.host_cached_pool_pages(0) == 5);
  CHECK(c.host_cached_pool_pages(1) == 2);
  for (const auto& op : ops)
    if (op.kind == copy_op::device_to_host && op.pool == 1) CHECK(op.host < 2);  // ids of the pool's own allocator
  ops.clear();

  // A second prompt's window pages need the window pool's host pages: a's (LRU) go, alone.
  const std::vector<int32_t> b = {21, 22, 23, 24};
  insert(b);
  CHECK(count(ops, copy_op::device_to_host, 1) == 2);
  CHECK(c.host_cached_pool_pages(1) == 2);
  CHECK(c.host_cached_pages() == 7);  // pool 0's host pages were enough for both: a kept its five
  CHECK(host.n_free() == 1);
  ops.clear();

  // Device gone: a's usable prefix from host must stop where its window pages are missing.
  auto d = c.alloc_device(8, ops);
  REQUIRE(d.has_value());
  dev.unref_all(*d);
  ops.clear();
  auto ta = a;
  ta.push_back(11);
  auto m = c.match(ta, 11, ops);
  CHECK(m.tokens < 10);  // the window pages of blocks 3 and 4 were evicted from host: not usable at 10
  CHECK(c.finish_match(m, {}) == m.tokens);
  dev.unref_all(m.pages);
  for (const auto& xp : m.xpages)
    for (auto v : xp)
      if (v >= 0) win.unref(v);
  // b comes back whole, window pages from the window pool's host pages.
  ops.clear();
  auto tb = b;
  tb.push_back(25);
  auto mb = c.match(tb, 5, ops);
  CHECK(mb.tokens == 4);
  CHECK(mb.host_tokens == 4);
  CHECK(count(ops, copy_op::host_to_device, 1) == 2);
  CHECK(c.finish_match(mb, {}) == 4);
  dev.unref_all(mb.pages);
  for (auto v : mb.xpages[0])
    if (v >= 0) win.unref(v);
  c.clear();
  CHECK(dev.n_free() == 8);
  CHECK(win.n_free() == 8);
  CHECK(host.n_free() == 8);
  CHECK(whost.n_free() == 2);
}

namespace {

const std::string& gemma_path() {
  make_model_options o;
  o.preset = "micro";
  o.arch = "gemma2";
  o.sliding_window = 32;
  o.seed = 5;
  return test_model_file("pools_gemma2", o);
}

cluster_options gemma_opts(bool prefix_cache) {
  cluster_options o;
  o.model_path = gemma_path();
  o.lim.page_size = 8;
  o.lim.device_pages = 64;
  o.lim.prefill_chunk_tokens = 16;
  o.lim.max_running_seqs = 4;
  o.lim.max_prefill_batch_seqs = 2;
  o.lim.prefix_cache = prefix_cache;
  o.log_level = "warn";
  return o;
}

std::vector<std::vector<int32_t>> run_all(embedded_rig& c, const std::vector<completion_request>& reqs,
                                          bool one_by_one, std::vector<int32_t>* cached = nullptr) {
  collector col;
  int done = 0;
  for (const auto& r : reqs) {
    c.submit(r, col.cb());
    if (one_by_one) REQUIRE(col.wait_finished(++done));
  }
  REQUIRE(col.wait_finished(static_cast<int>(reqs.size())));
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : reqs) {
    auto last = col.last(r.request_id);
    if (last.err) FAIL_CHECK(last.err->what());
    out.push_back(col.tokens(r.request_id));
    if (cached) cached->push_back(last.cached_tokens);
  }
  return out;
}

double metric(const std::string& text, const std::string& name) {
  auto at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

}  // namespace

TEST_CASE("embedded_cluster(gemma2): window layers in a pool of rings, same output with and without the prefix cache") {
  std::vector<completion_request> reqs;
  std::vector<std::vector<int32_t>> on, off, together;
  std::vector<int32_t> cached_on;
  {
    auto c = std::make_unique<embedded_rig>(gemma_opts(true));
    // A conversation that grows past the window (32) and the chunk (16): each turn repeats
    // the last prompt and the answer, so the cache can resume right where the window is.
    std::vector<int32_t> p = c->tok().encode("a long shared system prompt that runs past the sliding window", true);
    for (int i = 0; i < 4; ++i) {
      for (auto t : c->tok().encode(" and turn number " + std::to_string(i * 13 + 1), false)) p.push_back(t);
      reqs.push_back(make_req("g" + std::to_string(i), p, 20));
    }
    REQUIRE(reqs.back().prompt.size() > 48);
    on = run_all(*c, reqs, true, &cached_on);
    const auto text = c->metrics_text();
    // The window pool holds rings: fewer pages than the full pool, all back once idle.
    const double win_total = metric(text, "tandem_kv_pool_pages_total{pool=\"window\"}");
    const double full_total = metric(text, "tandem_kv_pool_pages_total{pool=\"full\"}");
    CHECK(win_total > 0);
    CHECK(full_total == 64);
    CHECK(win_total < full_total);
    CHECK(metric(text, "tandem_kv_pool_pages_free{pool=\"window\"}") +
              metric(text, "tandem_kv_pool_pages_cached{pool=\"window\"}") ==
          win_total);
    together = run_all(*c, reqs, false);
  }
  {
    auto c = std::make_unique<embedded_rig>(gemma_opts(false));
    off = run_all(*c, reqs, true);
  }
  CHECK(on == off);
  CHECK(together == off);
  int hits = 0;
  for (auto x : cached_on) hits += x > 0;
  CHECK(hits >= 1);
}

TEST_CASE("embedded_cluster(gemma2): an absolute host tier is split across the pools, inspect shows each") {
  std::vector<completion_request> reqs;
  std::vector<std::vector<int32_t>> with_host, without;
  auto conversation = [&](embedded_rig& c) {
    std::vector<int32_t> p = c.tok().encode("a long shared system prompt that runs past the sliding window", true);
    for (int i = 0; i < 4; ++i) {
      for (auto t : c.tok().encode(" and turn number " + std::to_string(i * 7 + 3), false)) p.push_back(t);
      reqs.push_back(make_req("h" + std::to_string(i), p, 12));
    }
  };
  {
    auto o = gemma_opts(true);
    o.cache.host_size_gb = 0.004;
    o.cache.write_policy = cache_write_policy::write_through;
    auto c = std::make_unique<embedded_rig>(o);
    conversation(*c);
    with_host = run_all(*c, reqs, true);
    const auto r = c->inspect();
    const pool_report* full = nullptr;
    const pool_report* win = nullptr;
    for (const auto& p : r.pools) {
      if (p.name == "host:full") full = &p;
      if (p.name == "host:window") win = &p;
    }
    REQUIRE(full != nullptr);
    REQUIRE(win != nullptr);
    CHECK(full->pages_total > 0);
    CHECK(win->pages_total > 0);
    CHECK(win->pages_total < full->pages_total);  // in proportion to the pools' device bytes
    CHECK(full->pages_cached > 0);
    CHECK(win->pages_cached > 0);  // write-through: the window pages of cached blocks backed up too
    const auto text = c->metrics_text();
    CHECK(metric(text, "tandem_kv_pool_host_pages_total{pool=\"window\"}") == double(win->pages_total));
  }
  {
    auto c = std::make_unique<embedded_rig>(gemma_opts(false));
    without = run_all(*c, reqs, true);
  }
  CHECK(with_host == without);
}
