// make-model: files reopen with gguf::file, have the fixture's layout, a working tokenizer,
// and quantized weights close to their f32 source.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>

#include "kernels/gguf/gguf.h"
#include "kernels/gguf/half.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"

using namespace tandem;

namespace {

std::string tmp_model(const std::string& tag) {
  return (std::filesystem::temp_directory_path() /
          ("tandem_test_make_model_" + std::to_string(::getpid()) + "_" + tag + ".gguf"))
      .string();
}

struct temp_file {
  std::string path;
  ~temp_file() { std::filesystem::remove(path); }
};

float element(const gguf::tensor_info& t, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  uint16_t h;
  switch (t.type) {
    case ggml_type::f32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case ggml_type::f16: std::memcpy(&h, p + 2 * i, 2); return gguf::fp16_to_fp32(h);
    case ggml_type::bf16: std::memcpy(&h, p + 2 * i, 2); return gguf::bf16_to_fp32(h);
    case ggml_type::q8_0: {
      block_q8_0 b;
      std::memcpy(&b, p + (i / 32) * sizeof(block_q8_0), sizeof b);
      return gguf::fp16_to_fp32(b.d) * float(b.qs[i % 32]);
    }
    default: return NAN;
  }
}

void check_model(const std::string& preset, ggml_type dtype, bool tied) {
  CAPTURE(preset);
  CAPTURE(to_string(dtype));
  temp_file tf{tmp_model(preset + "_" + std::string(to_string(dtype)) + (tied ? "" : "_untied"))};
  make_model_options opt;
  opt.preset = preset;
  opt.dtype = dtype;
  opt.seed = 7;
  opt.tied_output = tied;
  write_random_llama(opt, tf.path);
  const auto f = gguf::file::open(tf.path);
  const bool micro = preset == "micro";
  const uint32_t e = micro ? 64 : 288, layers = micro ? 2 : 6, heads = micro ? 4 : 6, kv_heads = micro ? 2 : 6;
  const uint32_t ff = micro ? 128 : 768, ctx = micro ? 512 : 2048;
  CHECK(f.version() == 3);
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_u32("general.alignment") == 32);
  CHECK(f.get_u32("llama.embedding_length") == e);
  CHECK(f.get_u32("llama.block_count") == layers);
  CHECK(f.get_u32("llama.attention.head_count") == heads);
  CHECK(f.get_u32("llama.attention.head_count_kv") == kv_heads);
  CHECK(f.get_u32("llama.feed_forward_length") == ff);
  CHECK(f.get_u32("llama.context_length") == ctx);
  CHECK(f.get_u32("llama.rope.dimension_count") == e / heads);
  CHECK(f.get_f32("llama.rope.freq_base") == 10000.0f);
  CHECK(f.get_f32("llama.attention.layer_norm_rms_epsilon") == doctest::Approx(1e-5));
  const uint32_t n_vocab = f.get_u32("llama.vocab_size");
  CHECK(f.get_array("tokenizer.ggml.tokens").items.size() == n_vocab);
  CHECK(n_vocab > 1000 - 1);
  CHECK(n_vocab <= (micro ? 1000u : 8000u));

  CHECK(f.tensors().size() == 2 + 9 * layers + (tied ? 0 : 1));
  const int64_t kv = int64_t(e / heads) * kv_heads;
  CHECK(f.tensor("token_embd.weight").dims == std::vector<int64_t>{e, n_vocab});
  CHECK(f.tensor("token_embd.weight").type == dtype);
  CHECK(f.tensor("output_norm.weight").type == ggml_type::f32);
  CHECK((f.find_tensor("output.weight") == nullptr) == tied);
  for (uint32_t l = 0; l < layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    CHECK(f.tensor(b + "attn_norm.weight").dims == std::vector<int64_t>{e});
    CHECK(f.tensor(b + "attn_norm.weight").type == ggml_type::f32);
    CHECK(f.tensor(b + "ffn_norm.weight").type == ggml_type::f32);
    CHECK(f.tensor(b + "attn_q.weight").dims == std::vector<int64_t>{e, e});
    CHECK(f.tensor(b + "attn_k.weight").dims == std::vector<int64_t>{e, kv});
    CHECK(f.tensor(b + "attn_v.weight").dims == std::vector<int64_t>{e, kv});
    CHECK(f.tensor(b + "attn_output.weight").dims == std::vector<int64_t>{e, e});
    CHECK(f.tensor(b + "ffn_gate.weight").dims == std::vector<int64_t>{e, ff});
    CHECK(f.tensor(b + "ffn_up.weight").dims == std::vector<int64_t>{e, ff});
    CHECK(f.tensor(b + "ffn_down.weight").dims == std::vector<int64_t>{ff, e});
    CHECK(f.tensor(b + "ffn_down.weight").type == dtype);
    CHECK(f.tensor(b + "ffn_down.weight").view().rows() == e);
  }
  // weights look like N(0, 0.02), norms are 1
  const auto& q = f.tensor("blk.0.attn_q.weight");
  double sum = 0, sq = 0;
  const int64_t n = int64_t(e) * e;
  for (int64_t i = 0; i < n; ++i) {
    const float x = element(q, i);
    sum += x;
    sq += double(x) * x;
  }
  CHECK(std::fabs(sum / double(n)) < 0.002);
  CHECK(std::sqrt(sq / double(n)) == doctest::Approx(0.02).epsilon(0.1));
  CHECK(element(f.tensor("output_norm.weight"), 3) == 1.0f);

  // the tokenizer loads and round-trips text, with byte fallback for what the corpus lacks
  const auto tok = tokenizer::from_gguf(f);
  CHECK(tok->n_vocab() == int32_t(n_vocab));
  CHECK(tok->bos_id() == 1);
  CHECK(tok->eos_id() == 2);
  for (const std::string t : {"Hello world, it was the best of times.", " two  spaces\nand lines\t",
                              "caf\xC3\xA9 \xF0\x9F\x98\x80 \xE4\xBD\xA0\xE5\xA5\xBD", "0123456789"}) {
    CAPTURE(t);
    const auto ids = tok->encode(t, true);
    CHECK(ids.front() == 1);
    CHECK(tok->decode(ids) == t);
  }
  // common words of the corpus became single pieces
  CHECK(tok->encode("the nation", false).size() == 2);
}

}  // namespace

TEST_CASE("make_model: micro in every dtype") {
  for (auto t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) check_model("micro", t, true);
  check_model("micro", ggml_type::f16, false);
}

TEST_CASE("make_model: tiny-15m f32") {
  const auto t0 = std::chrono::steady_clock::now();
  check_model("tiny-15m", ggml_type::f32, true);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("tiny-15m f32: written and checked in " << s << " s");
}

TEST_CASE("make_model: tiny-15m f16") {
  const auto t0 = std::chrono::steady_clock::now();
  check_model("tiny-15m", ggml_type::f16, true);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("tiny-15m f16: written and checked in " << s << " s");
}

TEST_CASE("make_model: tiny-15m bf16") {
  const auto t0 = std::chrono::steady_clock::now();
  check_model("tiny-15m", ggml_type::bf16, true);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("tiny-15m bf16: written and checked in " << s << " s");
}

TEST_CASE("make_model: tiny-15m q8_0") {
  const auto t0 = std::chrono::steady_clock::now();
  check_model("tiny-15m", ggml_type::q8_0, true);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  MESSAGE("tiny-15m q8_0: written and checked in " << s << " s");
}

TEST_CASE("make_model: same seed same file, q8_0 within tolerance of f32") {
  temp_file a{tmp_model("seed_a")}, b{tmp_model("seed_b")}, c{tmp_model("seed_c")}, q{tmp_model("seed_q")};
  make_model_options opt;
  opt.preset = "micro";
  opt.seed = 3;
  write_random_llama(opt, a.path);
  write_random_llama(opt, b.path);
  opt.seed = 4;
  write_random_llama(opt, c.path);
  opt.seed = 3;
  opt.dtype = ggml_type::q8_0;
  write_random_llama(opt, q.path);
  const auto fa = gguf::file::open(a.path), fb = gguf::file::open(b.path), fc = gguf::file::open(c.path),
             fq = gguf::file::open(q.path);
  const auto& ta = fa.tensor("blk.1.ffn_up.weight");
  CHECK(std::memcmp(ta.data, fb.tensor("blk.1.ffn_up.weight").data, ta.nbytes) == 0);
  CHECK(std::memcmp(ta.data, fc.tensor("blk.1.ffn_up.weight").data, ta.nbytes) != 0);
  // the vocabulary does not depend on the seed
  CHECK(fa.get_array("tokenizer.ggml.tokens").items.size() == fc.get_array("tokenizer.ggml.tokens").items.size());
  const auto& tq = fq.tensor("blk.1.ffn_up.weight");
  const int64_t n = ta.dims[0] * ta.dims[1];
  for (int64_t blk = 0; blk < n / 32; ++blk) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(element(ta, blk * 32 + j)));
    for (int j = 0; j < 32; ++j) {
      const int64_t i = blk * 32 + j;
      // half a quantization step plus the f16 rounding of the scale
      REQUIRE(std::fabs(element(tq, i) - element(ta, i)) <= amax / 127.0f * 0.5f + amax * 1e-3f);
    }
  }
}

TEST_CASE("make_model: bad preset and dtype are errors that say what to use") {
  make_model_options opt;
  opt.preset = "huge";
  try {
    write_random_llama(opt, tmp_model("bad"));
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(std::string(e.what()).find("tiny-15m") != std::string::npos);
  }
  opt.preset = "micro";
  opt.dtype = ggml_type::q5_0;  // a ggml type Tandem does not compute with
  CHECK_THROWS_AS(write_random_llama(opt, tmp_model("bad")), tandem::error);
  opt.dtype = ggml_type::f32;
  CHECK_THROWS_AS(write_random_llama(opt, "/nonexistent-dir/x.gguf"), tandem::error);
}

TEST_CASE("make_model: the tandem make-model command") {
  temp_file tf{tmp_model("cli")};
  const std::string cmd = std::string(TANDEM_BINARY) + " make-model --preset micro --dtype q8_0 --seed 5 --untied --out " +
                          tf.path + " > /dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const auto f = gguf::file::open(tf.path);
  CHECK(f.tensor("output.weight").type == ggml_type::q8_0);
  CHECK(f.get_u32("llama.attention.head_count_kv") == 2);
  const std::string bad = std::string(TANDEM_BINARY) + " make-model --preset micro --dtype q4 --out " + tf.path + " 2> /dev/null";
  CHECK(std::system(bad.c_str()) != 0);
}
