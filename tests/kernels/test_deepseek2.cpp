// deepseek2 (MLA + MoE): make-model files through the registry, the latent KV layout, bits
// independent of batch and chunking, a step reading only its routed experts, and bad files
// refused naming the key or tensor. Its outputs against llama.cpp: tests/reference.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "kernels/model/arch/deepseek2_forward.h"
#include "kernels/cpu/ops.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/arch/registry.h"
#include "kernels/model/make_model.h"

using namespace tandem;

namespace {

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tandem-test-deepseek2-" + name)).string();
}

/// The bytes of `src` rewritten through `edit_meta(writer)` and `edit_tensor(name, bytes)`
/// (return false to leave the tensor out), without the key `drop_key`.
template <class Meta, class Tensor>
std::vector<uint8_t> rewrite(const gguf::file& src, Meta&& edit_meta, Tensor&& edit_tensor,
                             const std::string& drop_key = "") {
  gguf::writer w;
  for (const auto& [k, v] : src.metadata())
    if (k != drop_key) w.set_value(k, v);
  for (const auto& t : src.tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    std::vector<uint8_t> bytes(p, p + t.nbytes);
    if (edit_tensor(t.name, bytes)) w.add_tensor(t.name, t.type, t.dims, std::move(bytes));
  }
  edit_meta(w);
  return w.bytes();
}

const std::vector<int32_t> prompt = {1, 20, 30, 40, 50, 7, 9, 11, 13, 2, 60, 70, 80, 90, 100, 5, 6, 3, 4};

/// Logits of the last prompt token after a prefill split into chunks of `chunk` tokens.
std::vector<float> chunked_logits(llama_model& m, int chunk) {
  kv_pool pool(m.layout(4), 8);
  const std::vector<int32_t> pages = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> logits;
  for (size_t p = 0; p < prompt.size(); p += size_t(chunk)) {
    const size_t n = std::min(prompt.size() - p, size_t(chunk));
    batch_seq s{std::span(prompt).subspan(p, n), int32_t(p), pages, p + n == prompt.size()};
    m.forward(std::span(&s, 1), pool, logits);
  }
  return logits;
}

/// Writes the micro deepseek2 preset in `dtype` (with YaRN keys when `yarn`) to a temporary file.
std::string make_file(ggml_type dtype, bool yarn) {
  const std::string path = temp_path(std::string(to_string(dtype)) + (yarn ? "-yarn" : "") + ".gguf");
  make_model_options opt;
  opt.preset = "micro";
  opt.arch = "deepseek2";
  opt.dtype = dtype;
  opt.tied_output = false;
  opt.yarn_rope = yarn;
  write_random_llama(opt, path);
  return path;
}

/// A micro deepseek2 file, opened (and removed at the end of the test).
struct made_file {
  std::string path;
  gguf::file f;
  explicit made_file(ggml_type dtype, bool yarn = false) : path(make_file(dtype, yarn)), f(gguf::file::open(path)) {}
  ~made_file() { std::filesystem::remove(path); }
};

}  // namespace

TEST_CASE("deepseek2: make-model files load with the latent KV layout and MoE shape") {
  made_file m(ggml_type::f32);
  CHECK(&arch::of(m.f) == arch::find("deepseek2"));
  auto model = arch::load(m.f, cpu_options{.threads = 2});
  const model_config& c = model->config();
  // micro: 64 wide, 2 layers, 4 heads; head parts of 32 + 16, latent 64, 8 experts (2 used, 1
  // shared), the first layer dense.
  CHECK(c.arch == "deepseek2");
  CHECK(c.kv_lora_rank == 64);
  CHECK(c.rope_dims == 16);
  CHECK(c.head_dim == 48);
  CHECK(c.v_head_dim == 32);
  CHECK(c.q_lora_rank == 32);
  CHECK(c.n_expert == 8);
  CHECK(c.n_expert_used == 2);
  CHECK(c.n_expert_shared == 1);
  CHECK(c.n_dense_lead == 1);
  CHECK(c.expert_weights_norm);
  CHECK(arch::read_config(m.f).kv_lora_rank == c.kv_lora_rank);
  // The cache holds the latent only: (64 + 16) floats per token and layer, whatever the
  // head count (4 heads of K and V of 48 would be 384 floats).
  const kv_layout L = model->layout(16);
  REQUIRE(L.components.size() == 1);
  CHECK(L.components[0].name == "latent");
  CHECK(L.page_bytes() == size_t(16) * 2 * (64 + 16) * sizeof(float));
  // An f16 cache is refused naming the setting.
  CHECK_THROWS_WITH(arch::load(m.f, cpu_options{.kv = kv_dtype::f16}), doctest::Contains("kv_cache_dtype"));
}

TEST_CASE("deepseek2: a sequence's bits do not depend on its batch or on prefill chunking") {
  for (ggml_type t : {ggml_type::f32, ggml_type::q8_0}) {
    CAPTURE(to_string(t));
    made_file m(t);
    auto model = arch::load(m.f, cpu_options{.threads = 2});
    const std::vector<float> whole = chunked_logits(*model, int(prompt.size()));
    for (int chunk : {1, 3, 8}) {
      CAPTURE(chunk);
      CHECK(chunked_logits(*model, chunk) == whole);
    }
    // Alone versus second in a batch with another sequence.
    kv_pool alone(model->layout(4), 16), mixed(model->layout(4), 16);
    const std::vector<int32_t> pa = {0, 1, 2, 3, 4}, pb = {5, 6, 7, 8, 9};
    const std::vector<int32_t> other = {9, 8, 7, 6, 5, 4};
    std::vector<float> la, lm;
    batch_seq a{prompt, 0, pa, true};
    model->forward(std::span(&a, 1), alone, la);
    const batch_seq batch[] = {{other, 0, pb, true}, {prompt, 0, pa, true}};
    model->forward(batch, mixed, lm);
    REQUIRE(lm.size() == 2 * la.size());
    CHECK(std::memcmp(la.data(), lm.data() + la.size(), la.size() * sizeof(float)) == 0);
    CHECK(la == whole);
  }
}

TEST_CASE("deepseek2: a one-token step reads only the experts it is routed to") {
  made_file m(ggml_type::f32);
  const std::vector<int32_t> one = {42};
  auto run = [&](const gguf::file& f) {
    auto model = arch::load(f);
    kv_pool pool(model->layout(4), 1);
    const std::vector<int32_t> pages = {0};
    std::vector<float> logits;
    batch_seq s{one, 0, pages, true};
    model->forward(std::span(&s, 1), pool, logits);
    return logits;
  };
  const std::vector<float> clean = run(m.f);
  // Poison one expert at a time (its gate rows become NaN) in the one MoE layer: the output
  // turns NaN exactly for the 2 routed experts and keeps its bits for the 6 others.
  const auto& stacked = m.f.tensor("blk.1.ffn_gate_exps.weight");
  const size_t expert_bytes = stacked.nbytes / 8;
  int routed = 0;
  for (int x = 0; x < 8; ++x) {
    CAPTURE(x);
    const auto bytes = rewrite(
        m.f, [](gguf::writer&) {},
        [&](const std::string& name, std::vector<uint8_t>& b) {
          if (name == "blk.1.ffn_gate_exps.weight") {
            auto* v = reinterpret_cast<float*>(b.data() + size_t(x) * expert_bytes);
            std::fill(v, v + expert_bytes / sizeof(float), std::numeric_limits<float>::quiet_NaN());
          }
          return true;
        });
    const auto f = gguf::file::parse(bytes);
    const std::vector<float> got = run(f);
    if (std::isnan(got[0])) {
      ++routed;
    } else {
      CHECK(std::memcmp(got.data(), clean.data(), clean.size() * sizeof(float)) == 0);
    }
  }
  CHECK(routed == 2);
}

TEST_CASE("deepseek2: inconsistent metadata and missing or foreign tensors are refused naming them") {
  made_file m(ggml_type::f32);
  auto keep = [](const std::string&, std::vector<uint8_t>&) { return true; };
  struct bad_case {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* message;
  };
  auto drop = [](const char* tensor) {
    return [tensor](const std::string& name, std::vector<uint8_t>&) { return name != tensor; };
  };
  const bad_case cases[] = {
      {"joint attn_kv_b conversion",
       rewrite(m.f, [](gguf::writer&) {}, keep, "deepseek2.attention.key_length_mla"),
       "deepseek2.attention.key_length_mla is missing"},
      {"more experts used than exist",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.expert_used_count", 9); }, keep),
       "deepseek2.expert_used_count = 9 exceeds deepseek2.expert_count = 8"},
      {"key length unlike the latent",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.attention.key_length", 100); }, keep),
       "deepseek2.attention.key_length = 100, expected kv_lora_rank + rope dimensions = 80"},
      {"odd rope dimensions",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.rope.dimension_count", 7); }, keep),
       "deepseek2.rope.dimension_count = 7"},
      {"unknown gating", rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.expert_gating_func", 3); }, keep),
       "deepseek2.expert_gating_func = 3"},
      {"dense lead beyond the layers",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.leading_dense_block_count", 5); }, keep),
       "deepseek2.leading_dense_block_count = 5"},
      {"missing W_UK", rewrite(m.f, [](gguf::writer&) {}, drop("blk.1.attn_k_b.weight")), "blk.1.attn_k_b.weight"},
      {"missing shared expert", rewrite(m.f, [](gguf::writer&) {}, drop("blk.1.ffn_down_shexp.weight")),
       "blk.1.ffn_down_shexp.weight"},
      {"q LoRA rank unlike the tensors",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.attention.q_lora_rank", 16); }, keep),
       "blk.0.attn_q_a.weight"},
      {"a dense layer's FFN in a MoE layer",
       rewrite(m.f, [](gguf::writer& w) { w.set_u32("deepseek2.leading_dense_block_count", 0); }, keep),
       "blk.0.ffn_gate_inp.weight"},
  };
  for (const auto& bc : cases) {
    CAPTURE(bc.what);
    const auto f = gguf::file::parse(bc.bytes);
    CHECK_THROWS_WITH(arch::load(f), doctest::Contains(bc.message));
  }
}

TEST_CASE("deepseek2: YaRN keys are read (the log multiplier as llama.cpp's loader undoes the converter's 0.1) and change the output") {
  made_file plain(ggml_type::f32), yarn(ggml_type::f32, true);
  auto a = arch::load(plain.f), b = arch::load(yarn.f);
  const yarn_scaling& y = b->config().yarn;
  CHECK(!a->config().yarn.on());
  CHECK(y.factor == 4.0f);
  CHECK(y.orig_ctx == 128);  // micro: 512 positions, a quarter
  CHECK(y.log_mul == doctest::Approx(0.707f));
  CHECK(y.beta_fast == 32.0f);
  // Same weights: only the RoPE angles and the attention scale differ.
  CHECK(chunked_logits(*a, 19) != chunked_logits(*b, 19));
}
