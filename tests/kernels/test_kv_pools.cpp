// KV layouts as sets of pools: the pool arithmetic, the sets each architecture asks for, and
// gemma2's sliding-window layers in a bounded window pool giving the same bits as full-context
// pages.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/arch/dense_forward.h"
#include "kernels/model/kv_pools.h"
#include "kernels/model/seq_pages.h"
#include "tests/kernels/pool_sets.h"
#include "kernels/model/kv_pools_plan.h"
#include "kernels/model/make_model.h"
#include "tests/kernels/reference_model.h"

using namespace tandem;
using namespace tandem::test;

namespace {

kv_pool_spec window_spec(int32_t window, int32_t ps) {
  return kv_pool_spec{
      .name = "window", .page = kv_layout{1, 2, 8, ps}, .window_tokens = window, .layers = {0}};
}

/// Page ids of one pool handed out and taken back, as the cache tier's allocator does.
struct free_list {
  std::vector<int32_t> free;
  int32_t held = 0, max_held = 0;
  explicit free_list(int32_t n) {
    for (int32_t p = n - 1; p >= 0; --p) free.push_back(p);
  }
  int32_t take() {
    REQUIRE_MESSAGE(!free.empty(), "the pool ran out of pages");
    const int32_t p = free.back();
    free.pop_back();
    max_held = std::max(max_held, ++held);
    return p;
  }
  void give(int32_t p) {
    free.push_back(p);
    --held;
  }
};

/// The token fed at position p (fixed, so runs compare step by step).
int32_t token_at(int32_t p) { return (p * 7 + 3) % 50; }

/// Runs one sequence of `total` tokens (chunks of `chunk`, then one token per step) and returns
/// every step's logits. pooled: the model's pool set, window pages released once dead and
/// poisoned with NaN (a read of one would show); else one full-context pool of every layer.
std::vector<std::vector<float>> run_sequence(llama_model& m, int32_t ps, int32_t total, int32_t chunk,
                                             bool pooled, int32_t& max_window_pages,
                                             int32_t& window_pages_after_steps) {
  const kv_pools_layout set = pooled ? m.pools_layout(ps) : kv_pools_layout::single(m.layout(ps));
  std::vector<int32_t> n_pages;
  for (const kv_pool_spec& s : set.pools) n_pages.push_back(s.max_pages(total, chunk));
  kv_pools pools(set, n_pages);
  std::vector<free_list> lists;
  for (int32_t n : n_pages) lists.emplace_back(n);
  std::vector<std::vector<int32_t>> tables(set.pools.size());
  std::vector<int32_t> toks;
  for (int32_t p = 0; p < total; ++p) toks.push_back(token_at(p));
  std::vector<std::vector<float>> out;
  window_pages_after_steps = 0;
  for (int32_t pos = 0; pos < total;) {
    const int32_t n = std::min(pos < 2 * chunk ? chunk : 1, total - pos);
    const int32_t blocks = (pos + n + ps - 1) / ps;
    for (size_t k = 0; k < tables.size(); ++k)
      while (int32_t(tables[k].size()) < blocks) tables[k].push_back(lists[k].take());
    std::vector<std::span<const int32_t>> spans(tables.begin(), tables.end());
    batch_seq s{std::span(toks).subspan(size_t(pos), size_t(n)), pos, tables[0], true};
    if (spans.size() > 1) s.pool_pages = spans;
    std::vector<float> logits;
    m.forward(std::span(&s, 1), pools, logits);
    out.push_back(logits);
    pos += n;
    for (size_t k = 0; k < tables.size(); ++k) {
      std::vector<int32_t> freed;
      release_dead_blocks(set.pools[k], pos, tables[k], freed);
      for (int32_t p : freed) {
        auto* f = reinterpret_cast<float*>(pools[k].page_data(p));
        std::fill(f, f + pools[k].page_bytes() / sizeof(float), std::numeric_limits<float>::quiet_NaN());
        lists[k].give(p);
      }
      if (set.pools[k].window_tokens > 0)
        window_pages_after_steps = std::max(window_pages_after_steps, lists[k].held);
    }
  }
  max_window_pages = 0;
  for (size_t k = 0; k < set.pools.size(); ++k)
    if (set.pools[k].window_tokens > 0) max_window_pages = lists[k].max_held;
  return out;
}

}  // namespace

TEST_CASE("kv pools: a window pool's live blocks, ring bound and released blocks") {
  const kv_pool_spec w = window_spec(32, 8);
  CHECK(w.first_live_block(0) == 0);
  CHECK(w.first_live_block(31) == 0);  // reads positions 0..31
  CHECK(w.first_live_block(40) == 1);  // reads 9..40
  CHECK(w.first_live_block(48) == 2);  // reads 17..48
  CHECK(w.max_pages(200, 1) == 5);     // ceil(32 / 8) + 1
  CHECK(w.max_pages(16, 1) == 2);      // never more than the blocks there are
  CHECK(w.max_pages(200, 16) == 7);    // a 16-token chunk reads 47 positions: 7 blocks at worst
  kv_pool_spec full = w;
  full.window_tokens = 0;
  CHECK(full.first_live_block(1000) == 0);
  CHECK(full.max_pages(200, 1) == 25);
  std::vector<int32_t> table = {4, 9, 2, 7, 1}, freed;
  release_dead_blocks(w, 40, table, freed);  // block 0 (0..7) is out of reach of 40 - 31 = 9
  CHECK(table == std::vector<int32_t>{-1, 9, 2, 7, 1});
  CHECK(freed == std::vector<int32_t>{4});
  release_dead_blocks(w, 40, table, freed);  // nothing twice
  CHECK(freed.size() == 1);
  release_dead_blocks(full, 1000, table, freed);
  CHECK(freed.size() == 1);
}

TEST_CASE("kv pools: every architecture but gemma2 keeps one full pool, gemma2 adds a window pool") {
  tiny_model llama(ggml_type::f32, 3);
  auto lm = make_cpu_llama(llama.w);
  CHECK(lm->pools_layout(16) == kv_pools_layout::single(lm->layout(16)));
  tiny_model gemma(ggml_type::f32, 3, arch_features{.neox = true, .gemma2 = true, .window = 32});
  auto gm = make_cpu_llama(gemma.w);
  const kv_pools_layout set = gm->pools_layout(16);
  REQUIRE(set.pools.size() == 2);
  CHECK(set.pools[0].name == "full");
  CHECK(set.pools[0].window_tokens == 0);
  CHECK(set.pools[0].layers == std::vector<int32_t>{1});  // odd layers attend globally
  CHECK(set.pools[1].name == "window");
  CHECK(set.pools[1].window_tokens == 32);
  CHECK(set.pools[1].layers == std::vector<int32_t>{0});
  CHECK(set.pools[1].page.n_layers == 1);
  CHECK(set.block_bytes() == gm->layout(16).page_bytes());
  set.check(2);
  CHECK_THROWS_WITH_AS(set.check(3), doctest::Contains("layer 2 is in no pool"), tandem::error);
  kv_pools_layout bad = set;
  bad.pools[1].page.page_size = 8;
  CHECK_THROWS_WITH_AS(bad.check(2), doctest::Contains("page size 8"), tandem::error);
  // A pool set the model does not take is refused naming both.
  kv_pools_layout narrow = set;
  narrow.pools[1].window_tokens = 16;
  kv_pools wrong(narrow, std::vector<int32_t>{4, 4});
  const std::vector<int32_t> toks = {1, 2}, pages = {0};
  const std::span<const int32_t> tables[] = {pages, pages};
  batch_seq s{toks, 0, pages, true, tables};
  std::vector<float> logits;
  CHECK_THROWS_WITH_AS(gm->forward(std::span(&s, 1), wrong, logits), doctest::Contains("window=16"),
                       tandem::error);
  s.pool_pages = {};
  // One page table for two pools is refused naming the pools.
  kv_pools two(set, std::vector<int32_t>{4, 4});
  CHECK_THROWS_WITH_AS(gm->forward(std::span(&s, 1), two, logits),
                       doctest::Contains("1 page tables for 2 KV pools"), tandem::error);
}

TEST_CASE("kv pools: gemma2's window pool holds at most ceil(W/ps)+1 pages and gives the full-context bits") {
  for (const int32_t ps : {4, 8, 16}) {
    CAPTURE(ps);
    tiny_model m(ggml_type::f16, 11, arch_features{.neox = true, .gemma2 = true, .window = 32});
    m.cfg.n_ctx = m.w.config.n_ctx = 256;
    auto model = make_cpu_llama(m.w, cpu_options{.threads = 2});
    int32_t max_full = 0, after_full = 0, max_pooled = 0, after_pooled = 0;
    const auto ref = run_sequence(*model, ps, 200, 12, false, max_full, after_full);
    const auto got = run_sequence(*model, ps, 200, 12, true, max_pooled, after_pooled);
    REQUIRE(got.size() == ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      REQUIRE(got[i].size() == ref[i].size());
      REQUIRE(std::memcmp(got[i].data(), ref[i].data(), got[i].size() * sizeof(float)) == 0);
    }
    // Between steps a sequence holds the ring; a 12-token chunk's step a little more.
    CHECK(after_pooled <= (32 + ps - 1) / ps + 1);
    CHECK(max_pooled <= model->pools_layout(ps).pools[1].max_pages(200, 12));
    CHECK(max_pooled < (200 + ps - 1) / ps);
  }
}

TEST_CASE("kv pools: a pooled sequence's bits do not depend on its batch") {
  tiny_model m(ggml_type::f32, 5, arch_features{.neox = true, .gemma2 = true, .window = 6});
  auto model = make_cpu_llama(m.w);
  const kv_pools_layout set = model->pools_layout(4);
  const std::vector<int32_t> prompt = {3, 17, 42, 0, 49, 8, 8, 21, 5, 33, 11, 30, 2}, other = {9, 8, 7, 6, 5};
  // Sequence a's window table starts with a released block (-1): its step at 9 reads 4..
  const std::vector<int32_t> fa = {0, 1, 2, 3}, wa = {0, 1, 2, 3}, fb = {4, 5}, wb = {4, 5};
  kv_pools alone(set, std::vector<int32_t>{8, 8}), mixed(set, std::vector<int32_t>{8, 8});
  std::vector<float> la, lm;
  const std::span<const int32_t> ta[] = {fa, wa}, tb[] = {fb, wb};
  batch_seq a{std::span(prompt).first(9), 0, fa, true, ta};
  model->forward(std::span(&a, 1), alone, la);
  model->forward(std::span(&a, 1), mixed, lm);
  const std::vector<int32_t> wa_released = {-1, 1, 2, 3};
  const std::span<const int32_t> ta2[] = {fa, wa_released};
  batch_seq a2{std::span(prompt).subspan(9), 9, fa, true, ta2};
  model->forward(std::span(&a2, 1), alone, la);
  const batch_seq batch[] = {{other, 0, fb, true, tb}, a2};
  model->forward(batch, mixed, lm);
  REQUIRE(lm.size() == 2 * la.size());
  CHECK(std::memcmp(la.data(), lm.data() + la.size(), la.size() * sizeof(float)) == 0);
}

TEST_CASE("kv pools: a sequence's page tables grow per pool and give back dead window blocks") {
  const kv_pools_layout set{
      .pools = {kv_pool_spec{.name = "full", .page = kv_layout{1, 2, 8, 4}, .layers = {1}},
                window_spec(6, 4)}};
  pool_pages t(2);
  CHECK(pages_lacking(t, 9, 4) == std::vector<int32_t>{3, 3});
  t[0] = {7, 8, 9};
  t[1] = {1, 2, 3};
  CHECK(pages_lacking(t, 12, 4) == std::vector<int32_t>{0, 0});
  CHECK(pages_lacking(t, 13, 4) == std::vector<int32_t>{1, 1});
  pool_pages freed;
  CHECK(release_dead_pages(set, 9, t, freed) == 1);  // the token at 9 reads 4..9: block 0 is dead
  CHECK(freed[0].empty());
  CHECK(freed[1] == std::vector<int32_t>{1});
  CHECK(t[1] == std::vector<int32_t>{-1, 2, 3});
  CHECK(pages_held(t) == std::vector<int32_t>{3, 2});
  CHECK(holds_pages(t));
  CHECK(first_blocks(t, 2) == pool_pages{{7, 8}, {-1, 2}});
  CHECK_FALSE(holds_pages(pool_pages{{-1}, {}}));
  // Admission counts each pool; refusal names the pool.
  CHECK(set.max_pages(100, 1) == std::vector<int32_t>{25, 3});
  set.check_fits(std::vector<int32_t>{25, 3}, 100, 1);
  CHECK_THROWS_WITH_AS(set.check_fits(std::vector<int32_t>{25, 2}, 100, 1),
                       doctest::Contains("3 pages of the window KV pool, which has 2"), tandem::error);
  CHECK_THROWS_WITH_AS(set.check_fits(std::vector<int32_t>{24, 3}, 100, 1),
                       doctest::Contains("the full KV pool"), tandem::error);
}

TEST_CASE("seq_pages: a chunked prefill rotates its own window pages, shared ones are freed") {
  const auto set = two_small_pools(4);  // a step starting at p reads blocks >= (p - 3) / 2
  // 12 tokens = 6 blocks; block 0 came from the prefix cache (page 50, shared); 4 fresh pages.
  pool_pages t{{10, 11, 12, 13, 14, 15}, {50, 60, 61, 62, 63, -1}};
  pool_pages freed;
  rotate_window_pages(set, 2, 6, 1, 2, t, freed);  // reads from block 0: nothing moves
  CHECK(t[1] == std::vector<int32_t>{50, 60, 61, 62, 63, -1});
  CHECK(freed[1].empty());
  rotate_window_pages(set, 6, 10, 1, 2, t, freed);  // block 0 dies: shared, so freed, not reused
  CHECK(freed[1] == std::vector<int32_t>{50});
  CHECK(t[1] == std::vector<int32_t>{-1, 60, 61, 62, 63, -1});
  freed.clear();
  rotate_window_pages(set, 10, 12, 1, 2, t, freed);  // blocks 1, 2 die: their pages move on
  CHECK(t[1] == std::vector<int32_t>{-1, -1, -1, 62, 63, 61});
  CHECK(freed[1] == std::vector<int32_t>{60});  // no block left to take it
  CHECK(pages_held(t) == std::vector<int32_t>{6, 3});
  // Shared pages are never written: with blocks 0..2 shared, block 5 has no page to take.
  pool_pages t2{{10, 11, 12, 13, 14, 15}, {50, 51, 52, 62, 63, -1}};
  freed.clear();
  CHECK_THROWS_WITH_AS(rotate_window_pages(set, 10, 12, 3, 2, t2, freed), doctest::Contains("'window'"),
                       tandem::error);
  // After the last step: the next token at 12 reads blocks >= 4.
  pool_pages dead;
  CHECK(release_dead_pages(set, 12, t, dead) == 1);
  CHECK(dead[1] == std::vector<int32_t>{62});
  CHECK(pages_held(t) == std::vector<int32_t>{6, 2});
  CHECK(pages_lacking(t, 13, 2) == std::vector<int32_t>{1, 1});
  CHECK(first_blocks(t, 2)[1] == std::vector<int32_t>{-1, -1});
  CHECK(holds_pages(t));
  CHECK_FALSE(holds_pages(pool_pages{{}, {-1, -1}}));
}

TEST_CASE("kv pools: a cached prefix is usable only with its window state, else shortened") {
  const kv_pools_layout set{
      .pools = {kv_pool_spec{.name = "full", .page = kv_layout{1, 2, 8, 4}, .layers = {1}},
                window_spec(6, 4)}};
  // 5 full blocks (20 tokens) cached; the window pool released blocks 0..2.
  auto have = [](std::vector<int> full, std::vector<int> window) {
    return [=](size_t pool, int64_t b) {
      const auto& v = pool == 0 ? full : window;
      return b < int64_t(v.size()) && v[size_t(b)] != 0;
    };
  };
  // P = 20: the next token at 20 reads 15..19, blocks 3 and 4: present.
  CHECK(usable_prefix(set, 20, have({1, 1, 1, 1, 1}, {0, 0, 0, 1, 1})) == 20);
  // Block 4 of the window is gone too: P = 20 fails, P = 16 needs blocks 2 and 3: 2 is gone;
  // P = 12 needs 1, 2: gone ... down to 0.
  CHECK(usable_prefix(set, 20, have({1, 1, 1, 1, 1}, {0, 0, 0, 1, 0})) == 0);
  // Window blocks 1 and 2 kept: P = 12 works (reads 7..11).
  CHECK(usable_prefix(set, 20, have({1, 1, 1, 1, 1}, {0, 1, 1, 0, 0})) == 12);
  // A missing full block caps the prefix whatever the window holds.
  CHECK(usable_prefix(set, 20, have({1, 1, 0, 1, 1}, {1, 1, 1, 1, 1})) == 8);
  // Whole pages only; a single-pool set needs only its blocks.
  CHECK(usable_prefix(set, 3, have({1}, {1})) == 0);
  const kv_pools_layout one = kv_pools_layout::single(kv_layout{2, 2, 8, 4});
  CHECK(usable_prefix(one, 22, have({1, 1, 1, 1, 1, 1}, {})) == 20);
}

TEST_CASE("kv pools: a make-model gemma2 file (window 32) gives the same bits in pools past its window") {
  for (const ggml_type t : {ggml_type::f16, ggml_type::q8_0}) {
    CAPTURE(int(t));
    const std::string path =
        (std::filesystem::temp_directory_path() / fmt::format("tandem-test-kv-pools-{}.gguf", int(t)))
            .string();
    make_model_options opt;
    opt.preset = "micro";
    opt.arch = "gemma2";
    opt.dtype = t;
    write_random_llama(opt, path);
    auto f = gguf::file::open(path);
    auto model = llama_model::load(f, cpu_options{.threads = 2});
    REQUIRE(model->config().sliding_window == 32);
    const int32_t total = std::min(100, model->config().n_ctx);
    REQUIRE(total > 64);
    int32_t max_full = 0, after_full = 0, max_pooled = 0, after_pooled = 0;
    const auto ref = run_sequence(*model, 16, total, 16, false, max_full, after_full);
    const auto got = run_sequence(*model, 16, total, 16, true, max_pooled, after_pooled);
    REQUIRE(got.size() == ref.size());
    for (size_t i = 0; i < got.size(); ++i)
      REQUIRE(std::memcmp(got[i].data(), ref[i].data(), got[i].size() * sizeof(float)) == 0);
    CHECK(after_pooled <= 3);  // ceil(32 / 16) + 1
    std::filesystem::remove(path);
  }
}
