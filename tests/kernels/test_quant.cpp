// Low-bit weight types (q4_0, q4_K, q5_K, q6_K): block layouts against hand-packed vectors,
// quantization error, GGUF round trip and load errors, and the integer matmul against an
// f64 reference and across paths, batch sizes and thread counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/gguf/gguf.h"
#include "tests/kernels/matmul_fixtures.h"

using namespace tandem;

namespace {

constexpr ggml_type k_types[] = {ggml_type::q4_0, ggml_type::q4_K, ggml_type::q5_K, ggml_type::q6_K};
/// The types quant_matmul computes: the low-bit ones and q8_0.
constexpr ggml_type k_matmul_types[] = {ggml_type::q4_0, ggml_type::q4_K, ggml_type::q5_K, ggml_type::q6_K,
                                        ggml_type::q8_0};

std::vector<float> decode(ggml_type t, const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  cpu::dequantize_row(t, bytes.data(), out.data(), n);
  return out;
}

template <class Block>
std::vector<uint8_t> as_bytes(const Block& b) {
  std::vector<uint8_t> v(sizeof b);
  std::memcpy(v.data(), &b, sizeof b);
  return v;
}

std::vector<float> gaussian(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

}  // namespace

TEST_CASE("quant: q4_0 block decodes as the format says") {
  block_q4_0 b{};
  b.d = 0x3800;  // 0.5
  for (int j = 0; j < 16; ++j) b.qs[j] = uint8_t(j | (15 - j) << 4);
  const auto out = decode(ggml_type::q4_0, as_bytes(b), 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(out[size_t(j)] == 0.5f * float(j - 8));        // low nibble: element j
    CHECK(out[size_t(j + 16)] == 0.5f * float(7 - j));   // high nibble: element j + 16
  }
  CHECK(out[0] == -4.0f);
  CHECK(out[31] == -4.0f);
}

TEST_CASE("quant: q4_K and q5_K blocks decode as the format says") {
  const int sc[8] = {1, 2, 3, 4, 17, 33, 50, 63}, m[8] = {5, 6, 7, 8, 20, 40, 45, 62};
  for (bool five : {false, true}) {
    block_q5_K b5{};
    block_q4_K b4{};
    std::vector<int> code(256);
    for (int e = 0; e < 256; ++e) code[size_t(e)] = five ? (e * 11) % 32 : (e * 7) % 16;
    uint8_t scales[12];
    test::pack_k4_scales(sc, m, scales);
    uint8_t qs[128] = {}, qh[32] = {};
    for (int e = 0; e < 256; ++e) {
      // element 64 g + l: low nibble of qs[32 g + l]; 64 g + 32 + l: its high nibble
      qs[32 * (e / 64) + e % 32] |= uint8_t((code[size_t(e)] & 0xF) << (e % 64 < 32 ? 0 : 4));
      qh[e % 32] |= uint8_t((code[size_t(e)] >> 4) << (e / 32));  // fifth bit: bit e / 32 of qh[e % 32]
    }
    std::vector<uint8_t> bytes;
    if (five) {
      b5.d = 0x3C00;     // 1.0
      b5.dmin = 0x3800;  // 0.5
      std::memcpy(b5.scales, scales, 12);
      std::memcpy(b5.qh, qh, 32);
      std::memcpy(b5.qs, qs, 128);
      bytes = as_bytes(b5);
    } else {
      b4.d = 0x3C00;
      b4.dmin = 0x3800;
      std::memcpy(b4.scales, scales, 12);
      std::memcpy(b4.qs, qs, 128);
      bytes = as_bytes(b4);
    }
    const ggml_type t = five ? ggml_type::q5_K : ggml_type::q4_K;
    const auto out = decode(t, bytes, 256);
    for (int e = 0; e < 256; ++e)
      CHECK(out[size_t(e)] == float(sc[e / 32] * code[size_t(e)]) - 0.5f * float(m[e / 32]));
    if (!five) {
      CHECK(out[0] == -2.5f);   // sc 1, q 0, m 5
      CHECK(out[100] == 44.0f); // sub-block 3: 4 * 12 - 0.5 * 8
      CHECK(out[255] == 536.0f);  // sub-block 7: 63 * 9 - 0.5 * 62
    } else {
      CHECK(out[255] == float(63 * ((255 * 11) % 32)) - 31.0f);
    }
  }
}

TEST_CASE("quant: q6_K block decodes as the format says") {
  block_q6_K b{};
  const int8_t sc[16] = {1, -2, 3, -4, 5, 127, -128, 8, 9, 10, -11, 12, 13, 14, 15, -16};
  std::memcpy(b.scales, sc, 16);
  b.d = 0x3400;  // 0.25
  std::vector<int> code(256);
  for (int e = 0; e < 256; ++e) {
    code[size_t(e)] = (e * 13) % 64;
    // half h = e / 128; r = e % 128: ql[64 h + (r % 64 < 32 ? 0 : 32) + r % 32], low nibble for
    // r < 64; qh[32 h + r % 32] bits 2 (r / 32) .. + 1
    const int h = e / 128, r = e % 128;
    b.ql[64 * h + (r % 64 < 32 ? 0 : 32) + r % 32] |= uint8_t((code[size_t(e)] & 0xF) << (r < 64 ? 0 : 4));
    b.qh[32 * h + r % 32] |= uint8_t((code[size_t(e)] >> 4) << (2 * (r / 32)));
  }
  const auto out = decode(ggml_type::q6_K, as_bytes(b), 256);
  for (int e = 0; e < 256; ++e) CHECK(out[size_t(e)] == 0.25f * float(sc[e / 16]) * float(code[size_t(e)] - 32));
  CHECK(out[0] == 0.25f * 1 * -32);       // code 0
  CHECK(out[81] == 0.25f * 127 * (29 - 32));  // 81 * 13 % 64 = 29, sub-block 5
}

TEST_CASE("quant: quantize then dequantize stays within each type's error") {
  // RMS error relative to the data's RMS (gaussian rows), measured about 0.074 (q4_0),
  // 0.062 (q4_K), 0.031 (q5_K), 0.018 (q6_K).
  const double bound[] = {0.10, 0.08, 0.042, 0.024};
  const int64_t cols = 1024, rows = 8;
  const auto x = gaussian(size_t(cols * rows), 7, 0.02f);
  for (size_t ti = 0; ti < 4; ++ti) {
    const ggml_type t = k_types[ti];
    const auto q = cpu::quantize_rows(t, x.data(), rows, cols);
    REQUIRE(q.size() == row_bytes(t, cols) * size_t(rows));
    double se = 0, sx = 0, worst = 0;
    std::vector<float> d(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      cpu::dequantize_row(t, q.data() + size_t(r) * row_bytes(t, cols), d.data(), cols);
      for (int64_t i = 0; i < cols; ++i) {
        const double e = double(d[size_t(i)]) - x[size_t(r * cols + i)];
        se += e * e;
        sx += double(x[size_t(r * cols + i)]) * x[size_t(r * cols + i)];
        worst = std::max(worst, std::fabs(e));
      }
    }
    const double rel = std::sqrt(se / sx);
    INFO(to_string(t), " relative rms error ", rel, " worst ", worst);
    CHECK(rel < bound[ti]);
    CHECK(rel > bound[ti] / 4);  // it does quantize
    CHECK(worst < 0.02 * 4 * 0.25);  // well under a quarter of 4 sigma
  }
  // All-zero and constant blocks stay exact.
  for (ggml_type t : k_types) {
    std::vector<float> z(256, 0.0f);
    const auto q = cpu::quantize_rows(t, z.data(), 1, 256);
    for (float v : decode(t, q, 256)) CHECK(v == 0.0f);
  }
  CHECK_THROWS_AS(cpu::quantize_rows(ggml_type::q4_K, x.data(), 1, 128), tandem::error);
  CHECK_THROWS_AS(cpu::quantize_rows(ggml_type::f16, x.data(), 1, 256), tandem::error);
}

TEST_CASE("quant: low-bit tensors round-trip through the GGUF writer and reader") {
  const int64_t cols = 512, rows = 3;
  const auto x = gaussian(size_t(cols * rows), 11);
  gguf::writer w;
  w.set_string("general.architecture", "llama");
  std::vector<std::vector<uint8_t>> data;
  for (ggml_type t : k_types) {
    data.push_back(cpu::quantize_rows(t, x.data(), rows, cols));
    w.add_tensor(std::string(to_string(t)), t, {cols, rows}, data.back());
  }
  const auto bytes = w.bytes();
  const auto f = gguf::file::parse(bytes);
  for (size_t i = 0; i < 4; ++i) {
    const ggml_type t = k_types[i];
    const auto v = f.tensor(std::string(to_string(t))).view();
    CHECK(v.type == t);
    CHECK(v.cols() == cols);
    CHECK(v.rows() == rows);
    REQUIRE(v.nbytes == data[i].size());
    CHECK(std::memcmp(v.data, data[i].data(), v.nbytes) == 0);
    std::vector<float> a(static_cast<size_t>(cols)), b(static_cast<size_t>(cols));
    cpu::get_rows(v, std::vector<int32_t>{2}, a.data());
    cpu::dequantize_row(t, data[i].data() + 2 * row_bytes(t, cols), b.data(), cols);
    CHECK(a == b);
  }
}

TEST_CASE("quant: a bad low-bit tensor fails at load naming the tensor, type and shape") {
  auto one_tensor = [](uint32_t type, std::vector<uint64_t> dims, size_t data_bytes) {
    // A writer cannot make these, so the tensor info is patched into a good file's bytes.
    gguf::writer w;
    w.add_tensor("blk.0.attn_q.weight", ggml_type::f32, {int64_t(dims[0]), int64_t(dims[1])},
                 std::vector<uint8_t>(size_t(dims[0] * dims[1] * 4)));
    auto b = w.bytes();
    // Locate the tensor info: name, n_dims, dims, type.
    const std::string name = "blk.0.attn_q.weight";
    const size_t at = size_t(std::search(b.begin(), b.end(), name.begin(), name.end()) - b.begin()) + name.size();
    std::memcpy(b.data() + at + 4 + 16, &type, 4);
    b.resize(b.size() - size_t(dims[0] * dims[1] * 4) + data_bytes);
    return b;
  };
  auto error_of = [](const std::vector<uint8_t>& b) -> std::string {
    try {
      (void)gguf::file::parse(b);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  // Unknown type id.
  std::string m = error_of(one_tensor(77, {256, 2}, 2 * 144));
  CHECK(m.find("unknown tensor type 77") != std::string::npos);
  CHECK(m.find("blk.0.attn_q.weight") != std::string::npos);
  CHECK(m.find("[256, 2]") != std::string::npos);
  // Row length not a multiple of the q4_K block.
  m = error_of(one_tensor(12, {128, 4}, 4 * 144));
  CHECK(m.find("q4_K") != std::string::npos);
  CHECK(m.find("blk.0.attn_q.weight") != std::string::npos);
  CHECK(m.find("[128, 4]") != std::string::npos);
  CHECK(m.find("not a multiple of the block size 256") != std::string::npos);
  // Fewer bytes than a q6_K tensor of this shape needs.
  m = error_of(one_tensor(14, {256, 4}, 4 * 210 - 10));
  CHECK(m.find("truncated") != std::string::npos);
  INFO(m);
  CHECK(m.find("blk.0.attn_q.weight") != std::string::npos);
  CHECK(m.find("q6_K") != std::string::npos);
  CHECK(m.find("[256, 4]") != std::string::npos);
  // The right size parses and views.
  CHECK(error_of(one_tensor(13, {256, 4}, 4 * 176)).empty());
  // A type Tandem cannot compute with parses but its view names it.
  const auto b = one_tensor(10, {256, 2}, 2 * 84);  // q2_K
  const auto f = gguf::file::parse(b);
  try {
    (void)f.tensor("blk.0.attn_q.weight").view();
    FAIL("view of q2_K must throw");
  } catch (const tandem::error& e) {
    CHECK(std::string(e.what()).find("q2_K") != std::string::npos);
    CHECK(std::string(e.what()).find("blk.0.attn_q.weight") != std::string::npos);
  }
}

namespace {

struct qweight {
  std::vector<uint8_t> bytes;
  tensor_view view;
};

qweight make_weight(ggml_type t, int64_t rows, int64_t cols, uint32_t seed) {
  qweight w;
  const auto x = gaussian(size_t(rows * cols), seed, 0.05f);
  w.bytes = cpu::quantize_rows(t, x.data(), rows, cols);
  w.view = test::view_of(t, w.bytes, rows, cols);
  return w;
}

}  // namespace

TEST_CASE("quant: matmul agrees with an f64 reference within the activation rounding") {
  std::vector<float> scratch;
  for (ggml_type t : k_matmul_types) {
    for (int64_t cols : {int64_t(256), int64_t(768)}) {
      const int64_t rows = 13, batch = 3;
      const auto w = make_weight(t, rows, cols, 5);
      auto x = gaussian(size_t(batch * cols), 9);
      x[5] = 40.0f;  // an outlier: its group's scale is large
      std::vector<float> y(size_t(batch * rows));
      cpu::matmul(w.view, x.data(), batch, y.data(), scratch, nullptr, cpu_isa::scalar);
      const int g = cpu::act_group(t);
      std::vector<float> wr(static_cast<size_t>(cols));
      for (int64_t r = 0; r < rows; ++r) {
        cpu::dequantize_row(t, w.view.row(r), wr.data(), cols);
        for (int64_t b = 0; b < batch; ++b) {
          // Each activation moves by at most half its group's step max|x| / 127.
          double ref = 0, bound = 0, mag = 0;
          for (int64_t k0 = 0; k0 < cols; k0 += g) {
            double amax = 0;
            for (int64_t k = k0; k < k0 + g; ++k) amax = std::max(amax, std::fabs(double(x[size_t(b * cols + k)])));
            for (int64_t k = k0; k < k0 + g; ++k) {
              ref += double(wr[size_t(k)]) * x[size_t(b * cols + k)];
              bound += std::fabs(double(wr[size_t(k)])) * amax / 127.0 / 2.0;
              mag += std::fabs(double(wr[size_t(k)]) * x[size_t(b * cols + k)]);
            }
          }
          const double got = y[size_t(b * rows + r)];
          INFO(to_string(t), " cols ", cols, " row ", r, " batch row ", b);
          CHECK(std::fabs(got - ref) <= bound * 1.01 + 1e-5 * mag + 1e-6);
        }
      }
    }
  }
}

TEST_CASE("quant: matmul gives the same bits on every path, batch size and thread count") {
  cpu::thread_pool pool2(2), pool3(3);
  std::vector<float> scratch;
  for (ggml_type t : k_matmul_types) {
    // Odd row counts (tiles of 8, 4 and single rows), odd q4_0 / q8_0 block counts.
    const int64_t cols = cpu::act_group(t) == 32 ? 32 * 25 : 512;
    for (int64_t rows : {int64_t(1), int64_t(7), int64_t(37), int64_t(70)}) {
      const auto w = make_weight(t, rows, cols, uint32_t(rows));
      const int64_t max_batch = 9;
      const auto x = gaussian(size_t(max_batch * cols), 3);
      // Reference: the scalar path, one activation row at a time, no threads.
      std::vector<float> ref(size_t(max_batch * rows));
      for (int64_t b = 0; b < max_batch; ++b)
        cpu::matmul(w.view, x.data() + b * cols, 1, ref.data() + b * rows, scratch, nullptr, cpu_isa::scalar);
      for (cpu_isa isa : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512, cpu_isa::amx}) {
        if (!cpu::isa_supported(isa)) continue;
        for (cpu::thread_pool* p : {static_cast<cpu::thread_pool*>(nullptr), &pool2, &pool3})
          for (int64_t batch = 1; batch <= max_batch; ++batch) {
            std::vector<float> y(size_t(batch * rows), -1.0f);
            cpu::matmul(w.view, x.data(), batch, y.data(), scratch, p, isa);
            INFO(to_string(t), " rows ", rows, " isa ", cpu::to_string(isa), " batch ", batch);
            CHECK(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)) == 0);
          }
      }
      // The prepared-weight entry points take the same kernels.
      const auto pw = cpu::pack_weight(w.view, cpu_isa::best);
      std::vector<float> y(size_t(2 * rows)), y2(size_t(2 * rows));
      cpu::matmul(pw, x.data(), 2, y.data(), scratch, &pool2);
      const cpu::packed_weight* ws[] = {&pw, &pw};
      float* ys[] = {y.data(), y2.data()};
      cpu::matmul_many(ws, x.data(), 2, ys, scratch, &pool2);
      CHECK(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(y2.data(), ref.data(), y2.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("quant: matmul_many of mixed low-bit types gives each weight's own bits") {
  cpu::thread_pool pool(2);
  std::vector<float> scratch;
  const int64_t cols = 512, batch = 3;
  const auto a = make_weight(ggml_type::q4_K, 50, cols, 1), b = make_weight(ggml_type::q6_K, 26, cols, 2),
             c = make_weight(ggml_type::q4_0, 9, cols, 3), d = make_weight(ggml_type::q8_0, 11, cols, 4);
  const auto x = gaussian(size_t(batch * cols), 4);
  for (cpu::thread_pool* p : {static_cast<cpu::thread_pool*>(nullptr), &pool}) {
    const auto pa = cpu::pack_weight(a.view), pb = cpu::pack_weight(b.view), pc = cpu::pack_weight(c.view),
               pd = cpu::pack_weight(d.view);
    const cpu::packed_weight* ws[] = {&pa, &pb, &pc, &pd};
    std::vector<float> ya(size_t(batch * 50)), yb(size_t(batch * 26)), yc(size_t(batch * 9)), yd(size_t(batch * 11));
    float* ys[] = {ya.data(), yb.data(), yc.data(), yd.data()};
    cpu::matmul_many(ws, x.data(), batch, ys, scratch, p);
    for (auto [w, y] :
         {std::pair{&a, &ya}, std::pair{&b, &yb}, std::pair{&c, &yc}, std::pair{&d, &yd}}) {
      std::vector<float> alone(y->size());
      cpu::matmul(w->view, x.data(), batch, alone.data(), scratch, nullptr, cpu_isa::scalar);
      CHECK(std::memcmp(alone.data(), y->data(), alone.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("quant: the activation quantizer rounds to the nearest step and keeps group sums") {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[size_t(i)] = float(i - 20) * 0.1f;
  cpu::quant_acts a;
  cpu::quantize_acts(x.data(), 1, 64, 32, a);
  for (int g = 0; g < 2; ++g) {
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[size_t(32 * g + i)]));
    CHECK(a.scale(0)[g] == amax / 127.0f);
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = a.q(0)[32 * g + i];
      CHECK(std::fabs(float(q) * a.scale(0)[g] - x[size_t(32 * g + i)]) <= a.scale(0)[g] * 0.5001f);
      sum += q;
    }
    CHECK(a.sum32(0)[g] == sum);
  }
  CHECK(a.q(0)[63] == 127);
}

TEST_CASE("quant: the activation quantizer gives the same bits on every path, special values included") {
  if (!cpu::isa_supported(cpu_isa::avx512)) return;
  for (int group : {32, 256}) {
    // k / 32 odd for group 32 (a padded last pair). Enough values that some land near a
    // rounding tie, where a contracted x * id + 1.5 * 2^23 (one fma) rounds differently.
    const int64_t k = group == 32 ? 32 * 7 : 512, batch = 40;
    auto x = gaussian(size_t(batch * k), 17, 3.0f);
    for (int64_t i = 0; i < 32; ++i) x[size_t(k + i)] = 0.0f;  // an all-zero group
    x[3] = std::numeric_limits<float>::quiet_NaN();
    x[40] = std::numeric_limits<float>::infinity();
    x[41] = -std::numeric_limits<float>::infinity();
    x[size_t(2 * k + 5)] = 1e-40f;  // a denormal
    x[size_t(2 * k + 6)] = -0.0f;
    x[size_t(2 * k + 70)] = 1e30f;
    // Row 1's first group: values whose product with the group's 127 / amax rounds to a tie
    // (n + 0.5) while the exact product is not one, so that only an unfused multiply and add
    // gives the scalar code's code.
    const float amax = 2.10922f, id = 127.0f / amax;
    x[size_t(k)] = amax;
    int64_t placed = 1;
    for (int n = 1; n < 120 && placed < 32; ++n)
      for (float v = float(n + 0.5) / id, i = 0; i < 64 && placed < 32; ++i, v = std::nextafter(v, 1e9f))
        if (v * id == float(n) + 0.5f && std::fma(v, id, 12582912.0f) != v * id + 12582912.0f)
          x[size_t(k + placed++)] = v;
    REQUIRE(placed > 1);
    cpu::quant_acts s, v;
    cpu::quantize_acts(x.data(), batch, k, group, s, cpu_isa::scalar);
    cpu::quantize_acts(x.data(), batch, k, group, v, cpu_isa::avx512);
    INFO("group ", group);
    CHECK(std::memcmp(s.qs.data(), v.qs.data(), s.qs.size()) == 0);
    CHECK(std::memcmp(s.d.data(), v.d.data(), s.d.size() * sizeof(float)) == 0);
    CHECK(s.sums == v.sums);
    CHECK(s.off128 == v.off128);
    REQUIRE(s.d16.size() == v.d16.size());
    if (!s.d16.empty())  // group 256 has no pair scales (memcmp of null data is undefined)
      CHECK(std::memcmp(s.d16.data(), v.d16.data(), s.d16.size() * sizeof(float)) == 0);
    if (group == 32) {
      // The offsets are -128 times each 4 codes' sum, the scales each group's 8 times.
      for (int64_t g = 0; g < k / 32; ++g)
        for (int l = 0; l < 8; ++l) {
          int sum = 0;
          for (int e = 0; e < 4; ++e) sum += s.q(1)[32 * g + 4 * l + e];
          const int64_t lane = g / 2 * 16 + 8 * (g % 2) + l;
          CHECK(s.offset128(1)[lane] == -128 * sum);
          CHECK(s.scale16(1)[lane] == s.scale(1)[g]);
        }
      CHECK(s.offset128(0)[s.pair_lanes() - 1] == 0);  // the padding
    }
  }
}
