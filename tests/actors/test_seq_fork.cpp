/// The copy-on-write bookkeeping of n > 1 forks (actors/common/seq_fork.h) against a real page
/// allocator: every fork shares the blocks before the one it writes first, owns a copy of that
/// one, and after the sequence and all its forks free their tables every page is free again.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "actors/cache_tier/page_allocator.h"
#include "actors/common/seq_fork.h"

using namespace tandem;

namespace {

/// What the cache tier does for a fork request: a reference per held page, fresh pages for copies.
pool_pages take_forks(std::vector<page_allocator*> pools, const fork_request& fr) {
  pool_pages got(pools.size());
  for (size_t p = 0; p < pools.size(); ++p) {
    for (auto x : fr.holds[p]) pools[p]->ref(x);
    got[p] = pools[p]->alloc(fr.counts[p]);
  }
  return got;
}

void free_tables(std::vector<page_allocator*> pools, const pool_pages& t) {
  for (size_t p = 0; p < t.size(); ++p)
    for (auto x : t[p])
      if (x >= 0) pools[p]->unref(x);
}

}  // namespace

TEST_CASE("fork plan: blocks before the last prompt position are shared, its block is copied") {
  // 10 prompt tokens, page size 4: positions 0..9 in blocks 0..2; a fork writes from 9 (block 2).
  pool_pages t = {{5, 6, 7}};
  auto plan = plan_fork(t, 9, 4);
  CHECK(plan.copy_block == 2);
  CHECK(plan.shared[0] == std::vector<int32_t>{5, 6});
  CHECK(plan.copy_from[0] == 7);
  auto tab = fork_tables(t, plan, std::vector<int32_t>{11});
  CHECK(tab[0] == std::vector<int32_t>{5, 6, 11});
  // 8 prompt tokens: position 7 is the last of block 1, which is copied; nothing after it.
  auto plan8 = plan_fork(pool_pages{{1, 2, 3}}, 7, 4);
  CHECK(plan8.copy_block == 1);
  CHECK(plan8.shared[0] == std::vector<int32_t>{1});
  CHECK(plan8.copy_from[0] == 2);
  CHECK(fork_tables(pool_pages{{1, 2, 3}}, plan8, std::vector<int32_t>{9})[0] == std::vector<int32_t>{1, 9});
  // A one-token prompt shares nothing.
  auto plan1 = plan_fork(pool_pages{{4}}, 0, 4);
  CHECK(plan1.shared[0].empty());
  CHECK(plan1.copy_from[0] == 4);
}

TEST_CASE("forks: refcounts, distinct copies, and every page back after the forks and the sequence end") {
  for (int32_t prompt : {1, 4, 5, 9, 16, 17}) {
    CAPTURE(prompt);
    page_allocator dev(64), win(64);
    std::vector<page_allocator*> pools = {&dev, &win};
    const int32_t ps = 4;
    const int32_t blocks = (prompt + ps - 1) / ps;
    // The sequence's tables: a full pool, and a window pool whose block 0 was released (-1).
    pool_pages t(2);
    t[0] = dev.alloc(blocks);
    t[1] = win.alloc(blocks);
    if (blocks > 2) {
      win.unref(t[1][0]);
      t[1][0] = -1;
    }
    const int32_t free0 = dev.n_free(), free1 = win.n_free();
    const int32_t forks = 3;
    auto plan = plan_fork(t, prompt - 1, ps);
    auto fr = make_fork_request(plan, forks);
    auto got = take_forks(pools, fr);
    std::vector<pool_pages> tabs;
    for (int32_t k = 0; k < forks; ++k) tabs.push_back(fork_tables(t, plan, fork_copies(plan, got, k)));
    // Each fork: the same shared pages, its own page at copy_block, never the sequence's.
    std::set<int32_t> copies;
    for (const auto& ft : tabs) {
      for (size_t p = 0; p < 2; ++p) {
        REQUIRE(ft[p].size() == size_t(plan.copy_block) + 1);
        for (int64_t b = 0; b < plan.copy_block; ++b) CHECK(ft[p][size_t(b)] == t[p][size_t(b)]);
        const int32_t own = ft[p][size_t(plan.copy_block)];
        CHECK(own >= 0);
        CHECK(own != t[p][size_t(plan.copy_block)]);
        CHECK(copies.insert(own + int32_t(p) * 1000).second);
      }
    }
    // A shared page has one reference from the sequence and one per fork.
    for (int64_t b = 0; b < plan.copy_block; ++b) {
      CHECK(dev.refcount(t[0][size_t(b)]) == 1 + forks);
      if (t[1][size_t(b)] >= 0) CHECK(win.refcount(t[1][size_t(b)]) == 1 + forks);
    }
    CHECK(dev.n_free() == free0 - forks);
    CHECK(win.n_free() == free1 - forks);
    // Forks end in any order, the sequence in the middle: every page comes back exactly once.
    free_tables(pools, tabs[1]);
    free_tables(pools, t);
    free_tables(pools, tabs[0]);
    free_tables(pools, tabs[2]);
    CHECK(dev.n_free() == 64);
    CHECK(win.n_free() == 64);
  }
}
