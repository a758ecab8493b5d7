// The architecture layer: each dense architecture's features against the naive reference,
// make-model files of every architecture through the registry, and bad metadata refused with
// the key named.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/backend/cpu_backend.h"
#include "kernels/model/arch/dense_forward.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/arch/registry.h"
#include "kernels/model/make_model.h"
#include "tests/kernels/reference_model.h"

using namespace tandem;
using namespace tandem::test;

namespace {

const std::vector<int32_t> prompt = {3, 17, 42, 0, 49, 8, 8, 21, 5, 33, 11, 30, 2};

struct feature_case {
  const char* name;
  arch_features x;
};

const feature_case feature_cases[] = {
    {"qwen2: qkv biases + neox rope", {.qkv_bias = true, .neox = true}},
    {"qwen3: per-head q/k norms + neox rope", {.qk_norm = true, .neox = true}},
    {"llama3: rope frequency factors", {.rope_freqs = true}},
    {"linear rope scaling x4 with factors", {.rope_freqs = true, .rope_freq_scale = 0.25f}},
    {"gemma2: window 4, soft-caps, post norms, gelu", {.neox = true, .gemma2 = true, .window = 4}},
};

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("tandem-test-arch-" + name)).string();
}

/// Greedy ids of `n` tokens after `prompt` (prefill, then one decode step per token); the
/// last step's logits in `last`.
std::vector<int32_t> greedy(llama_model& m, const std::vector<int32_t>& prompt_ids, int n, std::vector<float>& last) {
  kv_pool pool(m.layout(16), 8);
  const std::vector<int32_t> pages = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<int32_t> toks = prompt_ids, out;
  std::vector<float> logits;
  batch_seq s{toks, 0, pages, true};
  m.forward(std::span(&s, 1), pool, logits);
  for (int i = 0; i < n; ++i) {
    const int32_t next = int32_t(cpu::argmax(logits.data(), int64_t(logits.size())));
    out.push_back(next);
    toks.push_back(next);
    batch_seq d{std::span(toks).last(1), int32_t(toks.size() - 1), pages, true};
    m.forward(std::span(&d, 1), pool, logits);
  }
  last = logits;
  return out;
}

}  // namespace

TEST_CASE("arch: every dense feature matches the naive reference, prefill then decode") {
  for (const auto& fc : feature_cases) {
    CAPTURE(fc.name);
    tiny_model m(ggml_type::f32, 5, fc.x);
    auto model = make_cpu_llama(m.w, cpu_options{.threads = 2});
    kv_pool pool(model->layout(4), 8);
    const std::vector<int32_t> pages = {5, 2, 7, 0};
    const auto ref = reference_logits(m, prompt);
    std::vector<float> logits;
    batch_seq s{std::span(prompt).first(9), 0, pages, true};
    model->forward(std::span(&s, 1), pool, logits);
    auto check = [&](size_t p) {
      CAPTURE(p);
      REQUIRE(logits.size() == ref[p].size());
      for (size_t i = 0; i < logits.size(); ++i) REQUIRE(logits[i] == doctest::Approx(ref[p][i]).epsilon(1e-4).scale(1.0));
    };
    check(8);
    for (int32_t p = 9; p < int32_t(prompt.size()); ++p) {
      batch_seq d{std::span(prompt).subspan(size_t(p), 1), p, pages, true};
      model->forward(std::span(&d, 1), pool, logits);
      check(size_t(p));
    }
  }
}

TEST_CASE("arch: the features do not make a sequence's bits depend on its batch") {
  for (const auto& fc : feature_cases) {
    CAPTURE(fc.name);
    tiny_model m(ggml_type::f16, 9, fc.x);
    auto model = make_cpu_llama(m.w);
    const std::vector<int32_t> pa = {0, 1, 2, 3}, pb = {4, 5, 6, 7};
    const std::vector<int32_t> tb = {9, 8, 7, 6, 5};
    kv_pool alone(model->layout(4), 8), mixed(model->layout(4), 8);
    std::vector<float> la, lm;
    batch_seq a{prompt, 0, pa, true};
    model->forward(std::span(&a, 1), alone, la);
    const batch_seq batch[] = {{tb, 0, pb, true}, {prompt, 0, pa, true}};
    model->forward(batch, mixed, lm);
    REQUIRE(lm.size() == 2 * la.size());
    CHECK(std::memcmp(la.data(), lm.data() + la.size(), la.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("arch: a half-present q/k norm pair and wrong-sized extras are refused, naming the tensor") {
  tiny_model m(ggml_type::f32, 3, {.qk_norm = true, .neox = true});
  llama_weights w = m.w;
  w.layers[1].attn_k_norm = {};
  CHECK_THROWS_WITH(make_cpu_llama(w), doctest::Contains("only one of attn_q_norm / attn_k_norm"));
  tiny_model b(ggml_type::f32, 3, {.qkv_bias = true});
  w = b.w;
  w.layers[0].attn_k_bias.ne[0] = 8;
  CHECK_THROWS_WITH(make_cpu_llama(w), doctest::Contains("blk.0.attn_k.bias"));
}

TEST_CASE("arch: make-model writes every architecture and the registry loads each with its features") {
  CHECK(arch::supported_names() == "llama, qwen2, qwen3, gemma2, deepseek2");
  std::vector<std::vector<float>> outputs;
  for (const char* a : {"llama", "qwen2", "qwen3", "gemma2"}) {
    for (bool llama3 : {false, true}) {
      if (llama3 && std::string(a) != "llama") continue;
      CAPTURE(a);
      CAPTURE(llama3);
      const std::string path = temp_path(std::string(a) + (llama3 ? "-rope" : "") + ".gguf");
      make_model_options opt;
      opt.preset = "micro";
      opt.arch = a;
      opt.dtype = ggml_type::f16;
      opt.llama3_rope = llama3;
      write_random_llama(opt, path);
      auto f = gguf::file::open(path);
      CHECK(f.get_string("general.architecture") == a);
      CHECK(&arch::of(f) == arch::find(a));
      auto model = arch::load(f, cpu_options{.threads = 2});
      const model_config& c = model->config();
      CHECK(c.arch == a);
      CHECK(c.rope == (std::string(a) == "llama" ? rope_kind::normal : rope_kind::neox));
      CHECK(arch::read_config(f).head_dim == c.head_dim);
      // micro is 64 wide with 4 heads; qwen3's head size comes from attention.key_length.
      CHECK(c.head_dim == (std::string(a) == "qwen3" ? 32 : 16));
      if (std::string(a) == "gemma2") {
        CHECK(c.sliding_window == 32);
        CHECK(c.is_swa_layer(0));
        CHECK(!c.is_swa_layer(1));
        CHECK(c.final_softcap == 30.0f);
      }
      CHECK(model->layout(16).head_dim == c.head_dim);
      std::vector<float> last;
      CHECK(greedy(*model, {1, 20, 30, 40, 50}, 8, last).size() == 8);
      outputs.push_back(last);
      std::filesystem::remove(path);
    }
  }
  // The same seed and shapes: what differs between the files is what each architecture adds,
  // so a loader that ignored it would give the plain llama logits. (Greedy ids of random
  // weights may agree: the Llama 3 factors only stretch wavelengths longer than 2048
  // positions, which barely turn over 13 positions.)
  for (size_t i = 1; i < outputs.size(); ++i) CHECK(outputs[i] != outputs[0]);
}

TEST_CASE("arch: unknown architectures and inconsistent metadata are refused naming the key") {
  const std::string path = temp_path("base.gguf");
  make_model_options opt;
  opt.preset = "micro";
  opt.arch = "qwen3";
  write_random_llama(opt, path);
  const auto good = gguf::file::open(path);
  auto rewrite = [&](auto&& edit) {
    gguf::writer w;
    for (const auto& [k, v] : good.metadata()) w.set_value(k, v);
    for (const auto& t : good.tensors()) {
      const auto* p = static_cast<const uint8_t*>(t.data);
      w.add_tensor(t.name, t.type, t.dims, std::vector<uint8_t>(p, p + t.nbytes));
    }
    edit(w);
    return w.bytes();
  };
  struct bad_case {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* message;
  };
  const bad_case cases[] = {
      {"unknown architecture", rewrite([](gguf::writer& w) { w.set_string("general.architecture", "mamba"); }),
       "architecture 'mamba' is not supported; supported are llama, qwen2, qwen3, gemma2, deepseek2"},
      {"kv heads do not divide heads", rewrite([](gguf::writer& w) { w.set_u32("qwen3.attention.head_count_kv", 3); }),
       "qwen3.attention.head_count_kv = 3"},
      {"partial rope", rewrite([](gguf::writer& w) { w.set_u32("qwen3.rope.dimension_count", 8); }),
       "qwen3.rope.dimension_count = 8"},
      {"unknown scaling", rewrite([](gguf::writer& w) { w.set_string("qwen3.rope.scaling.type", "longrope"); }),
       "qwen3.rope.scaling.type = 'longrope' is not supported"},
      {"value length", rewrite([](gguf::writer& w) { w.set_u32("qwen3.attention.value_length", 16); }),
       "qwen3.attention.value_length = 16"},
      {"vocab size", rewrite([](gguf::writer& w) { w.set_u32("qwen3.vocab_size", 7); }), "qwen3.vocab_size = 7"},
      {"zero layers", rewrite([](gguf::writer& w) { w.set_u32("qwen3.block_count", 0); }), "qwen3.block_count = 0"},
      {"llama keys in a qwen3 file",
       rewrite([](gguf::writer& w) { w.set_string("general.architecture", "llama"); }), "llama.embedding_length"},
  };
  for (const auto& bc : cases) {
    CAPTURE(bc.what);
    auto f = gguf::file::parse(bc.bytes);
    CHECK_THROWS_WITH(arch::load(f), doctest::Contains(bc.message));
  }
  // A qwen3 file read as llama would ignore the q/k norms: refused, naming one.
  {
    gguf::writer w;
    for (const auto& [k, v] : good.metadata()) {
      std::string key = k;
      if (key.rfind("qwen3.", 0) == 0) key = "llama." + key.substr(6);
      w.set_value(key, v);
    }
    w.set_string("general.architecture", "llama");
    for (const auto& t : good.tensors()) {
      const auto* p = static_cast<const uint8_t*>(t.data);
      w.add_tensor(t.name, t.type, t.dims, std::vector<uint8_t>(p, p + t.nbytes));
    }
    const auto bytes = w.bytes();
    auto f = gguf::file::parse(bytes);
    CHECK_THROWS_WITH(arch::load(f), doctest::Contains("tensor(s) that a 'llama' model does not have, e.g. blk.0.attn_q_norm.weight"));
  }
  // A qwen3 file without its norms, and a qwen2 file without its biases, name the tensor.
  auto drop = [&](const gguf::file& src, const std::string& skip) {
    gguf::writer w;
    for (const auto& [k, v] : src.metadata()) w.set_value(k, v);
    for (const auto& t : src.tensors()) {
      if (t.name == skip) continue;
      const auto* p = static_cast<const uint8_t*>(t.data);
      w.add_tensor(t.name, t.type, t.dims, std::vector<uint8_t>(p, p + t.nbytes));
    }
    return w.bytes();
  };
  {
    const auto bytes = drop(good, "blk.1.attn_k_norm.weight");
    auto f = gguf::file::parse(bytes);
    CHECK_THROWS_WITH(arch::load(f), doctest::Contains("blk.1.attn_k_norm.weight"));
  }
  opt.arch = "qwen2";
  write_random_llama(opt, path);
  {
    const auto q2 = gguf::file::open(path);
    const auto bytes = drop(q2, "blk.0.attn_v.bias");
    auto f = gguf::file::parse(bytes);
    CHECK_THROWS_WITH(arch::load(f), doctest::Contains("blk.0.attn_v.bias"));
  }
  std::filesystem::remove(path);
  make_model_options bad = opt;
  bad.arch = "gpt-j";
  CHECK_THROWS_WITH(write_random_llama(bad, path), doctest::Contains("use llama, qwen2, qwen3, gemma2 or deepseek2"));
}

TEST_CASE("arch: cpu_options::make_backend builds the backend a loaded model runs on") {
  // The CUDA backend comes in this way (tests/gpu); here a CPU backend stands in for it, and
  // the model must run on it with the bits of the default backend of the same options.
  for (const char* a : {"llama", "deepseek2"}) {
    CAPTURE(a);
    const std::string path = temp_path(std::string("hook-") + a + ".gguf");
    make_model_options opt;
    opt.preset = "micro";
    opt.arch = a;
    write_random_llama(opt, path);
    auto f = gguf::file::open(path);
    int made = 0;
    cpu_options co{.threads = 1};
    co.make_backend = [&made] {
      ++made;
      return backend::make_cpu_backend(cpu_options{.threads = 1});
    };
    auto hooked = arch::load(f, co);
    auto plain = arch::load(f, cpu_options{.threads = 1});
    CHECK(made == 1);
    std::vector<float> a_last, b_last;
    CHECK(greedy(*hooked, {1, 20, 30}, 4, a_last) == greedy(*plain, {1, 20, 30}, 4, b_last));
    CHECK(a_last == b_last);
    std::filesystem::remove(path);
  }
}
