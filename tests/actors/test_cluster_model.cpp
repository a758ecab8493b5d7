// The embedded cluster with a real (random-weight) micro Llama written by write_random_llama.
// On the test scheduler (tests/actors/cluster_rig.h): the forward passes run on the test's thread.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "actors/runtime/embedded_cluster.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tests/actors/model_files.h"
#include "tests/actors/cluster_rig.h"
#include "tests/actors/support.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// One micro model file per test process (written once, removed at exit).
const std::string& micro_path() {
  make_model_options o;
  o.preset = "micro";
  o.seed = 7;
  return test_model_file("micro", o);
}

cluster_options micro_opts(bool prefix_cache) {
  cluster_options o;
  o.model_path = micro_path();
  o.lim.page_size = 16;
  o.lim.device_pages = 96;
  o.lim.prefill_chunk_tokens = 32;
  o.lim.prefix_cache = prefix_cache;
  o.log_level = "warn";
  return o;
}

std::vector<std::vector<int32_t>> run(embedded_rig& c, const std::vector<completion_request>& reqs,
                                      bool one_by_one, std::vector<int32_t>* cached = nullptr) {
  collector col;
  if (one_by_one) {
    int done = 0;
    for (const auto& r : reqs) {
      c.submit(r, col.cb());
      REQUIRE(col.wait_finished(++done));
    }
  } else {
    for (const auto& r : reqs) c.submit(r, col.cb());
    REQUIRE(col.wait_finished(static_cast<int>(reqs.size())));
  }
  std::vector<std::vector<int32_t>> out;
  for (const auto& r : reqs) {
    auto last = col.last(r.request_id);
    if (last.err) FAIL_CHECK(last.err->what());
    CHECK(last.reason == finish_reason::length);
    out.push_back(col.tokens(r.request_id));
    if (cached) cached->push_back(last.cached_tokens);
  }
  CHECK(col.duplicate_finishes == 0);
  return out;
}

std::vector<completion_request> prompts(const tokenizer& tok, float temperature) {
  const char* texts[] = {"the quick brown fox",
                         "hello world, this is a test of the serving runtime",
                         "once upon a time",
                         "a",
                         "paged attention keeps the cache in pages of sixteen tokens each",
                         "numbers 1 2 3 4 5 6 7 8 9 10",
                         "the quick brown fox jumps over the lazy dog",
                         "tandem"};
  std::vector<completion_request> reqs;
  for (int i = 0; i < 8; ++i) {
    auto r = make_req("m" + std::to_string(i), tok.encode(texts[i], true), 6 + i * 3, temperature, 11 + i);
    reqs.push_back(std::move(r));
  }
  return reqs;
}

}  // namespace

TEST_CASE("embedded_cluster(micro): greedy output alone == 8 concurrent (batching invariance)") {
  auto c = std::make_unique<embedded_rig>(micro_opts(false));
  CHECK(c->max_context() == 512);
  CHECK_FALSE(c->model_id().empty());
  CHECK(c->health().ok);
  auto reqs = prompts(c->tok(), 0.0f);
  auto alone = run(*c, reqs, true);
  auto together = run(*c, reqs, false);
  CHECK(alone == together);
  for (size_t i = 0; i < reqs.size(); ++i) CHECK(alone[i].size() == size_t(reqs[i].max_tokens));
  auto st = c->stats();
  CHECK(st.requests_total == 16);
  CHECK(st.kv_pages_total == 96);
  auto text = c->metrics_text();
  CHECK(text.find("tandem_requests_total 16") != std::string::npos);
  CHECK(text.find("tandem_worker_forward_ms_bucket") != std::string::npos);
}

TEST_CASE("embedded_cluster(micro): seeded sampling alone == concurrent") {
  auto c = std::make_unique<embedded_rig>(micro_opts(true));
  auto reqs = prompts(c->tok(), 0.9f);
  CHECK(run(*c, reqs, true) == run(*c, reqs, false));
}

TEST_CASE("embedded_cluster(micro): prefix cache on vs off gives identical output and counts hits") {
  std::vector<completion_request> reqs;
  std::vector<std::vector<int32_t>> on, off;
  std::vector<int32_t> cached_on, cached_off;
  {
    auto c = std::make_unique<embedded_rig>(micro_opts(true));
    auto base = c->tok().encode(
        "a shared system prompt that is long enough to fill a few pages of the cache, "
        "followed by a question number",
        true);
    REQUIRE(base.size() > 20);
    for (int i = 0; i < 4; ++i) {
      auto p = base;
      for (auto t : c->tok().encode(" " + std::to_string(i * 37), false)) p.push_back(t);
      reqs.push_back(make_req("c" + std::to_string(i), p, 8));
    }
    on = run(*c, reqs, true, &cached_on);
    auto text = c->metrics_text();
    CHECK(text.find("tandem_prefix_cache_hits_total 3") != std::string::npos);
  }
  {
    auto c = std::make_unique<embedded_rig>(micro_opts(false));
    off = run(*c, reqs, true, &cached_off);
  }
  CHECK(on == off);
  CHECK(cached_on[0] == 0);
  for (int i = 1; i < 4; ++i) CHECK(cached_on[i] >= 16);
  for (auto x : cached_off) CHECK(x == 0);
}

TEST_CASE("embedded_cluster(micro): an f16 KV cache serves batched, prefix-cached requests like one at a time") {
  // Pages hold halves: the prefix cache shares them and the decode reads them in batches;
  // every request still gives what it gives alone, and no page is lost.
  auto o = micro_opts(true);
  o.kv_cache_dtype = "f16";
  auto c = std::make_unique<embedded_rig>(o);
  auto reqs = prompts(c->tok(), 0.0f);
  auto alone = run(*c, reqs, true);
  auto together = run(*c, reqs, false);
  CHECK(alone == together);
  CHECK(c->stats().kv_pages_total == 96);
  // The device pool is 96 pages of halves (micro: 2 layers, 2 KV heads of 16).
  const kv_layout half{.n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .page_size = 16, .dtype = kv_dtype::f16};
  bool seen = false;
  for (const auto& p : c->inspect().pools)
    if (p.name == "device") {
      seen = true;
      CHECK(p.bytes == int64_t(96 * half.page_bytes()));
    }
  CHECK(seen);
  o.kv_cache_dtype = "fp16";
  CHECK_THROWS_WITH(embedded_cluster::start(o), doctest::Contains("'fp16' is not a KV cache type; use f32 or f16"));
}

TEST_CASE("embedded_cluster: bad limits and a missing model fail with a message") {
  auto o = micro_opts(true);
  o.lim.page_size = 0;
  try {
    embedded_cluster::start(o);
    FAIL("bad limits must throw");
  } catch (const tandem::error& e) {
    CHECK(std::string(e.what()).find("page_size") != std::string::npos);
  }
  o = micro_opts(true);
  o.model_path = "/nonexistent/model.gguf";
  CHECK_THROWS_AS(embedded_cluster::start(o), tandem::error);
}

TEST_CASE("embedded_cluster(micro): penalties and logit_bias travel to the worker's sampler") {
  auto c = std::make_unique<embedded_rig>(micro_opts(false));
  auto base = make_req("plain", c->tok().encode("numbers 1 2 3 4 5 6 7 8 9 10", true), 24, 0.0f, 1);
  auto plain = run(*c, {base}, true)[0];
  REQUIRE(plain.size() == 24);
  // A bias of -100 on the greedy first token changes it (prefill samples it).
  auto biased = base;
  biased.request_id = "biased";
  biased.sampling.logit_bias = {{plain[0], -100.0f}};
  auto b = run(*c, {biased}, true)[0];
  CHECK(b[0] != plain[0]);
  CHECK(std::find(b.begin(), b.end(), plain[0]) == b.end());  // every step (decode too) sees the bias
  // A strong frequency penalty: no token repeats more than the unpenalized output's first token does.
  auto pen = base;
  pen.request_id = "penalized";
  pen.sampling.frequency_penalty = 2.0f;
  pen.sampling.presence_penalty = 2.0f;
  pen.sampling.repetition_penalty = 2.0f;
  auto p = run(*c, {pen}, true)[0];
  REQUIRE(p.size() == 24);
  auto max_repeats = [](std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    int best = 0;
    for (size_t i = 0; i < v.size();) {
      size_t j = i;
      while (j < v.size() && v[j] == v[i]) ++j;
      best = std::max(best, int(j - i));
      i = j;
    }
    return best;
  };
  INFO("plain repeats " << max_repeats(plain) << ", penalized " << max_repeats(p));
  CHECK(p != plain);
  CHECK(max_repeats(p) <= max_repeats(plain));
  // min_p with sampling runs end to end.
  auto mp = base;
  mp.request_id = "min_p";
  mp.sampling.temperature = 1.0f;
  mp.sampling.min_p = 0.2f;
  CHECK(run(*c, {mp}, true)[0].size() == 24);
}
