// MLA latent attention against a naive double-precision reference, the same bits for a chunk
// and its tokens one by one, and the latent layout's bytes per token.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/mla_attention.h"
#include "kernels/cpu/ops.h"

using namespace tandem;

TEST_CASE("mla: latent attention matches the naive reference and a chunk equals its tokens one by one") {
  const int32_t rank = 32, rope = 16, heads = 3, layers = 2, ps = 4, n_ctx = 11;
  const kv_layout L = cpu::mla_layout(layers, rank, rope, ps);
  // One latent of rank + rope floats per token and layer, whatever the head count.
  CHECK(L.page_bytes() / size_t(ps) == size_t(layers) * size_t(rank + rope) * 4);
  kv_pool pool(L, 4);
  const std::vector<int32_t> pages = {2, 0, 3};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<std::vector<float>> cache(n_ctx, std::vector<float>(size_t(rank + rope)));
  for (int32_t p = 0; p < n_ctx; ++p) {
    for (float& v : cache[size_t(p)]) v = d(rng);
    auto* row = reinterpret_cast<float*>(pool.component(pages[size_t(p / ps)], 1, 0)) + size_t(p % ps) * size_t(rank + rope);
    std::memcpy(row, cache[size_t(p)].data(), cache[size_t(p)].size() * sizeof(float));
  }
  const int32_t pos0 = 6, n_tok = 5;
  std::vector<float> ql(size_t(n_tok * heads * rank)), qp(size_t(n_tok * heads * rope));
  for (float& v : ql) v = d(rng);
  for (float& v : qp) v = d(rng);
  const float scale = 0.2f;
  std::vector<float> out(size_t(n_tok * heads * rank)), one(out.size());
  cpu::mla_attention(ql.data(), qp.data(), n_tok, pos0, heads, rank, rope, scale, pool, 1, pages, out.data());
  for (int32_t t = 0; t < n_tok; ++t) {
    const size_t oq = size_t(t * heads);
    cpu::mla_attention(ql.data() + oq * rank, qp.data() + oq * rope, 1, pos0 + t, heads, rank, rope, scale, pool, 1,
                       pages, one.data() + oq * rank);
    for (int h = 0; h < heads; ++h) {
      const int64_t len = pos0 + t + 1;
      std::vector<double> s(static_cast<size_t>(len));
      double mx = -1e300, tot = 0;
      for (int64_t p = 0; p < len; ++p) {
        double v = 0;
        for (int i = 0; i < rank; ++i) v += double(ql[(oq + h) * rank + i]) * cache[size_t(p)][size_t(i)];
        for (int i = 0; i < rope; ++i) v += double(qp[(oq + h) * rope + i]) * cache[size_t(p)][size_t(rank + i)];
        s[size_t(p)] = v * scale;
        mx = std::max(mx, s[size_t(p)]);
      }
      for (double& v : s) tot += v = std::exp(v - mx);
      for (int i = 0; i < rank; ++i) {
        double want = 0;
        for (int64_t p = 0; p < len; ++p) want += s[size_t(p)] / tot * cache[size_t(p)][size_t(i)];
        REQUIRE(out[(oq + h) * rank + i] == doctest::Approx(want).epsilon(1e-5));
      }
    }
  }
  CHECK(std::memcmp(out.data(), one.data(), out.size() * sizeof(float)) == 0);
  // A standard K/V pool is not a latent one.
  kv_pool kv(kv_layout{.n_layers = 2, .n_kv_heads = 1, .head_dim = 48, .page_size = 4}, 4);
  CHECK_THROWS_WITH(cpu::mla_attention(ql.data(), qp.data(), 1, 0, heads, rank, rope, scale, kv, 0, pages, out.data()),
                    doctest::Contains("is not a latent layout of 32 + 16 floats"));
}

TEST_CASE("mla: a chunk longer than the kernel's token group has the bits of dot, softmax and axpy per token") {
  // 19 tokens after 2 cached ones: groups of 8 tokens, the last one partial; a rank of 48
  // ends on an odd 16-float chunk.
  for (int32_t rank : {48, 64}) {
    const int32_t rope = 16, heads = 2, ps = 8, pos0 = 2, n_tok = 19, w = rank + rope;
    kv_pool pool(cpu::mla_layout(1, rank, rope, ps), 3);
    const std::vector<int32_t> pages = {1, 2, 0};
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> d(-1, 1);
    for (int32_t pg = 0; pg < 3; ++pg) {
      auto* base = reinterpret_cast<float*>(pool.component(pg, 0, 0));
      for (int32_t i = 0; i < ps * w; ++i) base[i] = d(rng);
    }
    std::vector<float> ql(size_t(n_tok * heads * rank)), qp(size_t(n_tok * heads * rope));
    for (float& v : ql) v = d(rng);
    for (float& v : qp) v = d(rng);
    const float scale = 0.3f;
    std::vector<float> out(ql.size()), one(ql.size()), ref(ql.size());
    cpu::mla_attention(ql.data(), qp.data(), n_tok, pos0, heads, rank, rope, scale, pool, 0, pages, out.data());
    for (int32_t t = 0; t < n_tok; ++t) {
      const size_t oq = size_t(t * heads);
      cpu::mla_attention(ql.data() + oq * rank, qp.data() + oq * rope, 1, pos0 + t, heads, rank, rope, scale, pool, 0,
                         pages, one.data() + oq * rank);
      // The definition: dot + dot, softmax, then axpy from zero in position order.
      for (int h = 0; h < heads; ++h) {
        const int64_t len = pos0 + t + 1;
        std::vector<float> att(static_cast<size_t>(len));
        auto row = [&](int64_t p) {
          return reinterpret_cast<const float*>(pool.component(pages[size_t(p / ps)], 0, 0)) + (p % ps) * w;
        };
        for (int64_t p = 0; p < len; ++p)
          att[size_t(p)] = (cpu::dot(ql.data() + (oq + h) * rank, row(p), rank, cpu_isa::best) +
                            cpu::dot(qp.data() + (oq + h) * rope, row(p) + rank, rope, cpu_isa::best)) * scale;
        cpu::softmax(att.data(), att.size());
        float* o = ref.data() + (oq + h) * rank;
        for (int64_t p = 0; p < len; ++p) cpu::axpy(att[size_t(p)], row(p), o, rank);
      }
    }
    INFO("rank ", rank);
    CHECK(std::memcmp(out.data(), one.data(), out.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)) == 0);
  }
}
