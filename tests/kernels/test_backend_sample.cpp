// The backend sample op (backend::ops::sample) and forward_sample: the draw with a given
// uniform equals the sampler's own draw bit for bit, the CPU backend's op equals the host
// sampler plus compute_logprobs, and a model's forward_sample equals forward() then the
// sampler the worker runs. (The CUDA op is held to this by tests/gpu/sampling_check.cpp.)
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend/cpu_backend.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"
#include "kernels/model/logprobs.h"
#include "kernels/model/make_model.h"
#include "kernels/model/sampler.h"

using namespace tandem;

namespace {

std::vector<float> random_row(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<sampling_params> param_grid() {
  std::vector<sampling_params> out;
  for (float t : {0.0f, 0.3f, 1.0f, 1.8f})
    for (int32_t k : {0, 1, 5, 40})
      for (float tp : {1.0f, 0.9f, 0.3f}) {
        sampling_params p;
        p.temperature = t;
        p.top_k = k;
        p.top_p = tp;
        out.push_back(p);
      }
  return out;
}

}  // namespace

TEST_CASE("sample op: the draw with the first uniform of the seed is the sampler's token, bit for bit") {
  const std::vector<float> row = random_row(300, 1);
  int checked = 0;
  for (sampling_params p : param_grid())
    for (uint64_t seed = 1; seed < 40; ++seed) {
      p.seed = seed * 0x9e3779b97f4a7c15ull;
      CAPTURE(p.temperature);
      CAPTURE(p.top_k);
      CAPTURE(p.top_p);
      const sample_row r = sample_row_of(p, -1);
      CHECK(r.uniform >= 0.0);
      CHECK(r.uniform < 1.0);
      REQUIRE(draw_with_uniform(r, row) == sampler(p).sample(row));
      ++checked;
    }
  CHECK(checked == 48 * 39);
  // The uniform decides: 0 takes the first kept token in the walk, just below 1 the last.
  sample_row r{.temperature = 1.0f, .top_k = 3};
  const std::vector<float> small = {0.0f, 3.0f, 1.0f, 2.0f};
  r.uniform = 0.0;
  CHECK(draw_with_uniform(r, small) == 1);
  r.uniform = 0.999999;
  CHECK(draw_with_uniform(r, small) == 2);
  r.uniform = 1.0;
  CHECK_THROWS_WITH(draw_with_uniform(r, small), doctest::Contains("outside [0, 1)"));
}

TEST_CASE("sample op: only rows without logit rewriting or a grammar draw from raw logits") {
  sampling_params p;
  CHECK(samples_raw(p));
  p.top_k = 7;
  p.top_p = 0.5f;
  p.temperature = 0.0f;
  CHECK(samples_raw(p));
  for (int i = 0; i < 5; ++i) {
    sampling_params q;
    if (i == 0) q.logit_bias = {{3, 1.0f}};
    if (i == 1) q.presence_penalty = 0.5f;
    if (i == 2) q.frequency_penalty = 0.5f;
    if (i == 3) q.repetition_penalty = 1.2f;
    if (i == 4) q.min_p = 0.1f;
    CAPTURE(i);
    CHECK(!samples_raw(q));
  }
  sampling_params g;
  g.grammar.kind = grammar_kind::json_object;
  CHECK(!samples_raw(g));
}

TEST_CASE("sample op: the cpu backend's rows equal the host sampler and compute_logprobs") {
  const int64_t V = 257;
  const std::vector<sampling_params> grid = param_grid();
  std::vector<float> logits;
  std::vector<sample_row> rows;
  std::vector<sampling_params> ps;
  for (size_t i = 0; i < grid.size(); ++i) {
    const std::vector<float> r = random_row(size_t(V), uint32_t(100 + i));
    logits.insert(logits.end(), r.begin(), r.end());
    sampling_params p = grid[i];
    p.seed = 1000 + i;
    ps.push_back(p);
    rows.push_back(sample_row_of(p, i % 3 == 0 ? -1 : int32_t(i % 25)));
  }
  auto cpu = backend::make_cpu_backend(cpu_options{.threads = 1});
  std::vector<token_logprobs> out(rows.size());
  cpu->sample(logits.data(), V, rows, out);
  for (size_t i = 0; i < rows.size(); ++i) {
    CAPTURE(i);
    const std::span<const float> row(logits.data() + int64_t(i) * V, size_t(V));
    const int32_t want = sampler(ps[i]).sample(row);
    CHECK(out[i].token == want);
    if (rows[i].top_logprobs < 0) {
      CHECK(out[i].top.empty());
      continue;
    }
    const token_logprobs lp = compute_logprobs(row, ps[i], {}, want, rows[i].top_logprobs);
    CHECK(out[i].logprob == lp.logprob);
    REQUIRE(out[i].top.size() == lp.top.size());
    CHECK(out[i].top.size() == size_t(std::min(rows[i].top_logprobs, 20)));
    for (size_t j = 0; j < lp.top.size(); ++j) {
      CHECK(out[i].top[j].token == lp.top[j].token);
      CHECK(out[i].top[j].logprob == lp.top[j].logprob);
    }
  }
  std::vector<token_logprobs> short_out(1);
  CHECK_THROWS_WITH(cpu->sample(logits.data(), V, rows, short_out), doctest::Contains("give one per row"));
}

TEST_CASE("sample op: forward_sample equals forward then the worker's sampler") {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("tandem-sample-op-" + std::to_string(::getpid()) + ".gguf")).string();
  write_random_llama(make_model_options{.preset = "micro"}, path);
  {
    const gguf::file f = gguf::file::open(path);
    auto a = llama_model::load(f, cpu_options{.threads = 1});
    auto b = llama_model::load(f, cpu_options{.threads = 1});
    CHECK(!a->on_device());
    const kv_layout L = a->layout(16);
    kv_pool pa(L, 8), pb(L, 8);
    kv_pools sa(pa), sb(pb);
    const std::vector<int32_t> t1 = {1, 5, 9, 200}, t2 = {7, 3}, p1 = {0, 1}, p2 = {2, 3};
    sampling_params g, s;
    g.temperature = 0.0f;
    s.temperature = 0.8f;
    s.top_k = 20;
    s.top_p = 0.9f;
    s.seed = 77;
    std::vector<batch_seq> batch = {{.tokens = t1, .pos = 0, .pages = p1}, {.tokens = t2, .pos = 0, .pages = p2}};
    const std::vector<sample_row> rows = {sample_row_of(g, 3), sample_row_of(s, -1)};
    std::vector<float> logits;
    a->forward(batch, sa, logits);
    const int64_t V = a->config().n_vocab;
    std::vector<token_logprobs> out;
    b->forward_sample(batch, sb, rows, out);
    REQUIRE(out.size() == 2);
    CHECK(out[0].token == sampler(g).sample(std::span<const float>(logits.data(), size_t(V))));
    CHECK(out[1].token == sampler(s).sample(std::span<const float>(logits.data() + V, size_t(V))));
    const token_logprobs lp = compute_logprobs(std::span<const float>(logits.data(), size_t(V)), g, {}, out[0].token, 3);
    CHECK(out[0].logprob == lp.logprob);
    CHECK(out[0].top.size() == 3);
    // The same KV either way: pages hold the same bytes.
    CHECK(std::memcmp(pa.data(), pb.data(), pa.bytes()) == 0);
    // One row per sequence wanting logits, or a refusal naming the mismatch before any work.
    const std::vector<sample_row> one = {rows[0]};
    CHECK_THROWS_WITH(b->forward_sample(batch, sb, one, out), doctest::Contains("1 sampling rows for 2 sequences"));
  }
  std::filesystem::remove(path);
}
