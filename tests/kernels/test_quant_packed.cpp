// Packed low-bit weights (kernels/cpu/quant_packed.h): the packed kernels against the scalar
// recipe bit for bit, at row counts that leave a part group, odd block counts, every batch
// tile, through matmul / matmul_many / matmul_jobs and a MoE expert slice.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/matmul_fixtures.h"

using namespace tandem;
using namespace tandem::test;

namespace {

struct qweight {
  std::vector<uint8_t> bytes;
  tensor_view view;
};

qweight make_q(ggml_type t, int64_t rows, int64_t cols, uint64_t seed) {
  qweight w;
  const auto x = random_floats(size_t(rows * cols), seed, 0.1f);
  w.bytes = cpu::quantize_rows(t, x.data(), rows, cols);
  w.view = view_of(t, w.bytes, rows, cols);
  return w;
}

qweight make_q4_0(int64_t rows, int64_t cols, uint64_t seed) {
  return make_q(ggml_type::q4_0, rows, cols, seed);
}

/// The types with a packed kernel (quant_packed.cpp's kernel_of).
constexpr ggml_type k_packed_types[] = {ggml_type::q4_0, ggml_type::q4_K, ggml_type::q5_K, ggml_type::q6_K};

constexpr int64_t k_rows[] = {40, 17, 16, 1};
constexpr int64_t k_cols[] = {64, 96, 2048};
constexpr int64_t k_batches[] = {1, 3, 4, 5, 17};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // (memcmp may not see an empty vector's null data)
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("quant_packed: packs() names only the types with a packed kernel") {
  for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
    CAPTURE(to_string(t));
    CHECK_FALSE(cpu::packs(t));
  }
  for (ggml_type t : k_packed_types) {
    CAPTURE(to_string(t));
    CHECK(cpu::packs(t) == cpu::quant_detail::has_avx512_vnni());
  }
  const std::vector<uint8_t> f16(2 * 64 * 2);
  CHECK_THROWS_WITH_AS(cpu::pack_quant(view_of(ggml_type::f16, f16, 2, 64)), doctest::Contains("f16"),
                       tandem::error);
}

TEST_CASE("quant_packed: q4_0 packed rows give the scalar recipe's bits") {
  if (!cpu::packs(ggml_type::q4_0)) {
    MESSAGE("no AVX-512 VNNI here: the packed q4_0 kernel is not run");
    return;
  }
  cpu::thread_pool pool(2);
  for (int64_t rows : k_rows)
    for (int64_t cols : k_cols) {
      const auto w = make_q4_0(rows, cols, uint64_t(rows * 1000 + cols));
      // The pool's packing and the one-thread packing agree, zeros past the last row included.
      const cpu::quant_packed p = cpu::pack_quant(w.view, &pool);
      const cpu::quant_packed p1 = cpu::quant_detail::pack_groups(w.view, cpu::quant_detail::pack_group_q4_0);
      REQUIRE(p.bytes.size() == size_t(p.groups()) * 16 * row_bytes(ggml_type::q4_0, cols));
      REQUIRE(p.bytes == p1.bytes);
      for (int64_t batch : k_batches) {
        CAPTURE(rows);
        CAPTURE(cols);
        CAPTURE(batch);
        const auto x = random_floats(size_t(batch * cols), uint64_t(batch), 2.0f);
        cpu::quant_acts a;
        cpu::quantize_acts(x.data(), batch, cols, 32, a);
        std::vector<float> ref(size_t(batch * rows));
        cpu::quant_detail::rows_scalar(w.view, a, ref.data(), 0, rows);
        // Sentinels after the output: a group's padding rows are never written.
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> y(size_t(batch * rows + 16), nan);
        cpu::packed_rows(p, a, y.data(), 0, p.groups());
        for (size_t i = size_t(batch * rows); i < y.size(); ++i) REQUIRE(std::isnan(y[i]));
        y.resize(size_t(batch * rows));
        CHECK(same_bits(y, ref));
        // Group by group: the same bits.
        std::vector<float> y1(size_t(batch * rows), nan);
        for (int64_t g = 0; g < p.groups(); ++g) cpu::packed_rows(p, a, y1.data(), g, g + 1);
        CHECK(same_bits(y1, ref));
        // The unpacked weight on the avx512 path (packed on the fly) and on avx2, over a row range
        // that starts and ends inside a group.
        std::vector<float> y2(size_t(batch * rows), nan), y3(size_t(batch * rows), nan);
        const int64_t r0 = rows > 5 ? 5 : 0, r1 = rows > 5 ? rows - 1 : rows;
        cpu::quant_detail::rows_avx512(w.view, a, y2.data(), r0, r1);
        cpu::quant_detail::rows_avx2(w.view, a, y3.data(), 0, rows);
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t r = 0; r < rows; ++r) {
            const size_t i = size_t(b * rows + r);
            if (r >= r0 && r < r1)
              REQUIRE(std::memcmp(&y2[i], &ref[i], 4) == 0);
            else
              REQUIRE(std::isnan(y2[i]));
          }
        CHECK(same_bits(y3, ref));
      }
    }
}

TEST_CASE(
    "quant_packed: packed weights of every packed type through matmul, matmul_many and matmul_jobs give the "
    "scalar bits") {
  cpu::thread_pool pool(2);
  std::vector<float> scratch;
  // Each type beside a q6_K weight (a q4_K_M file's mix; q4_0 also meets the other activation
  // group in one matmul_many).
  for (ggml_type t : k_packed_types)
    for (int64_t cols :
         t == ggml_type::q4_0 ? std::vector<int64_t>{64, 96, 2048} : std::vector<int64_t>{256, 768}) {
      CAPTURE(to_string(t));
      const auto a = make_q(t, 40, cols, 1), b = make_q(cols % 256 == 0 ? ggml_type::q6_K : t, 17, cols, 2);
      const tensor_view views[] = {a.view, b.view};
      const auto packed = cpu::pack_weights(views, cpu_isa::best, &pool);
      for (const auto& p : packed) CHECK((p.quant != nullptr) == cpu::packs(p.view.type));
      // Off: no packed copy; and none on a path without the packed kernel.
      CHECK(cpu::pack_weights(views, cpu_isa::best, &pool, {.pack_low_bit = false})[0].quant == nullptr);
      if (cpu::isa_supported(cpu_isa::avx2))
        CHECK(cpu::pack_weights(views, cpu_isa::avx2, &pool)[0].quant == nullptr);
      for (int64_t batch : k_batches)
        for (cpu::thread_pool* tp : {static_cast<cpu::thread_pool*>(nullptr), &pool}) {
          CAPTURE(cols);
          CAPTURE(batch);
          CAPTURE(tp != nullptr);
          const auto x = random_floats(size_t(batch * cols), uint64_t(cols + batch), 1.5f);
          const auto x2 = random_floats(size_t(3 * cols), uint64_t(cols + batch + 1), 1.5f);
          std::vector<float> ra(size_t(batch * 40)), rb(size_t(batch * 17)), rb2(size_t(3 * 17));
          cpu::matmul(a.view, x.data(), batch, ra.data(), scratch, nullptr, cpu_isa::scalar);
          cpu::matmul(b.view, x.data(), batch, rb.data(), scratch, nullptr, cpu_isa::scalar);
          cpu::matmul(b.view, x2.data(), 3, rb2.data(), scratch, nullptr, cpu_isa::scalar);
          std::vector<float> ya(ra.size(), -1.0f), yb(rb.size(), -1.0f), yb2(rb2.size(), -1.0f);
          cpu::matmul(packed[0], x.data(), batch, ya.data(), scratch, tp);
          CHECK(same_bits(ya, ra));
          std::fill(ya.begin(), ya.end(), -1.0f);
          const cpu::packed_weight* ws[] = {&packed[0], &packed[1]};
          float* ys[] = {ya.data(), yb.data()};
          cpu::matmul_many(ws, x.data(), batch, ys, scratch, tp);
          CHECK(same_bits(ya, ra));
          CHECK(same_bits(yb, rb));
          std::fill(ya.begin(), ya.end(), -1.0f);
          const cpu::matmul_job jobs[] = {{&packed[0], x.data(), batch, ya.data()},
                                          {&packed[1], x2.data(), 3, yb2.data()}};
          cpu::matmul_jobs(jobs, scratch, tp);
          CHECK(same_bits(ya, ra));
          CHECK(same_bits(yb2, rb2));
        }
    }
}

TEST_CASE("quant_packed: packed q4_0 expert slices of a stacked tensor give each expert's scalar bits") {
  // A MoE layer's experts reach the kernels as 2-D slices (cpu::expert_slice), prepared and run
  // through matmul_jobs like the forward pass does (matmul_batch).
  const int64_t cols = 96, rows = 40, n_expert = 3;
  const auto src = random_floats(size_t(cols * rows * n_expert), 77, 0.1f);
  const std::vector<uint8_t> stacked = cpu::quantize_rows(ggml_type::q4_0, src.data(), rows * n_expert, cols);
  tensor_view s = view_of(ggml_type::q4_0, stacked, rows, cols);
  s.ne[2] = n_expert;
  s.n_dims = 3;
  std::vector<tensor_view> slices;
  for (int64_t e = 0; e < n_expert; ++e) slices.push_back(cpu::expert_slice(s, e));
  cpu::thread_pool pool(2);
  const auto packed = cpu::pack_weights(slices, cpu_isa::best, &pool);
  const int64_t batches[] = {5, 1, 0};
  std::vector<std::vector<float>> xs, ys, refs;
  std::vector<cpu::matmul_job> jobs;
  std::vector<float> scratch;
  for (int64_t e = 0; e < n_expert; ++e) {
    CHECK((packed[size_t(e)].quant != nullptr) == cpu::packs(ggml_type::q4_0));
    const int64_t b = batches[e];
    xs.push_back(random_floats(size_t(std::max<int64_t>(1, b) * cols), uint64_t(e + 9)));
    ys.emplace_back(size_t(b * rows), -1.0f);
    refs.emplace_back(size_t(b * rows));
    if (b > 0)
      cpu::matmul(slices[size_t(e)], xs.back().data(), b, refs.back().data(), scratch, nullptr,
                  cpu_isa::scalar);
  }
  for (int64_t e = 0; e < n_expert; ++e)
    jobs.push_back(
        cpu::matmul_job{&packed[size_t(e)], xs[size_t(e)].data(), batches[e], ys[size_t(e)].data()});
  for (cpu::thread_pool* tp : {static_cast<cpu::thread_pool*>(nullptr), &pool}) {
    cpu::matmul_jobs(jobs, scratch, tp);
    for (int64_t e = 0; e < n_expert; ++e) {
      CAPTURE(e);
      CHECK(same_bits(ys[size_t(e)], refs[size_t(e)]));
    }
  }
}
