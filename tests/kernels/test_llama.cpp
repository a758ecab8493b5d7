// CPU Llama forward vs a naive contiguous-KV reference, batch independence, chunked prefill.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/model/arch/dense_forward.h"
#include "kernels/cpu/ops.h"
#include "kernels/gguf/gguf.h"
#include "tests/kernels/reference_model.h"

using namespace tandem;
using namespace tandem::test;

namespace {

const std::vector<int32_t> prompt = {3, 17, 42, 0, 49, 8, 8, 21, 5, 33, 11};

/// Prefills the first 8 tokens of `prompt` in `pages`, then decodes the rest one at a time;
/// after each forward, check(p, logits) with p the position whose logits came back.
template <class F>
void prefill_then_decode(llama_model& model, kv_pool& pool, const std::vector<int32_t>& pages, F&& check) {
  std::vector<float> logits;
  batch_seq s{std::span(prompt).first(8), 0, pages, true};
  model.forward(std::span(&s, 1), pool, logits);
  check(size_t(7), logits);
  for (int32_t p = 8; p < int32_t(prompt.size()); ++p) {
    batch_seq d{std::span(prompt).subspan(size_t(p), 1), p, pages, true};
    model.forward(std::span(&d, 1), pool, logits);
    check(size_t(p), logits);
  }
}

}  // namespace

TEST_CASE("llama: forward matches a naive contiguous-KV reference (prefill then decode)") {
  for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
    CAPTURE(to_string(t));
    tiny_model m(t);
    auto model = make_cpu_llama(m.w);
    kv_pool pool(model->layout(4), 8);
    const std::vector<int32_t> pages = {6, 1, 3, 0};  // scattered, 16 positions
    const auto ref = reference_logits(m, prompt);
    // Prefill 8 tokens, then decode the remaining 3 one at a time.
    prefill_then_decode(*model, pool, pages, [&](size_t p, const std::vector<float>& logits) {
      const std::vector<double>& want = ref[p];
      REQUIRE(logits.size() == want.size());
      // q8_0 multiplies 8-bit activations, as llama.cpp does (quant_matmul.h): on this 32-wide
      // model the rounding moves logits of magnitude ~2 by up to 0.05 (f32: 6e-7); bound 0.1.
      for (size_t i = 0; i < want.size(); ++i) {
        if (t == ggml_type::q8_0)
          REQUIRE(std::fabs(logits[i] - want[i]) <= 0.1);
        else
          REQUIRE(logits[i] == doctest::Approx(want[i]).epsilon(1e-4).scale(1.0));
      }
    });
  }
}

TEST_CASE("llama: an f16 KV cache stays close to the double-precision reference and writes f16 pages") {
  tiny_model m(ggml_type::f16);
  auto model = make_cpu_llama(m.w, cpu_options{.threads = 2, .kv = kv_dtype::f16});
  kv_pool pool(model->layout(4), 8);
  REQUIRE(pool.layout().dtype == kv_dtype::f16);
  kv_pool wrong(make_cpu_llama(m.w)->layout(4), 8);  // an f32 pool for an f16 model
  const std::vector<int32_t> pages = {6, 1, 3, 0};
  std::vector<float> logits;
  batch_seq s{std::span(prompt).first(8), 0, pages, true};
  CHECK_THROWS_WITH(model->forward(std::span(&s, 1), wrong, logits), doctest::Contains("kv=f16"));
  const auto ref = reference_logits(m, prompt);
  double worst = 0;
  prefill_then_decode(*model, pool, pages, [&](size_t p, const std::vector<float>& logits) {
    const std::vector<double>& want = ref[p];
    REQUIRE(logits.size() == want.size());
    double err = 0, norm = 0;
    for (size_t i = 0; i < want.size(); ++i) err += (logits[i] - want[i]) * (logits[i] - want[i]), norm += want[i] * want[i];
    worst = std::max(worst, err / norm);
  });
  MESSAGE("f16 KV cache: worst logit nmse vs the f64 reference = " << worst);
  CHECK(worst < 1e-5);
  // The cache holds halves: position 0 of layer 0's K, KV head 0, read back as f16, is what
  // the model computed (non-zero, finite).
  const float k0 = cpu::fp16_to_fp32(pool.k16(pages[0], 0)[0]);
  CHECK(std::isfinite(k0));
  CHECK(k0 != 0.0f);
}

TEST_CASE("llama: a sequence alone and inside a mixed batch gives bit-identical logits") {
  tiny_model m(ggml_type::f16);
  auto model = make_cpu_llama(m.w);
  const std::vector<int32_t> pa = {0, 1, 2}, pb = {3, 4}, pc = {5, 6, 7};
  const std::vector<int32_t> ta(prompt.begin(), prompt.begin() + 9), tb = {1, 2, 3}, tc = {9, 8, 7, 6, 5};
  kv_pool alone(model->layout(4), 8), mixed(model->layout(4), 8);
  std::vector<float> la, lm;
  batch_seq a{ta, 0, pa, true};
  model->forward(std::span(&a, 1), alone, la);
  // In the mixed batch: b is a prefill without logits, c is prefilled then decoded alongside a.
  batch_seq c0{std::span(tc).first(4), 0, pc, false};
  model->forward(std::span(&c0, 1), mixed, lm);
  CHECK(lm.empty());
  const batch_seq batch[] = {{tb, 0, pb, false}, {std::span(tc).subspan(4), 4, pc, true}, {ta, 0, pa, true}};
  model->forward(batch, mixed, lm);
  REQUIRE(lm.size() == 2 * size_t(m.cfg.n_vocab));
  CHECK(std::memcmp(la.data(), lm.data() + m.cfg.n_vocab, la.size() * sizeof(float)) == 0);
  // Threads split matmul rows only: same bits with 2 threads.
  auto threaded = make_cpu_llama(m.w, cpu_options{.threads = 2});
  kv_pool tp(model->layout(4), 8);
  std::vector<float> lt;
  threaded->forward(std::span(&a, 1), tp, lt);
  CHECK(std::memcmp(la.data(), lt.data(), la.size() * sizeof(float)) == 0);
  CHECK_THROWS_WITH(make_cpu_llama(m.w, cpu_options{.threads = 0}), doctest::Contains("threads 0"));
  // The KV written for a is the same bits too.
  CHECK(std::memcmp(alone.k(2, 1), mixed.k(2, 1), alone.layout().layer_elems() * sizeof(float)) == 0);
}

TEST_CASE("llama: prefill in one chunk or two gives the same logits") {
  tiny_model m(ggml_type::bf16);
  auto model = make_cpu_llama(m.w);
  const std::vector<int32_t> pages = {2, 0, 1};
  kv_pool one(model->layout(4), 3), two(model->layout(4), 3);
  std::vector<float> l1, l2;
  batch_seq s{prompt, 0, pages, true};
  model->forward(std::span(&s, 1), one, l1);
  batch_seq c1{std::span(prompt).first(5), 0, pages, false};
  model->forward(std::span(&c1, 1), two, l2);
  batch_seq c2{std::span(prompt).subspan(5), 5, pages, true};
  model->forward(std::span(&c2, 1), two, l2);
  REQUIRE(l1.size() == l2.size());
  // Each token's arithmetic does not depend on its chunk, so this is exact, not just close.
  CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0);
}

TEST_CASE("llama: decode of 8 sequences of different lengths in one batch equals each run alone") {
  tiny_model m(ggml_type::q8_0, 11);
  auto model = make_cpu_llama(m.w, cpu_options{.threads = 2});
  constexpr int n_seq = 8;
  std::vector<std::vector<int32_t>> toks(n_seq), pages(n_seq);
  for (int s = 0; s < n_seq; ++s) {
    for (int i = 0; i < 2 + 3 * s; ++i) toks[size_t(s)].push_back(int32_t((s * 7 + i * 13) % m.cfg.n_vocab));
    for (int p = 0; p < 8; ++p) pages[size_t(s)].push_back(s * 8 + p);
  }
  // Alone: prefill all but the last token, then decode the last one.
  kv_pool alone(model->layout(4), 8 * n_seq), batched(model->layout(4), 8 * n_seq);
  std::vector<std::vector<float>> want(n_seq);
  std::vector<float> l;
  for (int s = 0; s < n_seq; ++s) {
    const auto& t = toks[size_t(s)];
    batch_seq pre{std::span(t).first(t.size() - 1), 0, pages[size_t(s)], false};
    model->forward(std::span(&pre, 1), alone, l);
    batch_seq dec{std::span(t).last(1), int32_t(t.size() - 1), pages[size_t(s)], true};
    model->forward(std::span(&dec, 1), alone, want[size_t(s)]);
  }
  // Batched: all prefills in one call, then all decodes in one call.
  std::vector<batch_seq> pre, dec;
  for (int s = 0; s < n_seq; ++s) {
    const auto& t = toks[size_t(s)];
    pre.push_back({std::span(t).first(t.size() - 1), 0, pages[size_t(s)], false});
    dec.push_back({std::span(t).last(1), int32_t(t.size() - 1), pages[size_t(s)], true});
  }
  model->forward(pre, batched, l);
  CHECK(l.empty());
  model->forward(dec, batched, l);
  REQUIRE(l.size() == size_t(n_seq) * size_t(m.cfg.n_vocab));
  for (int s = 0; s < n_seq; ++s) {
    CAPTURE(s);
    CHECK(std::memcmp(want[size_t(s)].data(), l.data() + size_t(s) * size_t(m.cfg.n_vocab),
                      size_t(m.cfg.n_vocab) * sizeof(float)) == 0);
  }
}

TEST_CASE("llama: bad batches and bad weights are rejected with a message") {
  tiny_model m;
  auto model = make_cpu_llama(m.w);
  kv_pool pool(model->layout(4), 2);
  std::vector<float> logits;
  const std::vector<int32_t> one_page = {0}, bad_page = {0, 5};
  batch_seq s{prompt, 0, one_page, true};
  CHECK_THROWS_WITH(model->forward(std::span(&s, 1), pool, logits), doctest::Contains("allocate more pages"));
  batch_seq b{std::span(prompt).first(6), 0, bad_page, true};
  CHECK_THROWS_WITH(model->forward(std::span(&b, 1), pool, logits), doctest::Contains("page id 5"));
  const std::vector<int32_t> bad_tok = {50};
  batch_seq t{bad_tok, 0, one_page, true};
  CHECK_THROWS_WITH(model->forward(std::span(&t, 1), pool, logits), doctest::Contains("token id 50"));
  kv_pool wrong(kv_layout{.n_layers = 2, .n_kv_heads = 4, .head_dim = 8, .page_size = 4}, 2);
  batch_seq ok{bad_tok.empty() ? bad_tok : std::span(prompt).first(1), 0, one_page, true};
  CHECK_THROWS_WITH(model->forward(std::span(&ok, 1), wrong, logits), doctest::Contains("does not match"));

  llama_weights w = m.w;
  w.layers[1].attn_k.ne[1] = 32;
  CHECK_THROWS_WITH(make_cpu_llama(w), doctest::Contains("blk.1.attn_k.weight"));
  // Tied output: no output tensor means token_embd is used.
  w = m.w;
  w.output = {};
  CHECK_NOTHROW(make_cpu_llama(w));
}

TEST_CASE("llama: load reads a GGUF file and computes the same bits as the in-memory model") {
  tiny_model m(ggml_type::f16);
  gguf::writer wr;
  wr.set_string("general.architecture", "llama");
  wr.set_string("general.name", "tiny-gguf");
  wr.set_u32("llama.embedding_length", uint32_t(m.cfg.n_embd));
  wr.set_u32("llama.block_count", uint32_t(m.cfg.n_layer));
  wr.set_u32("llama.attention.head_count", uint32_t(m.cfg.n_head));
  wr.set_u32("llama.attention.head_count_kv", uint32_t(m.cfg.n_head_kv));
  wr.set_u32("llama.feed_forward_length", uint32_t(m.cfg.n_ff));
  wr.set_u32("llama.context_length", uint32_t(m.cfg.n_ctx));
  wr.set_f32("llama.rope.freq_base", m.cfg.rope_freq_base);
  wr.set_f32("llama.attention.layer_norm_rms_epsilon", m.cfg.rms_eps);
  auto add = [&](const std::string& name, const tensor_view& v) {
    const auto* p = static_cast<const uint8_t*>(v.data);
    std::vector<int64_t> dims = {v.ne[0]};
    if (v.n_dims > 1) dims.push_back(v.ne[1]);
    wr.add_tensor(name, v.type, dims, std::vector<uint8_t>(p, p + v.nbytes));
  };
  add("token_embd.weight", m.w.token_embd);
  add("output_norm.weight", m.w.output_norm);
  add("output.weight", m.w.output);
  for (int l = 0; l < m.cfg.n_layer; ++l) {
    const auto& L = m.w.layers[size_t(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    add(b + "attn_norm.weight", L.attn_norm);
    add(b + "attn_q.weight", L.attn_q);
    add(b + "attn_k.weight", L.attn_k);
    add(b + "attn_v.weight", L.attn_v);
    add(b + "attn_output.weight", L.attn_output);
    add(b + "ffn_norm.weight", L.ffn_norm);
    add(b + "ffn_gate.weight", L.ffn_gate);
    add(b + "ffn_up.weight", L.ffn_up);
    if (l == 0) add(b + "ffn_down.weight", L.ffn_down);
  }
  // Layer 1 lacks ffn_down: the error names it.
  {
    const auto bytes = wr.bytes();
    auto f = gguf::file::parse(bytes);
    CHECK_THROWS_WITH(llama_model::load(f), doctest::Contains("blk.1.ffn_down.weight"));
  }
  add("blk.1.ffn_down.weight", m.w.layers[1].ffn_down);
  const auto bytes = wr.bytes();
  auto f = gguf::file::parse(bytes);
  auto loaded = llama_model::load(f);
  CHECK(loaded->config().name == "tiny-gguf");
  CHECK(loaded->config().n_vocab == m.cfg.n_vocab);
  CHECK(loaded->config().head_dim == m.cfg.head_dim);
  auto direct = make_cpu_llama(m.w);
  const std::vector<int32_t> pages = {0, 1, 2};
  kv_pool p1(direct->layout(4), 3), p2(loaded->layout(4), 3);
  std::vector<float> l1, l2;
  batch_seq s{prompt, 0, pages, true};
  direct->forward(std::span(&s, 1), p1, l1);
  loaded->forward(std::span(&s, 1), p2, l2);
  REQUIRE(l1.size() == l2.size());
  CHECK(std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0);
}

TEST_CASE("llama: the r15m fixtures load and decode") {
  std::vector<std::vector<float>> first;  // prompt logits of each file
  for (const char* file : {"r15m-f16.gguf", "r15m-q8_0.gguf"}) {
    CAPTURE(file);
    auto f = gguf::file::open(std::string(TANDEM_SHARED_MODELS) + "/" + file);
    auto model = llama_model::load(f, cpu_options{.threads = 2});
    const auto& c = model->config();
    CHECK(c.n_vocab == 32000);
    CHECK(c.n_embd == 288);
    CHECK(c.n_layer == 6);
    CHECK(c.n_head == 6);
    CHECK(c.n_head_kv == 6);
    CHECK(c.n_ff == 768);
    CHECK(c.n_ctx == 2048);
    CHECK(c.head_dim == 48);
    kv_pool pool(model->layout(16), 2);
    const std::vector<int32_t> pages = {1, 0}, toks = {1, 450, 4996, 17354, 1701};
    std::vector<float> logits;
    batch_seq s{toks, 0, pages, true};
    model->forward(std::span(&s, 1), pool, logits);
    REQUIRE(logits.size() == 32000);
    for (float v : logits) REQUIRE(std::isfinite(v));
    CHECK(*std::max_element(logits.begin(), logits.end()) > *std::min_element(logits.begin(), logits.end()));
    // These matmuls are big enough to be split across the 2 threads: same bits as 1 thread.
    auto single = llama_model::load(f);
    kv_pool pool1(single->layout(16), 2);
    std::vector<float> logits1;
    single->forward(std::span(&s, 1), pool1, logits1);
    CHECK(std::memcmp(logits.data(), logits1.data(), logits.size() * sizeof(float)) == 0);
    first.push_back(logits);
    // Greedy decode 16 tokens (positions 5..20 cross into the second page).
    std::vector<int32_t> generated;
    for (int32_t p = 5; p < 21; ++p) {
      const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      REQUIRE(next >= 0);
      REQUIRE(next < 32000);
      generated.push_back(next);
      batch_seq d{std::span(&next, 1), p, pages, true};
      model->forward(std::span(&d, 1), pool, logits);
      for (float v : logits) REQUIRE(std::isfinite(v));
    }
    CHECK(generated.size() == 16);
  }
  // Q8_0 is the f16 model quantized: logits close (normalised squared error; loose, the
  // quantization error passes through 6 layers).
  REQUIRE(first.size() == 2);
  double err = 0, norm = 0;
  for (size_t i = 0; i < first[0].size(); ++i) {
    const double d = double(first[0][i]) - first[1][i];
    err += d * d;
    norm += double(first[0][i]) * first[0][i];
  }
  MESSAGE("r15m f16 vs q8_0 prompt logits nmse = " << err / norm);
  CHECK(err / norm < 1e-2);
}

TEST_CASE("llama: every isa path keeps batch and thread invariance, and paths agree closely") {
  // q8_0 and f32-free f16/bf16 models: on the amx path f16 and bf16 matmuls run on tiles
  // (batch 1 emulated), q8_0 on the avx512 kernels. Each with an f32 and an f16 KV cache.
  for (ggml_type t : {ggml_type::q8_0, ggml_type::f16, ggml_type::bf16})
  for (kv_dtype kv : {kv_dtype::f32, kv_dtype::f16}) {
    CAPTURE(to_string(t));
    CAPTURE(to_string(kv));
    tiny_model m(t);
    const std::vector<int32_t> pa = {0, 1, 2}, pb = {3, 4};
    const std::vector<int32_t> ta(prompt.begin(), prompt.begin() + 9), tb = {1, 2, 3};
    std::vector<float> first;
    for (cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512, cpu_isa::amx}) {
      if (!cpu::isa_supported(isa)) {
        CHECK_THROWS_WITH(make_cpu_llama(m.w, cpu_options{.threads = 1, .isa = isa}),
                          doctest::Contains("cannot run"));
        continue;
      }
      CAPTURE(cpu::to_string(isa));
      auto one = make_cpu_llama(m.w, cpu_options{.threads = 1, .isa = isa, .kv = kv});
      auto two = make_cpu_llama(m.w, cpu_options{.threads = 2, .isa = isa, .kv = kv});
      REQUIRE(one->layout(4).dtype == kv);
      kv_pool p1(one->layout(4), 8), p2(one->layout(4), 8), p3(one->layout(4), 8);
      std::vector<float> l1, l2, l3;
      const batch_seq a{ta, 0, pa, true};
      one->forward(std::span(&a, 1), p1, l1);
      const batch_seq batch[] = {{tb, 0, pb, true}, a};
      two->forward(batch, p2, l2);
      REQUIRE(l2.size() == 2 * l1.size());
      CHECK(std::memcmp(l1.data(), l2.data() + l1.size(), l1.size() * sizeof(float)) == 0);
      // The same prompt as 8 tokens and then one decode step (every matmul at batch 1).
      const std::vector<int32_t> head(ta.begin(), ta.end() - 1), last = {ta.back()};
      const batch_seq s8{head, 0, pa, false}, s1{last, 8, pa, true};
      two->forward(std::span(&s8, 1), p3, l3);
      two->forward(std::span(&s1, 1), p3, l3);
      REQUIRE(l3.size() == l1.size());
      CHECK(std::memcmp(l1.data(), l3.data(), l1.size() * sizeof(float)) == 0);
      if (first.empty()) {
        first = l1;
      } else {
        double err = 0, norm = 0;
        for (size_t i = 0; i < l1.size(); ++i) {
          err += double(l1[i] - first[i]) * (l1[i] - first[i]);
          norm += double(first[i]) * first[i];
        }
        CHECK(err / norm < 1e-8);
      }
    }
  }
}
