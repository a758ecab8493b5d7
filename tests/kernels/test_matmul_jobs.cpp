// matmul_jobs (kernels/cpu/ops.h): several matmuls on inputs of their own in one fork-join
// give each output the bits matmul gives it alone, on every path, batch and thread count.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tests/kernels/matmul_fixtures.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_ref.h"
#include "kernels/cpu/thread_pool.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// f32 rows [rows][cols] stored as `t`.
std::vector<uint8_t> encode(ggml_type t, const std::vector<float>& w, int64_t rows, int64_t cols) {
  if (cpu::int8_matmul(t)) return cpu::quantize_rows(t, w.data(), rows, cols);
  std::vector<uint8_t> out(row_bytes(t, cols) * size_t(rows));
  if (t == ggml_type::f32) {
    std::memcpy(out.data(), w.data(), out.size());
    return out;
  }
  auto* d = reinterpret_cast<uint16_t*>(out.data());
  for (size_t i = 0; i < w.size(); ++i)
    d[i] = t == ggml_type::f16 ? cpu::fp32_to_fp16(w[i]) : cpu::fp32_to_bf16(w[i]);
  return out;
}

}  // namespace

TEST_CASE("matmul_jobs: each job gets the bits matmul gives it alone, on every path, batch and thread count") {
  // Row counts that are not multiples of a 24-row group or an 8-row tile, jobs of different
  // batch sizes side by side (a decode step's experts get 1 row each; a prefill's a few
  // each), one type at a time and a mix of float and low-bit weights (two fork-joins).
  const int64_t k = 256;
  const std::vector<int64_t> rows = {96, 200, 48, 13};
  const std::vector<std::vector<ggml_type>> type_sets = {
      {ggml_type::f32}, {ggml_type::f16}, {ggml_type::bf16}, {ggml_type::q8_0}, {ggml_type::q4_K}, {ggml_type::q4_0},
      {ggml_type::f16, ggml_type::q8_0, ggml_type::q6_K, ggml_type::bf16}};
  cpu::thread_pool tp(2);
  std::vector<cpu_isa> isas;
  for (cpu_isa i : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512, cpu_isa::amx})
    if (cpu::isa_supported(i)) isas.push_back(i);
  for (const auto& types : type_sets) {
    std::vector<std::vector<float>> f32s;
    std::vector<std::vector<uint8_t>> bytes;
    std::vector<tensor_view> views;
    for (size_t i = 0; i < rows.size(); ++i) {
      f32s.push_back(random_floats(size_t(rows[i] * k), 500 + i));
      const ggml_type t = types[i % types.size()];
      bytes.push_back(encode(t, f32s.back(), rows[i], k));
      views.push_back(view_of(t, bytes.back(), rows[i], k));
    }
    for (cpu_isa isa : isas)
      for (cpu::thread_pool* pool : {static_cast<cpu::thread_pool*>(nullptr), &tp})
        for (const std::vector<int64_t>& batches :
             {std::vector<int64_t>{1, 1, 1, 1}, std::vector<int64_t>{3, 1, 40, 7}, std::vector<int64_t>{64, 0, 2, 1}}) {
          CAPTURE(to_string(types[0]));
          CAPTURE(types.size());
          CAPTURE(cpu::to_string(isa));
          CAPTURE(pool != nullptr);
          CAPTURE(batches[0]);
          const auto packed = cpu::pack_weights(views, isa, &tp);
          std::vector<std::vector<float>> xs, alone, together;
          std::vector<cpu::matmul_job> jobs;
          std::vector<float> scratch;
          for (size_t i = 0; i < rows.size(); ++i) {
            xs.push_back(random_floats(size_t(batches[i] * k), 600 + i));
            alone.emplace_back(size_t(batches[i] * rows[i]));
            together.emplace_back(size_t(batches[i] * rows[i]), -1.0f);
            cpu::matmul(packed[i], xs[i].data(), batches[i], alone[i].data(), scratch, pool);
          }
          for (size_t i = 0; i < rows.size(); ++i)
            jobs.push_back(cpu::matmul_job{&packed[i], xs[i].data(), batches[i], together[i].data()});
          cpu::matmul_jobs(jobs, scratch, pool);
          for (size_t i = 0; i < rows.size(); ++i) {
            CAPTURE(i);
            // (a job of batch 0 writes nothing; memcmp may not see its null data)
            if (!alone[i].empty()) REQUIRE(std::memcmp(alone[i].data(), together[i].data(), alone[i].size() * 4) == 0);
            // And near a naive f64 product of the stored weights: the low-bit types also
            // round each input to int8 steps of max|x| / 127 (an error of at most half a step
            // times sum |w|); 1e-3 covers the f32 accumulation.
            std::vector<float> w(size_t(rows[i] * k));
            for (int64_t r = 0; r < rows[i]; ++r)
              cpu::dequantize_row(views[i].type, views[i].row(r), w.data() + r * k, k);
            const bool int8 = cpu::int8_matmul(views[i].type);
            for (int64_t b = 0; b < batches[i]; ++b) {
              double xmax = 0;
              for (int64_t j = 0; j < k; ++j)
                xmax = std::max(xmax, std::fabs(double(xs[i][size_t(b * k + j)])));
              for (int64_t r = 0; r < rows[i]; ++r) {
                double ref = 0, wabs = 0;
                for (int64_t j = 0; j < k; ++j) {
                  ref += double(w[size_t(r * k + j)]) * xs[i][size_t(b * k + j)];
                  wabs += std::fabs(double(w[size_t(r * k + j)]));
                }
                const double bound = 1e-3 + (int8 ? wabs * xmax / 254.0 : 0.0);
                REQUIRE(std::fabs(together[i][size_t(b * rows[i] + r)] - ref) <= bound);
              }
            }
          }
        }
  }
}

TEST_CASE("matmul_jobs: weighted parts give every group to exactly one range of any split") {
  // Parts of 5, 0, 3 and 7 groups weighing 4, 1, 1 and 9 units each (a job's batch).
  const std::vector<int64_t> groups = {5, 0, 3, 7}, per = {4, 1, 1, 9};
  std::vector<int64_t> off(1, 0);
  for (size_t i = 0; i < groups.size(); ++i) off.push_back(off.back() + groups[i] * per[i]);
  for (int64_t chunks : {1, 2, 3, 7, 16, 200}) {
    CAPTURE(chunks);
    std::vector<std::vector<int>> seen(groups.size());
    for (size_t i = 0; i < groups.size(); ++i) seen[i].assign(size_t(groups[i]), 0);
    for (int64_t c = 0; c < chunks; ++c)
      cpu::for_weighted_parts(off, per, off.back() * c / chunks, off.back() * (c + 1) / chunks,
                              [&](size_t i, int64_t g0, int64_t g1) {
                                REQUIRE(0 <= g0);
                                REQUIRE(g0 < g1);
                                REQUIRE(g1 <= groups[i]);
                                for (int64_t g = g0; g < g1; ++g) ++seen[i][size_t(g)];
                              });
    for (const auto& s : seen)
      for (int n : s) REQUIRE(n == 1);
  }
}
