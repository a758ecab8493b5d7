// CPU kernels vs naive double-precision references (tolerances like ggml's backend tests).
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tests/kernels/matmul_fixtures.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/thread_pool.h"

using namespace tandem;
using namespace tandem::test;

namespace {

/// Encodes f32 rows [rows][cols] as `t`.
std::vector<uint8_t> encode(ggml_type t, const std::vector<float>& w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(row_bytes(t, cols) * size_t(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = w.data() + r * cols;
    uint8_t* dst = out.data() + size_t(r) * row_bytes(t, cols);
    if (t == ggml_type::f32) {
      std::memcpy(dst, src, size_t(cols) * 4);
    } else if (t == ggml_type::f16 || t == ggml_type::bf16) {
      auto d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < cols; ++i) d[i] = t == ggml_type::f16 ? cpu::fp32_to_fp16(src[i]) : cpu::fp32_to_bf16(src[i]);
    } else {
      auto b = reinterpret_cast<block_q8_0*>(dst);
      for (int64_t k = 0; k < cols / 32; ++k) {
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(src[k * 32 + j]));
        const float d = amax / 127.0f;
        b[k].d = cpu::fp32_to_fp16(d);
        for (int j = 0; j < 32; ++j) b[k].qs[j] = int8_t(std::lround(d ? src[k * 32 + j] / d : 0.0f));
      }
    }
  }
  return out;
}

/// Normalised mean squared error, as ggml's test-backend-ops uses.
double nmse(const std::vector<float>& a, const std::vector<double>& ref) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += (a[i] - ref[i]) * (a[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return err / norm;
}

}  // namespace

TEST_CASE("ops: fp16 and bf16 conversions round-trip and round to nearest even") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t hb = uint16_t(h);
    const float f = cpu::fp16_to_fp32(hb);
    if (std::isnan(f)) {
      CHECK(std::isnan(cpu::fp16_to_fp32(cpu::fp32_to_fp16(f))));
      continue;
    }
    REQUIRE(cpu::fp32_to_fp16(f) == hb);
    REQUIRE(cpu::bf16_to_fp32(cpu::fp32_to_bf16(cpu::bf16_to_fp32(hb))) == cpu::bf16_to_fp32(hb));
  }
  CHECK(cpu::fp16_to_fp32(0x3c00) == 1.0f);
  CHECK(cpu::fp16_to_fp32(0x0001) == std::ldexp(1.0f, -24));
  CHECK(cpu::fp32_to_fp16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);      // tie -> even
  CHECK(cpu::fp32_to_fp16(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);  // tie -> even (up)
  CHECK(cpu::fp32_to_fp16(1e6f) == 0x7c00);
  CHECK(cpu::fp32_to_bf16(1.0f) == 0x3f80);
  CHECK(cpu::bf16_to_fp32(0x4049) == doctest::Approx(3.140625f));
}

TEST_CASE("ops: matmul matches a naive reference for every weight type") {
  const int64_t n = 37, k = 96, batch = 5;
  const auto wf = random_floats(size_t(n * k), 1);
  const auto x = random_floats(size_t(batch * k), 2);
  for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
    CAPTURE(to_string(t));
    const auto bytes = encode(t, wf, n, k);
    const auto w = view_of(t, bytes, n, k);
    // Reference from the dequantized weights, so only the arithmetic is compared.
    std::vector<float> wd(static_cast<size_t>(n * k));
    for (int64_t r = 0; r < n; ++r) cpu::dequantize_row(t, w.row(r), wd.data() + r * k, k);
    std::vector<double> ref(static_cast<size_t>(batch * n));
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t r = 0; r < n; ++r) {
        double s = 0;
        for (int64_t i = 0; i < k; ++i) s += double(wd[size_t(r * k + i)]) * x[size_t(b * k + i)];
        ref[size_t(b * n + r)] = s;
      }
    std::vector<float> y(static_cast<size_t>(batch * n)), scratch;
    cpu::matmul(w, x.data(), batch, y.data(), scratch);
    // q8_0 multiplies 8-bit activations as llama.cpp does (quant_matmul.h; its bound is checked
    // in test_quant.cpp): the activation rounding, relative 2e-3 per value, shows here.
    CHECK(nmse(y, ref) < (t == ggml_type::q8_0 ? 1e-4 : 1e-10));
    // Dequantization itself is close to the original weights.
    const double tol = t == ggml_type::f32 ? 0 : t == ggml_type::f16 ? 1e-3 : 1e-2;
    for (size_t i = 0; i < wd.size(); ++i) REQUIRE(std::fabs(wd[i] - wf[i]) <= tol);
    // Batch 1 gives the same bits as batch N.
    for (int64_t b = 0; b < batch; ++b) {
      std::vector<float> y1(static_cast<size_t>(n));
      cpu::matmul(w, x.data() + b * k, 1, y1.data(), scratch);
      REQUIRE(std::memcmp(y1.data(), y.data() + b * n, size_t(n) * 4) == 0);
    }
  }
}

TEST_CASE("ops: get_rows reads any type and rejects bad ids") {
  const int64_t rows = 10, cols = 64;
  const auto wf = random_floats(size_t(rows * cols), 3);
  for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
    const auto bytes = encode(t, wf, rows, cols);
    const auto v = view_of(t, bytes, rows, cols);
    const int32_t ids[] = {7, 0, 7};
    std::vector<float> out(3 * size_t(cols)), want(static_cast<size_t>(cols));
    cpu::get_rows(v, ids, out.data());
    cpu::dequantize_row(t, v.row(7), want.data(), cols);
    CHECK(std::memcmp(out.data(), want.data(), size_t(cols) * 4) == 0);
    CHECK(std::memcmp(out.data() + 2 * cols, want.data(), size_t(cols) * 4) == 0);
    const int32_t bad[] = {10};
    CHECK_THROWS_WITH(cpu::get_rows(v, bad, out.data()), doctest::Contains("token id 10"));
  }
}

TEST_CASE("ops: rms_norm, rope and the residual add give the same bits in any row split and thread count") {
  // rms_norm runs 8 rows' sums side by side, rope takes its angles from a table built once
  // per forward pass, and all three split rows across threads: each row must still come
  // out exactly as it does alone.
  const int64_t rows = 21, n = 96;  // 8 + 8 + 5 rows
  const int n_heads = 3, hd = 32;
  const auto x = random_floats(size_t(rows * n), 90, 4.0f);
  const auto w = random_floats(size_t(n), 91);
  std::vector<int32_t> pos(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) pos[size_t(r)] = int32_t(r * 37 % 1500);
  std::vector<float> alone(x.size());
  for (int64_t r = 0; r < rows; ++r) cpu::rms_norm(x.data() + r * n, w.data(), alone.data() + r * n, 1, n, 1e-5f);
  std::vector<float> rope_alone = x;
  for (int64_t r = 0; r < rows; ++r)
    cpu::rope(rope_alone.data() + r * n, pos.data() + r, 1, n_heads, hd, 10000.0f);
  cpu::rope_table table;
  table.build(pos.data(), rows, hd, 10000.0f);
  // Large enough for the pool to split (the kernels keep small calls on one thread).
  const int64_t big_rows = 1024;
  std::vector<float> xb, wantb, ropeb;
  for (int64_t r = 0; r < big_rows; ++r) {
    xb.insert(xb.end(), x.begin() + (r % rows) * n, x.begin() + (r % rows + 1) * n);
    wantb.insert(wantb.end(), alone.begin() + (r % rows) * n, alone.begin() + (r % rows + 1) * n);
    ropeb.insert(ropeb.end(), rope_alone.begin() + (r % rows) * n, rope_alone.begin() + (r % rows + 1) * n);
  }
  std::vector<int32_t> posb(static_cast<size_t>(big_rows));
  for (int64_t r = 0; r < big_rows; ++r) posb[size_t(r)] = pos[size_t(r % rows)];
  cpu::rope_table tb;
  tb.build(posb.data(), big_rows, hd, 10000.0f);
  cpu::thread_pool tp(2);
  for (cpu::thread_pool* pool : {static_cast<cpu::thread_pool*>(nullptr), &tp}) {
    CAPTURE(pool != nullptr);
    std::vector<float> y(x.size());
    cpu::rms_norm(x.data(), w.data(), y.data(), rows, n, 1e-5f, pool);
    REQUIRE(std::memcmp(y.data(), alone.data(), y.size() * 4) == 0);
    std::vector<float> yb(xb.size());
    cpu::rms_norm(xb.data(), w.data(), yb.data(), big_rows, n, 1e-5f, pool);
    REQUIRE(std::memcmp(yb.data(), wantb.data(), yb.size() * 4) == 0);

    auto q = x;
    cpu::rope(q.data(), table, n_heads, pool);
    REQUIRE(std::memcmp(q.data(), rope_alone.data(), q.size() * 4) == 0);
    auto qb = xb;
    cpu::rope(qb.data(), tb, n_heads, pool);
    REQUIRE(std::memcmp(qb.data(), ropeb.data(), qb.size() * 4) == 0);

    auto sum = xb;
    cpu::add_inplace(sum.data(), wantb.data(), int64_t(sum.size()) - 3, pool);  // an odd length
    for (size_t i = 0; i < sum.size(); ++i) REQUIRE(sum[i] == (i + 3 < sum.size() ? xb[i] + wantb[i] : xb[i]));
  }
}

TEST_CASE("ops: rms_norm, rope, swiglu, softmax match naive references") {
  const int64_t rows = 3, n = 64;
  auto x = random_floats(size_t(rows * n), 4, 3.0f);
  const auto w = random_floats(size_t(n), 5);
  std::vector<float> y(x.size());
  cpu::rms_norm(x.data(), w.data(), y.data(), rows, n, 1e-5f);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[size_t(r * n + i)]) * x[size_t(r * n + i)];
    const double s = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) REQUIRE(y[size_t(r * n + i)] == doctest::Approx(x[size_t(r * n + i)] * s * w[size_t(i)]).epsilon(1e-5));
  }

  const int n_heads = 2, hd = 32;
  const int32_t pos[] = {0, 5, 1000};
  auto q = x;
  cpu::rope(q.data(), pos, rows, n_heads, hd, 10000.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < n_heads; ++h)
      for (int i = 0; i < hd / 2; ++i) {
        const size_t o = size_t((r * n_heads + h) * hd + 2 * i);
        const double th = pos[r] * std::pow(10000.0, -2.0 * i / hd);
        const double a = x[o], b = x[o + 1];
        REQUIRE(q[o] == doctest::Approx(a * std::cos(th) - b * std::sin(th)).epsilon(1e-5));
        REQUIRE(q[o + 1] == doctest::Approx(a * std::sin(th) + b * std::cos(th)).epsilon(1e-5));
      }
  // Position 0 is the identity.
  for (int i = 0; i < n; ++i) CHECK(q[size_t(i)] == x[size_t(i)]);

  std::vector<float> s(static_cast<size_t>(n));
  cpu::swiglu(x.data(), w.data(), s.data(), size_t(n));
  for (int i = 0; i < n; ++i) {
    const double g = x[size_t(i)];
    REQUIRE(s[size_t(i)] == doctest::Approx(g / (1 + std::exp(-g)) * w[size_t(i)]).epsilon(1e-5));
  }

  std::vector<float> sm(x.begin(), x.begin() + n);
  sm[3] = 80.0f;  // large value: must not overflow
  std::vector<double> e(static_cast<size_t>(n));
  double tot = 0;
  for (int i = 0; i < n; ++i) tot += e[size_t(i)] = std::exp(double(sm[size_t(i)]) - 80.0);
  cpu::softmax(sm.data(), size_t(n));
  for (int i = 0; i < n; ++i) REQUIRE(sm[size_t(i)] == doctest::Approx(e[size_t(i)] / tot).epsilon(1e-5));
}

TEST_CASE("ops: paged attention (GQA, causal) matches contiguous attention") {
  kv_layout L{.n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .page_size = 4};
  kv_pool pool(L, 8);
  const int n_heads = 4, layer = 1;
  const int64_t n_ctx = 11;
  const std::vector<int32_t> pages = {5, 2, 7};  // scattered on purpose
  const auto k = random_floats(size_t(n_ctx * L.n_kv_heads * L.head_dim), 6);
  const auto v = random_floats(size_t(n_ctx * L.n_kv_heads * L.head_dim), 7);
  const size_t row = size_t(L.n_kv_heads * L.head_dim);
  for (int64_t p = 0; p < n_ctx; ++p) {
    std::memcpy(pool.k(pages[size_t(p / 4)], layer) + size_t(p % 4) * row, k.data() + size_t(p) * row, row * 4);
    std::memcpy(pool.v(pages[size_t(p / 4)], layer) + size_t(p % 4) * row, v.data() + size_t(p) * row, row * 4);
  }
  const int64_t n_tok = 3;
  const int32_t pos0 = int32_t(n_ctx - n_tok);
  const auto q = random_floats(size_t(n_tok * n_heads * L.head_dim), 8);
  std::vector<float> out(q.size()), scratch;
  cpu::paged_attention(q.data(), n_tok, pos0, n_heads, pool, layer, pages, out.data(), scratch);
  std::vector<double> ref(q.size());
  for (int64_t t = 0; t < n_tok; ++t)
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / 2;
      const int64_t len = pos0 + t + 1;
      std::vector<double> a(static_cast<size_t>(len));
      double mx = -1e300, tot = 0;
      for (int64_t p = 0; p < len; ++p) {
        double s = 0;
        for (int d = 0; d < 16; ++d) s += double(q[size_t((t * n_heads + h) * 16 + d)]) * k[size_t(p) * row + size_t(kvh * 16 + d)];
        a[size_t(p)] = s / 4.0;
        mx = std::max(mx, a[size_t(p)]);
      }
      for (auto& z : a) tot += z = std::exp(z - mx);
      for (int d = 0; d < 16; ++d) {
        double o = 0;
        for (int64_t p = 0; p < len; ++p) o += a[size_t(p)] / tot * v[size_t(p) * row + size_t(kvh * 16 + d)];
        ref[size_t((t * n_heads + h) * 16 + d)] = o;
      }
    }
  CHECK(nmse(out, ref) < 1e-10);
  CHECK_THROWS(cpu::paged_attention(q.data(), n_tok, 20, n_heads, pool, layer, pages, out.data(), scratch));
}

TEST_CASE("ops: thread_pool covers the range once and rethrows, threaded matmul is bit-identical") {
  cpu::thread_pool pool(3);
  CHECK(pool.size() == 3);
  for (int64_t n : {1, 2, 3, 10, 1000}) {
    std::vector<int> hits(size_t(n), 0);
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
    });
    CHECK(std::count(hits.begin(), hits.end(), 1) == n);
  }
  CHECK_THROWS_WITH(pool.parallel_for(100, [](int64_t b, int64_t) {
                      if (b > 0) throw std::runtime_error("chunk failed");
                    }),
                    "chunk failed");
  // Dynamic chunks: every index exactly once, in contiguous chunks of about n / (3 x 4).
  for (int64_t n : {1, 2, 5, 12, 13, 1000}) {
    CAPTURE(n);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
    std::atomic<int> calls{0};
    pool.parallel_for_dynamic(n, 4, [&](int64_t b, int64_t e) {
      CHECK(e - b <= (n + 11) / 12);
      ++calls;
      for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
    });
    for (auto& h : hits) CHECK(h.load() == 1);
    CHECK(calls.load() == std::min<int64_t>(n, 12));
  }
  CHECK_THROWS_WITH(pool.parallel_for_dynamic(100, 4, [](int64_t b, int64_t) {
                      if (b > 50) throw std::runtime_error("dynamic chunk failed");
                    }),
                    "dynamic chunk failed");
  // The pool still works after a throwing job.
  std::atomic<int64_t> sum{0};
  pool.parallel_for_dynamic(10, 2, [&](int64_t b, int64_t e) { sum += e - b; });
  CHECK(sum.load() == 10);
  const int64_t n = 300, k = 128, batch = 4;
  const auto wf = random_floats(size_t(n * k), 9);
  const auto x = random_floats(size_t(batch * k), 10);
  for (ggml_type t : {ggml_type::f32, ggml_type::q8_0}) {
    const auto bytes = encode(t, wf, n, k);
    const auto w = view_of(t, bytes, n, k);
    std::vector<float> y1(static_cast<size_t>(batch * n)), y3(y1.size()), scratch;
    cpu::matmul(w, x.data(), batch, y1.data(), scratch);
    cpu::matmul(w, x.data(), batch, y3.data(), scratch, &pool);
    CHECK(std::memcmp(y1.data(), y3.data(), y1.size() * 4) == 0);
  }
}

TEST_CASE("ops: matmul throughput on a 768x2048 matrix (F16, Q8_0, batch 1 and 8)") {
  // Reports GFLOP/s for the lead to quote; asserts only that the numbers are correct.
  const int64_t n = 768, k = 2048;
  const auto wf = random_floats(size_t(n * k), 11, 0.1f);
  const auto x = random_floats(size_t(8 * k), 12);
  cpu::thread_pool pool(2);
  for (ggml_type t : {ggml_type::f16, ggml_type::q8_0}) {
    const auto bytes = encode(t, wf, n, k);
    const auto w = view_of(t, bytes, n, k);
    std::vector<float> wd(size_t(n * k));
    for (int64_t r = 0; r < n; ++r) cpu::dequantize_row(t, w.row(r), wd.data() + r * k, k);
    for (int64_t batch : {1, 8}) {
      for (cpu::thread_pool* p : {static_cast<cpu::thread_pool*>(nullptr), &pool}) {
        std::vector<float> y(size_t(batch * n)), scratch;
        cpu::matmul(w, x.data(), batch, y.data(), scratch, p);  // warm-up
        int iters = 0;
        const auto t0 = std::chrono::steady_clock::now();
        double sec = 0;
        do {
          cpu::matmul(w, x.data(), batch, y.data(), scratch, p);
          ++iters;
          sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        } while (sec < 0.2);
        const double gflops = 2.0 * double(n * k * batch) * iters / sec / 1e9;
        MESSAGE(fmt::format("matmul {} {}x{} batch {} threads {}: {:.1f} GFLOP/s ({:.3f} ms/call)", to_string(t), n,
                            k, batch, p ? 2 : 1, gflops, sec / iters * 1e3));
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t r = 0; r < n; r += 97) {
            double s = 0;
            for (int64_t i = 0; i < k; ++i) s += double(wd[size_t(r * k + i)]) * x[size_t(b * k + i)];
            // q8_0: 8-bit activations (see the naive-reference case).
            REQUIRE(y[size_t(b * n + r)] == doctest::Approx(s).epsilon(t == ggml_type::q8_0 ? 3e-2 : 1e-4).scale(1.0));
          }
      }
    }
  }
}

TEST_CASE("ops: matmul with odd shapes is bit-identical for any batch split and thread count") {
  // k = 44 leaves a tail of 4 after the 8-wide steps; 29 rows leave partial row tiles.
  cpu::thread_pool pool(2);
  for (int64_t k : {44, 64}) {
    const int64_t n = 29, batch = 7;
    const auto wf = random_floats(size_t(n * k * 40), 13);  // 40x the rows: big enough to thread
    const auto x = random_floats(size_t(batch * k), 14);
    for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
      if (t == ggml_type::q8_0 && k % 32 != 0) continue;
      CAPTURE(to_string(t));
      CAPTURE(k);
      const int64_t rows = n * 40;
      const auto bytes = encode(t, wf, rows, k);
      const auto w = view_of(t, bytes, rows, k);
      std::vector<float> wd(size_t(rows * k));
      for (int64_t r = 0; r < rows; ++r) cpu::dequantize_row(t, w.row(r), wd.data() + r * k, k);
      std::vector<float> all(size_t(batch * rows)), threaded(all.size()), scratch;
      cpu::matmul(w, x.data(), batch, all.data(), scratch);
      cpu::matmul(w, x.data(), batch, threaded.data(), scratch, &pool);
      REQUIRE(std::memcmp(all.data(), threaded.data(), all.size() * 4) == 0);
      for (int64_t b = 0; b < batch; ++b) {
        std::vector<float> one(static_cast<size_t>(rows));
        cpu::matmul(w, x.data() + b * k, 1, one.data(), scratch, b % 2 ? &pool : nullptr);
        REQUIRE(std::memcmp(one.data(), all.data() + b * rows, size_t(rows) * 4) == 0);
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0;
          for (int64_t i = 0; i < k; ++i) s += double(wd[size_t(r * k + i)]) * x[size_t(b * k + i)];
          REQUIRE(one[size_t(r)] == doctest::Approx(s).epsilon(t == ggml_type::q8_0 ? 3e-2 : 1e-5).scale(1.0));
        }
      }
      // Batch 3 starting at row 2: a different tile mix, same bits.
      std::vector<float> mid(size_t(3 * rows));
      cpu::matmul(w, x.data() + 2 * k, 3, mid.data(), scratch);
      REQUIRE(std::memcmp(mid.data(), all.data() + 2 * rows, mid.size() * 4) == 0);
    }
  }
}

namespace {

std::vector<cpu_isa> runnable_isas() {
  std::vector<cpu_isa> out;
  for (cpu_isa i : {cpu_isa::scalar, cpu_isa::avx2, cpu_isa::avx512, cpu_isa::amx})
    if (cpu::isa_supported(i)) out.push_back(i);
  return out;
}

// One TDPBF16PS step for one output as the Intel SDM defines it: an even-pair and an
// odd-pair FMA chain from 0 (inputs and results below the normal range taken as 0), then
// acc + (even + odd).
float tdp_one(float acc, const uint16_t* a, const uint16_t* b) {
  auto f = [](uint16_t h) {
    if ((h & 0x7f80) == 0) h &= 0x8000;  // denormal input -> 0
    return cpu::bf16_to_fp32(h);
  };
  auto ftz = [](float v) { return std::fabs(v) < std::numeric_limits<float>::min() ? 0.0f * v : v; };
  float even = 0, odd = 0;
  for (int p = 0; p < 16; ++p) {
    even = ftz(std::fma(f(a[2 * p]), f(b[2 * p]), even));
    odd = ftz(std::fma(f(a[2 * p + 1]), f(b[2 * p + 1]), odd));
  }
  return ftz(acc + ftz(even + odd));
}

// y = sum w x as the amx path computes it, one output at a time: per 32-column block, the
// products of pieces in the order amx.h states.
float amx_emulated(ggml_type t, const uint16_t* w, const float* x, int64_t k) {
  float acc = 0;
  for (int64_t kb = 0; kb < (k + 31) / 32; ++kb) {
    uint16_t xp[3][32] = {}, wp[2][32] = {};
    for (int j = 0; j < 32 && kb * 32 + j < k; ++j) {
      const int64_t c = kb * 32 + j;
      cpu::amx_split_activation(x[c], xp[0][j], xp[1][j], xp[2][j]);
      if (t == ggml_type::bf16) {
        wp[0][j] = w[c];
      } else {
        const float v = cpu::fp16_to_fp32(w[c]);
        uint32_t u;
        std::memcpy(&u, &v, 4);
        wp[0][j] = uint16_t(u >> 16);  // truncated: the top 8 significant bits
        const float lo = v - cpu::bf16_to_fp32(wp[0][j]);
        std::memcpy(&u, &lo, 4);
        wp[1][j] = uint16_t(u >> 16);  // exact: at most 3 bits remain
      }
    }
    for (int p = 0; p < 3; ++p) acc = tdp_one(acc, xp[p], wp[0]);
    if (t == ggml_type::f16)
      for (int p = 0; p < 2; ++p) acc = tdp_one(acc, xp[p], wp[1]);
  }
  return acc;
}

}  // namespace

TEST_CASE("ops: the amx matmul is bit for bit the documented tile arithmetic, with f32 accuracy") {
  if (!cpu::isa_supported(cpu_isa::amx)) {
    MESSAGE("this CPU or OS has no AMX tiles; the amx path is not run here");
    return;
  }
  cpu::thread_pool pool(2);
  // Splitting is exact: the three pieces add back to x (in this order, without rounding).
  for (float v : random_floats(1000, 40, 1e3f)) {
    uint16_t h, m, l;
    cpu::amx_split_activation(v, h, m, l);
    CHECK(double(cpu::bf16_to_fp32(h)) + double(cpu::bf16_to_fp32(m)) + double(cpu::bf16_to_fp32(l)) == double(v));
  }
  struct shape {
    int64_t n, k, batch;
  };
  // Tails of rows (n % 16), columns (k % 32) and batch (b % 16); several 4-group blocks.
  // Batches of 2+ tiles with k over 8 blocks run passes in pieces (groups_run), the last one short.
  for (const shape sh : {shape{37, 70, 5}, shape{128, 96, 33}, shape{16, 32, 1}, shape{200, 768, 17}, shape{50, 300, 40}}) {
    const auto wf = random_floats(size_t(sh.n * sh.k), 41, 0.5f);
    const auto x = random_floats(size_t(sh.batch * sh.k), 42, 3.0f);
    for (ggml_type t : {ggml_type::f16, ggml_type::bf16}) {
      CAPTURE(to_string(t));
      CAPTURE(sh.k);
      const auto bytes = encode(t, wf, sh.n, sh.k);
      const auto w = view_of(t, bytes, sh.n, sh.k);
      const cpu::packed_weight pw = cpu::pack_weight(w, cpu_isa::amx, &pool);
      REQUIRE(pw.amx != nullptr);
      std::vector<float> y(size_t(sh.batch * sh.n)), scratch;
      cpu::matmul(pw, x.data(), sh.batch, y.data(), scratch, &pool);
      double err = 0, ref2 = 0, f32err = 0;
      for (int64_t b = 0; b < sh.batch; ++b)
        for (int64_t r = 0; r < sh.n; ++r) {
          const auto* wr = reinterpret_cast<const uint16_t*>(w.row(r));
          const float* xb = x.data() + b * sh.k;
          REQUIRE(y[size_t(b * sh.n + r)] == amx_emulated(t, wr, xb, sh.k));
          double ref = 0;
          float f32 = 0;
          for (int64_t i = 0; i < sh.k; ++i) {
            const float wv = t == ggml_type::f16 ? cpu::fp16_to_fp32(wr[i]) : cpu::bf16_to_fp32(wr[i]);
            ref += double(wv) * xb[i];
            f32 = std::fma(wv, xb[i], f32);
          }
          err += std::pow(y[size_t(b * sh.n + r)] - ref, 2);
          f32err += std::pow(double(f32) - ref, 2);
          ref2 += ref * ref;
        }
      // Packed together with another matrix into one shared buffer: the same bits.
      const tensor_view both[] = {w, w};
      const auto packed = cpu::pack_weights(both, cpu_isa::amx, &pool);
      REQUIRE(packed.size() == 2);
      REQUIRE(packed[1].amx != nullptr);
      CHECK(packed[1].amx->data.get() == packed[0].amx->data.get() + cpu::amx_packed_bytes(w) / 2);
      std::vector<float> y2(y.size());
      cpu::matmul(packed[1], x.data(), sh.batch, y2.data(), scratch, &pool);
      CHECK(std::memcmp(y.data(), y2.data(), y.size() * 4) == 0);
      // As accurate as an f32 dot product: no term was rounded to bf16 (a bf16 rounding of
      // x alone would leave an error near 1e-6 of the result, 1e-12 here).
      CHECK(err / ref2 < 1e-13);
      CHECK(err <= 4 * f32err + 1e-30);
    }
  }
}

TEST_CASE("ops: amx activations at the ends of the float range give the emulated tile bits at every batch") {
  if (!cpu::isa_supported(cpu_isa::amx)) {
    MESSAGE("this CPU or OS has no AMX tiles; the amx path is not run here");
    return;
  }
  cpu::thread_pool pool(2);
  // Rows of three kinds, so that no value swamps the others of its row: ordinary values with
  // denormals, signed zeros and values near the smallest normal among them; values a few
  // hundred times the smallest normal (their second or third piece is denormal: the tile split
  // makes those zero where the scalar split keeps them, and the tile unit reads them as zero
  // either way); values near the top of the range.
  const int64_t n = 40, k = 96, batch = 21;
  const float tiny = std::numeric_limits<float>::min(), denorm = std::numeric_limits<float>::denorm_min();
  const float odd[] = {tiny, -tiny, denorm, -denorm * 77, tiny * 3.3f, 0.0f, -0.0f, tiny / 3, tiny * 1.7f};
  std::vector<float> x(size_t(batch * k));
  const auto r = random_floats(x.size(), 43, 1.0f);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < k; ++c) {
      const size_t i = size_t(b * k + c);
      switch (b % 3) {
        case 0: x[i] = c % 3 == 0 ? odd[size_t(c) % std::size(odd)] : r[i]; break;
        case 1: x[i] = r[i] * tiny * 300.0f; break;
        default: x[i] = r[i] * 3e36f; break;
      }
    }
  const auto wf = random_floats(size_t(n * k), 44, 0.5f);
  for (ggml_type t : {ggml_type::f16, ggml_type::bf16}) {
    CAPTURE(to_string(t));
    const auto bytes = encode(t, wf, n, k);
    const auto w = view_of(t, bytes, n, k);
    const cpu::packed_weight pw = cpu::pack_weight(w, cpu_isa::amx, &pool);
    REQUIRE(pw.amx != nullptr);
    std::vector<float> y(size_t(batch * n)), one(static_cast<size_t>(n)), scratch;
    cpu::matmul(pw, x.data(), batch, y.data(), scratch, &pool);  // two activation tiles
    for (int64_t b = 0; b < batch; ++b) {
      CAPTURE(b);
      cpu::matmul(pw, x.data() + b * k, 1, one.data(), scratch, &pool);  // the batch-1 emulation
      for (int64_t j = 0; j < n; ++j) {
        const float e = amx_emulated(t, reinterpret_cast<const uint16_t*>(w.row(j)), x.data() + b * k, k);
        REQUIRE(std::memcmp(&y[size_t(b * n + j)], &e, 4) == 0);
        REQUIRE(std::memcmp(&one[size_t(j)], &e, 4) == 0);
      }
    }
  }
}

TEST_CASE("ops: isa names parse, best resolves to a runnable path, a missing one is refused") {
  CHECK(cpu::parse_isa("avx512") == cpu_isa::avx512);
  CHECK(cpu::parse_isa("scalar") == cpu_isa::scalar);
  CHECK_THROWS_WITH(cpu::parse_isa("sse9"), doctest::Contains("use best, scalar, avx2, avx512 or amx"));
  CHECK(cpu::parse_isa("amx") == cpu_isa::amx);
  // amx is avx512 plus tiles; everything but the f16/bf16 matmul runs avx512's kernels.
  if (cpu::isa_supported(cpu_isa::amx)) CHECK(cpu::isa_supported(cpu_isa::avx512));
  CHECK(cpu::vector_isa(cpu_isa::amx) == cpu_isa::avx512);
  CHECK(cpu::resolve_isa(cpu_isa::best) == cpu::detected_isa());
  CHECK(cpu::isa_supported(cpu::detected_isa()));
  CHECK(cpu::resolve_isa(cpu_isa::scalar) == cpu_isa::scalar);
  // AVX-512 implies AVX2 here (the dispatch relies on it).
  if (cpu::isa_supported(cpu_isa::avx512)) CHECK(cpu::isa_supported(cpu_isa::avx2));
  if (!cpu::isa_supported(cpu_isa::avx512))
    CHECK_THROWS_WITH(cpu::resolve_isa(cpu_isa::avx512), doctest::Contains("cannot run the avx512 kernels"));
}

TEST_CASE("ops: every isa path of matmul matches the reference and keeps its bits over batch and threads") {
  // Covers the k % 16 and k % 8 tails, the 4x6 tiles with every remainder, the balanced
  // tile widths of decode batches 2, 8 and 32 (2, 4+4, 6+6+5+5+5+5), and (k = 2048,
  // batch 100) several L2 blocks of activation rows on the avx512 path.
  cpu::thread_pool pool(2);
  struct shape {
    int64_t n, k, batch;
  };
  for (const shape sh : {shape{70, 40, 13}, shape{45, 100, 7}, shape{64, 96, 11}, shape{24, 2048, 100},
                          shape{33, 64, 2}, shape{16, 96, 8}, shape{20, 768, 32}}) {
    const auto wf = random_floats(size_t(sh.n * sh.k), 21, 0.2f);
    const auto x = random_floats(size_t(sh.batch * sh.k), 22);
    for (ggml_type t : {ggml_type::f32, ggml_type::f16, ggml_type::bf16, ggml_type::q8_0}) {
      if (t == ggml_type::q8_0 && sh.k % 32 != 0) continue;
      const auto bytes = encode(t, wf, sh.n, sh.k);
      const auto w = view_of(t, bytes, sh.n, sh.k);
      std::vector<float> wd(size_t(sh.n * sh.k));
      for (int64_t r = 0; r < sh.n; ++r) cpu::dequantize_row(t, w.row(r), wd.data() + r * sh.k, sh.k);
      std::vector<double> ref(size_t(sh.batch * sh.n));
      for (int64_t b = 0; b < sh.batch; ++b)
        for (int64_t r = 0; r < sh.n; ++r) {
          double s = 0;
          for (int64_t i = 0; i < sh.k; ++i) s += double(wd[size_t(r * sh.k + i)]) * x[size_t(b * sh.k + i)];
          ref[size_t(b * sh.n + r)] = s;
        }
      for (cpu_isa isa : runnable_isas()) {
        CAPTURE(to_string(t));
        CAPTURE(cpu::to_string(isa));
        CAPTURE(sh.k);
        std::vector<float> all(size_t(sh.batch * sh.n)), threaded(all.size()), scratch;
        cpu::matmul(w, x.data(), sh.batch, all.data(), scratch, nullptr, isa);
        CHECK(nmse(all, ref) < (t == ggml_type::q8_0 ? 1e-4 : 1e-10));  // q8_0: 8-bit activations
        cpu::matmul(w, x.data(), sh.batch, threaded.data(), scratch, &pool, isa);
        REQUIRE(std::memcmp(all.data(), threaded.data(), all.size() * 4) == 0);
        for (int64_t b = 0; b < sh.batch; b += 3) {
          std::vector<float> one(size_t(sh.n));
          cpu::matmul(w, x.data() + b * sh.k, 1, one.data(), scratch, b % 2 ? &pool : nullptr, isa);
          REQUIRE(std::memcmp(one.data(), all.data() + b * sh.n, size_t(sh.n) * 4) == 0);
        }
        // A batch starting mid-way (different tile and block mix): same bits.
        const int64_t off = sh.batch / 3, cnt = sh.batch - off;
        std::vector<float> part(size_t(cnt * sh.n));
        cpu::matmul(w, x.data() + off * sh.k, cnt, part.data(), scratch, &pool, isa);
        REQUIRE(std::memcmp(part.data(), all.data() + off * sh.n, part.size() * 4) == 0);
      }
    }
  }
}

TEST_CASE("ops: batched paged attention equals per-sequence calls on every isa path and any thread count") {
  kv_layout L{.n_layers = 1, .n_kv_heads = 2, .head_dim = 40, .page_size = 4};  // 40: a 16-lane tail
  kv_pool pool(L, 32);
  const int n_heads = 4;
  const size_t row = size_t(L.n_kv_heads * L.head_dim);
  const auto kv = random_floats(size_t(32 * 4) * row * 2, 31);
  for (int32_t p = 0; p < 32; ++p)
    for (int s = 0; s < 4; ++s) {
      std::memcpy(pool.k(p, 0) + size_t(s) * row, kv.data() + (size_t(p) * 4 + size_t(s)) * row, row * 4);
      std::memcpy(pool.v(p, 0) + size_t(s) * row, kv.data() + (size_t(p + 32) * 4 + size_t(s)) * row, row * 4);
    }
  // Prefill chunk, decode rows and an empty sequence, with scattered pages.
  const std::vector<int32_t> pa = {3, 9, 1, 30, 12, 5, 7}, pb = {0, 2}, pc = {20, 21, 22};
  struct seq_in {
    const std::vector<int32_t>* pages;
    int64_t n;
    int32_t pos0;
  };
  const std::vector<seq_in> in = {{&pa, 24, 2}, {&pb, 1, 6}, {&pc, 0, 9}, {&pc, 1, 11}};
  std::vector<std::vector<float>> qs;
  for (size_t i = 0; i < in.size(); ++i)
    qs.push_back(random_floats(size_t(in[i].n * n_heads * L.head_dim) + 1, 40 + i));
  cpu::thread_pool tp(2);
  for (cpu_isa isa : runnable_isas()) {
    CAPTURE(cpu::to_string(isa));
    std::vector<std::vector<float>> alone, batched, threaded;
    std::vector<cpu::attention_seq> b1, b2;
    for (size_t i = 0; i < in.size(); ++i) {
      alone.emplace_back(qs[i].size(), 0.0f);
      batched.emplace_back(qs[i].size(), 0.0f);
      threaded.emplace_back(qs[i].size(), 0.0f);
      std::vector<float> scratch;
      cpu::paged_attention(qs[i].data(), in[i].n, in[i].pos0, n_heads, pool, 0, *in[i].pages, alone[i].data(),
                           scratch, nullptr, isa);
      b1.push_back({qs[i].data(), in[i].n, in[i].pos0, *in[i].pages, batched[i].data()});
      b2.push_back({qs[i].data(), in[i].n, in[i].pos0, *in[i].pages, threaded[i].data()});
    }
    cpu::paged_attention_batch(b1, n_heads, pool, 0, nullptr, isa);
    cpu::paged_attention_batch(b2, n_heads, pool, 0, &tp, isa);
    for (size_t i = 0; i < in.size(); ++i) {
      REQUIRE(alone[i] == batched[i]);
      REQUIRE(std::memcmp(alone[i].data(), threaded[i].data(), alone[i].size() * 4) == 0);
    }
    // Same values (not bits) as the scalar path.
    std::vector<float> ref(qs[0].size(), 0.0f), scratch;
    cpu::paged_attention(qs[0].data(), in[0].n, in[0].pos0, n_heads, pool, 0, pa, ref.data(), scratch, nullptr,
                         cpu_isa::scalar);
    std::vector<double> refd(ref.begin(), ref.end());
    CHECK(nmse(alone[0], refd) < 1e-10);
  }
}

TEST_CASE("ops: softmax gives the same bits on every isa path and is within a few ulp of exp in double") {
  for (size_t n : {size_t(1), size_t(7), size_t(8), size_t(15), size_t(16), size_t(23), size_t(40), size_t(517)}) {
    CAPTURE(n);
    auto x = random_floats(n, 70 + n);
    for (auto& v : x) v *= 12.0f;  // spread of about +-12: weights from ~1 down to ~1e-10
    if (n > 5) x[5] = -200.0f;     // e^-200 underflows: weight 0, not a NaN
    std::vector<double> ref(n);
    const double mx = *std::max_element(x.begin(), x.end());
    double tot = 0;
    for (size_t i = 0; i < n; ++i) tot += ref[i] = std::exp(double(x[i]) - mx);
    std::vector<float> first;
    for (cpu_isa isa : runnable_isas()) {
      CAPTURE(cpu::to_string(isa));
      auto y = x;
      cpu::softmax(y.data(), n, isa);
      if (first.empty()) first = y;
      REQUIRE(std::memcmp(first.data(), y.data(), n * sizeof(float)) == 0);
      for (size_t i = 0; i < n; ++i) {
        const double want = ref[i] / tot;
        if (want < 1e-30) {
          REQUIRE(y[i] == 0.0f);
        } else {
          // 4 ulp for the polynomial and the normalisation, plus the rounding of x - max in
          // float (relative error |x - max| ulp in e^(x - max)), which the kernel inherits.
          const double ulps = 4.0 + std::abs(double(x[i]) - mx);
          REQUIRE(std::abs(double(y[i]) - want) <= ulps * std::numeric_limits<float>::epsilon() * want);
        }
      }
    }
  }
  // A NaN score stays visible instead of turning into a weight.
  std::vector<float> bad = {0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  cpu::softmax(bad.data(), bad.size());
  CHECK(std::isnan(bad[1]));
}

TEST_CASE("ops: swiglu gives the same bits on every isa path, split or not, and matches silu") {
  const size_t n = (size_t(1) << 14) + 13;  // large enough to be split across 2 threads, odd tail
  auto g = random_floats(n, 80);
  const auto u = random_floats(n, 81);
  for (auto& v : g) v *= 30.0f;
  g[3] = -120.0f;  // e^-120 underflows: silu is 0
  g[4] = 0.0f;
  g[5] = -0.0f;
  cpu::thread_pool tp(2);
  std::vector<float> first;
  for (cpu_isa isa : runnable_isas()) {
    for (cpu::thread_pool* pool : {static_cast<cpu::thread_pool*>(nullptr), &tp}) {
      CAPTURE(cpu::to_string(isa));
      std::vector<float> out(n);
      cpu::swiglu(g.data(), u.data(), out.data(), n, pool, isa);
      if (first.empty()) first = out;
      REQUIRE(std::memcmp(first.data(), out.data(), n * sizeof(float)) == 0);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const double want = double(g[i]) / (1.0 + std::exp(-double(g[i]))) * u[i];
    REQUIRE(std::abs(double(first[i]) - want) <= 1e-6 * std::abs(want) + 1e-30);
  }
}

TEST_CASE("ops: a chunk of query tokens gives the same bits as the same tokens one at a time") {
  // The avx512 path takes 4 tokens of a head at a time (sharing K and V loads); 7 and 10
  // tokens leave groups of 3 and 2, pos0 = 13 starts the chunk mid-page, and 45 tokens give
  // groups whose rows share several 16-position blocks of scores (one to five 16-float
  // chunks per row: head_dim 16 to 80).
  for (int hd : {64, 48, 16, 32, 80}) {
    kv_layout L{.n_layers = 1, .n_kv_heads = 2, .head_dim = hd, .page_size = 16};
    kv_pool pool(L, 4);
    const auto kv = random_floats(pool.bytes() / 4, 60);
    std::memcpy(pool.page_data(0), kv.data(), pool.bytes());
    const std::vector<int32_t> pages = {2, 0, 3, 1};
    const int n_heads = 4;
    for (int64_t n : {int64_t(7), int64_t(10), int64_t(45), int64_t(46)}) {
      const int32_t pos0 = 13;
      const auto q = random_floats(size_t(n * n_heads * hd), 61 + uint64_t(n));
      for (cpu_isa isa : runnable_isas()) {
        CAPTURE(hd);
        CAPTURE(n);
        CAPTURE(cpu::to_string(isa));
        std::vector<float> chunk(q.size()), one(q.size()), scratch;
        cpu::paged_attention(q.data(), n, pos0, n_heads, pool, 0, pages, chunk.data(), scratch, nullptr, isa);
        for (int64_t t = 0; t < n; ++t)
          cpu::paged_attention(q.data() + t * n_heads * hd, 1, pos0 + int32_t(t), n_heads, pool, 0, pages,
                               one.data() + t * n_heads * hd, scratch, nullptr, isa);
        REQUIRE(std::memcmp(chunk.data(), one.data(), q.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("ops: attention rows on every isa path equal dot + softmax + axpy of that path, bit for bit") {
  // head_dim 64 takes the avx512 16-positions-at-once path; its reduction network must give
  // exactly dot()'s bits, or a position would change value with the context length.
  for (int hd : {64, 48, 40}) {
    kv_layout L{.n_layers = 1, .n_kv_heads = 2, .head_dim = hd, .page_size = 16};
    kv_pool pool(L, 4);
    const auto kv = random_floats(pool.bytes() / 4, 50);
    std::memcpy(pool.page_data(0), kv.data(), pool.bytes());
    const std::vector<int32_t> pages = {2, 0, 3, 1};
    const int n_heads = 4;
    for (int64_t len : {1, 15, 16, 17, 40}) {
      const auto q = random_floats(size_t(n_heads * hd), 51 + uint64_t(len));
      for (cpu_isa isa : runnable_isas()) {
        CAPTURE(hd);
        CAPTURE(len);
        CAPTURE(cpu::to_string(isa));
        std::vector<float> out(q.size()), scratch;
        cpu::paged_attention(q.data(), 1, int32_t(len - 1), n_heads, pool, 0, pages, out.data(), scratch, nullptr, isa);
        for (int h = 0; h < n_heads; ++h) {
          const int kvh = h / 2;
          std::vector<float> att(static_cast<size_t>(len)), o(static_cast<size_t>(hd), 0.0f);
          for (int64_t p = 0; p < len; ++p)
            att[size_t(p)] = cpu::dot(q.data() + h * hd, pool.k(pages[size_t(p / 16)], 0) + (size_t(p % 16) * 2 + kvh) * hd,
                                      hd, isa) *
                             (1.0f / std::sqrt(float(hd)));
          cpu::softmax(att.data(), att.size());
          for (int64_t p = 0; p < len; ++p)
            cpu::axpy(att[size_t(p)], pool.v(pages[size_t(p / 16)], 0) + (size_t(p % 16) * 2 + kvh) * hd, o.data(), hd,
                      isa);
          REQUIRE(std::memcmp(o.data(), out.data() + h * hd, size_t(hd) * 4) == 0);
        }
      }
    }
  }
}

namespace {

/// The same random K/V values (each rounded to f16) in an f32 pool and an f16 pool.
void fill_same(kv_pool& f32_pool, kv_pool& f16_pool, uint64_t seed) {
  const size_t n = f32_pool.bytes() / 4;
  REQUIRE(f16_pool.bytes() / 2 == n);
  const auto v = random_floats(n, seed);
  auto* a = reinterpret_cast<float*>(f32_pool.data());
  auto* h = reinterpret_cast<uint16_t*>(f16_pool.data());
  for (size_t i = 0; i < n; ++i) {
    h[i] = cpu::fp32_to_fp16(v[i]);
    a[i] = cpu::fp16_to_fp32(h[i]);
  }
}

}  // namespace

TEST_CASE("ops: fp32_to_fp16_row gives fp32_to_fp16's bits for every non-NaN value, overflow saturated") {
  std::vector<float> x;
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffff) != 0) continue;  // NaN
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  // Ties, the overflow edge, half subnormals and their rounding, signed zeros, infinities.
  for (float f : {65504.0f, 65519.99f, 65520.0f, 1e9f, 5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f,
                  6.1035156e-05f, 6.1035152e-05f, 1.0009765625f, 1.00048828125f, 1.00146484375f, 0.0f, -0.0f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), -1.5e-40f})
    x.push_back(f), x.push_back(-f);
  std::vector<uint16_t> y(x.size());
  cpu::fp32_to_fp16_row(x.data(), y.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    CAPTURE(x[i]);
    const float sat = std::isfinite(x[i]) ? std::clamp(x[i], -65504.0f, 65504.0f) : x[i];
    REQUIRE(y[i] == cpu::fp32_to_fp16(sat));
  }
  // The KV cache's store: a finite value past the half range is the largest half, not
  // infinity (which would make the attention NaN); infinities and NaNs pass through. Both
  // the F16C loop (first 8) and the scalar tail (last 2).
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float big[] = {1e9f, -65520.0f, 70000.0f, inf, -inf, nan, 65504.0f, -3.4e38f, 1e9f, -inf};
  const uint16_t want[] = {0x7bff, 0xfbff, 0x7bff, 0x7c00, 0xfc00, 0, 0x7bff, 0xfbff, 0x7bff, 0xfc00};
  uint16_t got[10];
  cpu::fp32_to_fp16_row(big, got, 10);
  for (int i = 0; i < 10; ++i) {
    CAPTURE(i);
    if (std::isnan(big[i])) CHECK(std::isnan(cpu::fp16_to_fp32(got[i])));
    else CHECK(got[i] == want[i]);
  }
}

TEST_CASE("ops: attention over an f16 cache equals attention over an f32 cache of the same values, bit for bit") {
  // Every path widens f16 rows exactly, so only the rounding when K and V are stored
  // differs between the two caches. Prefill chunks (the grouped path), decode tokens (the
  // head-block path), GQA, head sizes that take each path (40: not a multiple of 16; 128:
  // the largest head block), pages of 4 and 16 positions, one thread and two.
  for (int hd : {64, 40, 16, 128}) {
    for (int ps : {4, 16}) {
      kv_layout L{.n_layers = 2, .n_kv_heads = 2, .head_dim = hd, .page_size = ps};
      kv_layout H = L;
      H.dtype = kv_dtype::f16;
      kv_pool a(L, 24), h(H, 24);
      fill_same(a, h, 90 + uint64_t(hd + ps));
      const int n_heads = 6;  // 3 query heads per KV head
      std::vector<int32_t> pa, pb;
      for (int i = 0; i < 12; ++i) pa.push_back(23 - 2 * i), pb.push_back(2 * i);
      struct seq_in {
        const std::vector<int32_t>* pages;
        int64_t n;
        int32_t pos0;
      };
      const std::vector<seq_in> in = {{&pa, 9, 3}, {&pb, 1, 0}, {&pb, 1, 37}, {&pa, 1, 12 * ps - 1}};
      cpu::thread_pool tp(2);
      for (cpu_isa isa : runnable_isas())
        for (cpu::thread_pool* pool : {static_cast<cpu::thread_pool*>(nullptr), &tp}) {
          CAPTURE(hd);
          CAPTURE(ps);
          CAPTURE(cpu::to_string(isa));
          std::vector<std::vector<float>> qs, out_a, out_h;
          std::vector<cpu::attention_seq> sa, sh;
          for (size_t i = 0; i < in.size(); ++i) {
            const int64_t pos_end = int64_t(in[i].pos0) + in[i].n;
            REQUIRE(pos_end <= int64_t(in[i].pages->size()) * ps);
            qs.push_back(random_floats(size_t(in[i].n * n_heads * hd), 100 + i));
            out_a.emplace_back(qs.back().size(), 0.0f);
            out_h.emplace_back(qs.back().size(), 1.0f);
          }
          for (size_t i = 0; i < in.size(); ++i) {
            sa.push_back({qs[i].data(), in[i].n, in[i].pos0, *in[i].pages, out_a[i].data()});
            sh.push_back({qs[i].data(), in[i].n, in[i].pos0, *in[i].pages, out_h[i].data()});
          }
          cpu::paged_attention_batch(sa, n_heads, a, 1, pool, isa);
          cpu::paged_attention_batch(sh, n_heads, h, 1, pool, isa);
          for (size_t i = 0; i < in.size(); ++i) REQUIRE(std::memcmp(out_a[i].data(), out_h[i].data(), out_a[i].size() * 4) == 0);
        }
    }
  }
}

TEST_CASE("ops: a decode token's heads give the same bits alone, in any head block and beside other sequences") {
  // The avx512 path splits a decode token's heads into blocks sized by the batch and thread
  // count; each head must not depend on its block. One sequence alone (the most blocks) vs
  // 9 sequences (whole tokens), with one thread and two, on both cache types.
  for (kv_dtype t : {kv_dtype::f32, kv_dtype::f16}) {
    kv_layout L{.n_layers = 1, .n_kv_heads = 4, .head_dim = 64, .page_size = 16, .dtype = t};
    kv_layout F = L;
    F.dtype = t == kv_dtype::f32 ? kv_dtype::f16 : kv_dtype::f32;
    kv_pool pool(L, 20), other(F, 20);
    if (t == kv_dtype::f32) fill_same(pool, other, 7);
    else fill_same(other, pool, 7);
    const int n_heads = 8;
    std::vector<int32_t> pages;
    for (int i = 0; i < 20; ++i) pages.push_back((i * 7) % 20);
    std::vector<std::vector<float>> qs, alone, together;
    for (int s = 0; s < 9; ++s) {
      qs.push_back(random_floats(size_t(n_heads * 64), 200 + uint64_t(s)));
      alone.emplace_back(qs.back().size(), 0.0f);
      together.emplace_back(qs.back().size(), 0.0f);
    }
    cpu::thread_pool tp(2);
    for (cpu::thread_pool* p : {static_cast<cpu::thread_pool*>(nullptr), &tp}) {
      std::vector<cpu::attention_seq> all;
      for (int s = 0; s < 9; ++s) {
        const cpu::attention_seq one{qs[size_t(s)].data(), 1, int32_t(30 * s + 5), pages, alone[size_t(s)].data()};
        cpu::paged_attention_batch(std::span<const cpu::attention_seq>(&one, 1), n_heads, pool, 0, p);
        all.push_back({qs[size_t(s)].data(), 1, int32_t(30 * s + 5), pages, together[size_t(s)].data()});
      }
      cpu::paged_attention_batch(all, n_heads, pool, 0, p);
      for (int s = 0; s < 9; ++s)
        REQUIRE(std::memcmp(alone[size_t(s)].data(), together[size_t(s)].data(), alone[size_t(s)].size() * 4) == 0);
    }
  }
}

TEST_CASE("ops: matmul_many gives each weight the bits matmul gives it alone, on every path") {
  // Q, K and V shapes (GQA: K and V smaller), one thread and two, batch 1 (the amx batch-1
  // emulation), a tile tail and several tiles; a q8_0 matrix beside f16 ones on the vector
  // paths (on amx it runs the avx512 kernel, so the three go one at a time).
  const int64_t k = 96;
  const std::vector<int64_t> rows = {96, 48, 48};
  cpu::thread_pool tp(2);
  for (ggml_type t : {ggml_type::f16, ggml_type::bf16, ggml_type::q8_0})
    for (bool mixed : {false, true}) {
      std::vector<std::vector<uint8_t>> bytes;
      std::vector<tensor_view> views;
      for (size_t i = 0; i < rows.size(); ++i) {
        const ggml_type ti = mixed && i == 1 ? ggml_type::q8_0 : t;
        bytes.push_back(encode(ti, random_floats(size_t(rows[i] * k), 300 + i), rows[i], k));
        views.push_back(view_of(ti, bytes.back(), rows[i], k));
      }
      for (cpu_isa isa : runnable_isas())
        for (cpu::thread_pool* pool : {static_cast<cpu::thread_pool*>(nullptr), &tp})
          for (int64_t batch : {int64_t(1), int64_t(5), int64_t(40)}) {
            CAPTURE(to_string(t));
            CAPTURE(mixed);
            CAPTURE(cpu::to_string(isa));
            CAPTURE(batch);
            const auto packed = cpu::pack_weights(views, isa, &tp);
            const auto x = random_floats(size_t(batch * k), 310, 2.0f);
            std::vector<std::vector<float>> alone, together;
            std::vector<const cpu::packed_weight*> ws;
            std::vector<float*> ys;
            std::vector<float> scratch;
            for (size_t i = 0; i < rows.size(); ++i) {
              alone.emplace_back(size_t(batch * rows[i]));
              together.emplace_back(size_t(batch * rows[i]), -1.0f);
              cpu::matmul(packed[i], x.data(), batch, alone[i].data(), scratch, pool);
              ws.push_back(&packed[i]);
            }
            for (auto& y : together) ys.push_back(y.data());
            cpu::matmul_many(ws, x.data(), batch, ys, scratch, pool);
            for (size_t i = 0; i < rows.size(); ++i)
              REQUIRE(std::memcmp(alone[i].data(), together[i].data(), alone[i].size() * 4) == 0);
          }
    }
  // Weights that cannot share one input are refused.
  std::vector<uint8_t> a = encode(ggml_type::f16, random_floats(32 * 64, 1), 32, 64),
                       b = encode(ggml_type::f16, random_floats(32 * 96, 2), 32, 96);
  const cpu::packed_weight pa = cpu::pack_weight(view_of(ggml_type::f16, a, 32, 64)),
                           pb = cpu::pack_weight(view_of(ggml_type::f16, b, 32, 96));
  const cpu::packed_weight* both[] = {&pa, &pb};
  std::vector<float> y1(32), y2(32), x(96), scratch;
  float* const ys[] = {y1.data(), y2.data()};
  CHECK_THROWS_WITH(cpu::matmul_many(both, x.data(), 1, ys, scratch), doctest::Contains("cannot share one input"));
}

TEST_CASE("ops: argmax is std::max_element's index: first maximum, NaNs skipped unless first, signed zeros equal") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto same = [](std::vector<float> v) {
    CAPTURE(v.size());
    REQUIRE(cpu::argmax(v.data(), int64_t(v.size())) == std::max_element(v.begin(), v.end()) - v.begin());
  };
  for (size_t n : {size_t(1), size_t(15), size_t(16), size_t(17), size_t(1000), size_t(32000)}) {
    auto v = random_floats(n, 500 + n);
    same(v);
    v[n / 2] = 7.0f;  // ties: the first of several maxima
    v[n - 1] = 7.0f;
    same(v);
    if (n > 3) v[1] = nan, v[n - 2] = nan;  // NaNs later never win
    same(v);
    v[0] = nan;  // a NaN first wins (nothing compares larger)
    same(v);
    std::fill(v.begin(), v.end(), -inf);
    same(v);
    std::fill(v.begin(), v.end(), 0.0f);
    v[0] = -0.0f;  // -0 and +0 compare equal: the first stays
    same(v);
    v[n - 1] = inf;
    same(v);
  }
  CHECK(cpu::argmax(nullptr, 0) == -1);
}
