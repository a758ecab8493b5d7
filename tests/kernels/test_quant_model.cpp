// make-model with the low-bit types: which type each tensor gets (llama.cpp's Q4_K_M mix and
// fallbacks), and every file loads, generates and stays close to the f32 model.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"
#include "kernels/model/make_model.h"
#include "kernels/model/quant_mix.h"

using namespace tandem;

namespace {

struct temp_model {
  std::string path;
  explicit temp_model(const std::string& tag)
      : path((std::filesystem::temp_directory_path() /
              ("tandem_test_quant_model_" + std::to_string(::getpid()) + "_" + tag + ".gguf"))
                 .string()) {}
  ~temp_model() { std::filesystem::remove(path); }
};

// Prompt logits, then 6 greedy tokens; every logit finite.
std::vector<float> run(const gguf::file& f, std::vector<int32_t>* generated) {
  auto model = llama_model::load(f, cpu_options{.threads = 2});
  kv_pool pool(model->layout(16), 2);
  const std::vector<int32_t> pages = {0, 1}, toks = {1, 450, 499, 1733, 170};
  std::vector<float> logits, first;
  batch_seq s{toks, 0, pages, true};
  model->forward(std::span(&s, 1), pool, logits);
  first = logits;
  for (int32_t p = 5; p < 11; ++p) {
    for (float v : logits) REQUIRE(std::isfinite(v));
    const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    generated->push_back(next);
    batch_seq d{std::span(&next, 1), p, pages, true};
    model->forward(std::span(&d, 1), pool, logits);
  }
  return first;
}

// `f` with every low-bit matrix replaced by f32 copies of its decoded values.
std::vector<uint8_t> decoded_copy(const gguf::file& f) {
  gguf::writer w;
  for (const auto& [key, value] : f.metadata()) w.set_value(key, value);
  for (const auto& t : f.tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    if (!cpu::is_low_bit(t.type)) {
      w.add_tensor(t.name, t.type, t.dims, std::vector<uint8_t>(p, p + t.nbytes));
      continue;
    }
    const auto v = t.view();
    std::vector<float> out(static_cast<size_t>(v.rows() * v.cols()));
    for (int64_t r = 0; r < v.rows(); ++r) cpu::dequantize_row(v.type, v.row(r), out.data() + r * v.cols(), v.cols());
    std::vector<uint8_t> bytes(out.size() * 4);
    std::memcpy(bytes.data(), out.data(), bytes.size());
    w.add_tensor(t.name, ggml_type::f32, t.dims, std::move(bytes));
  }
  return w.bytes();
}

double nmse(const std::vector<float>& a, const std::vector<float>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return err / norm;
}

}  // namespace

TEST_CASE("quant model: the Q4_K_M mix picks q6_K where llama.cpp does") {
  // 16 layers: use_more_bits holds for layers 0, 1, 4, 7, 10, 13, 14, 15.
  std::vector<int> more;
  for (int l = 0; l < 16; ++l)
    if (weight_type(ggml_type::f16, true, "blk." + std::to_string(l) + ".attn_v.weight", 2048, 16, true) ==
        ggml_type::q6_K)
      more.push_back(l);
  CHECK(more == std::vector<int>{0, 1, 4, 7, 10, 13, 14, 15});
  CHECK(weight_type(ggml_type::f16, true, "blk.4.ffn_down.weight", 8192, 16, true) == ggml_type::q6_K);
  CHECK(weight_type(ggml_type::f16, true, "blk.5.ffn_down.weight", 8192, 16, true) == ggml_type::q4_K);
  CHECK(weight_type(ggml_type::f16, true, "blk.4.attn_q.weight", 2048, 16, true) == ggml_type::q4_K);
  CHECK(weight_type(ggml_type::f16, true, "output.weight", 2048, 16, true) == ggml_type::q6_K);
  CHECK(weight_type(ggml_type::f16, true, "token_embd.weight", 2048, 16, true) == ggml_type::q4_K);
  CHECK(weight_type(ggml_type::f16, true, "token_embd.weight", 2048, 16, false) == ggml_type::q6_K);  // tied
  // Rows the block does not divide: q8_0, or f16 when 32 does not divide them either.
  CHECK(weight_type(ggml_type::q5_K, false, "blk.0.attn_q.weight", 288, 6, true) == ggml_type::q8_0);
  CHECK(weight_type(ggml_type::q4_0, false, "blk.0.attn_q.weight", 288, 6, true) == ggml_type::q4_0);
  CHECK(weight_type(ggml_type::q4_0, false, "blk.0.attn_q.weight", 100, 6, true) == ggml_type::f16);
  CHECK(llama_file_type(ggml_type::q4_K, true) == 15);
}

TEST_CASE("quant model: every low-bit dtype's tiny-15m file loads, generates and tracks f32") {
  auto write = [](ggml_type t, bool q4_k_m, const std::string& path) {
    make_model_options opt;
    opt.preset = "tiny-15m";
    opt.dtype = t;
    opt.q4_k_m = q4_k_m;
    opt.seed = 3;
    opt.tied_output = false;
    write_random_llama(opt, path);
  };
  temp_model ref_file("f32");
  write(ggml_type::f32, false, ref_file.path);
  const auto ref_f = gguf::file::open(ref_file.path);
  std::vector<int32_t> ref_gen;
  const auto ref = run(ref_f, &ref_gen);
  struct variant {
    const char* name;
    ggml_type t;
    bool mix;
    ggml_type ffn_down_0, attn_q;  // tiny-15m: ffn_down rows are 768 long, the rest 288
    double nmse;                   // bound on the prompt logits' normalised squared error
  };
  // Measured nmse: 0.082 (q4_0: every matrix, output and embeddings included, at 4 bits with
  // one scale per 32), 1.6e-3 (q4_K), 6e-4 (q5_K), 3e-4 (q6_K), 1.5e-3 (q4_k_m): the k-quant
  // files keep the 288-wide matrices at q8_0.
  const variant vs[] = {
      {"q4_0", ggml_type::q4_0, false, ggml_type::q4_0, ggml_type::q4_0, 0.15},
      {"q4_K", ggml_type::q4_K, false, ggml_type::q4_K, ggml_type::q8_0, 5e-3},
      {"q5_K", ggml_type::q5_K, false, ggml_type::q5_K, ggml_type::q8_0, 3e-3},
      {"q6_K", ggml_type::q6_K, false, ggml_type::q6_K, ggml_type::q8_0, 2e-3},
      {"q4_k_m", ggml_type::f16, true, ggml_type::q4_K, ggml_type::q8_0, 1e-2},
  };
  for (const variant& v : vs) {
    CAPTURE(std::string(v.name));
    temp_model tf(v.name);
    write(v.t, v.mix, tf.path);
    const auto f = gguf::file::open(tf.path);
    CHECK(f.tensor("blk.0.ffn_down.weight").type == v.ffn_down_0);
    CHECK(f.tensor("blk.0.attn_q.weight").type == v.attn_q);
    if (v.mix) {
      // 6 layers: use_more_bits holds for layers 2 and 5.
      CHECK(f.tensor("blk.2.ffn_down.weight").type == ggml_type::q6_K);
      CHECK(f.tensor("blk.5.ffn_down.weight").type == ggml_type::q6_K);
      CHECK(f.tensor("output.weight").type == ggml_type::q8_0);        // q6_K, but 288 columns
      CHECK(f.get_u32("general.file_type") == 15);
    }
    std::vector<int32_t> gen;
    const auto logits = run(f, &gen);
    REQUIRE(logits.size() == ref.size());
    const double e = nmse(logits, ref);
    MESSAGE(std::string(v.name) << " vs f32 prompt logits nmse = " << e);
    CHECK(e < v.nmse);
    CHECK(gen.size() == 6);
    // Against the same weights decoded to f32, only the activations' 8-bit rounding is left.
    const auto copy = decoded_copy(f);
    const auto g = gguf::file::parse(copy);
    std::vector<int32_t> gen2;
    const double e2 = nmse(logits, run(g, &gen2));
    MESSAGE(std::string(v.name) << " vs its decoded weights nmse = " << e2);
    CHECK(e2 < 1e-3);
  }
}
