// The packed (16-row interleaved) q6_K kernel: the bits of rows_scalar for every shape, batch
// size and group range, on random blocks with extreme scales and every 6-bit code; and a
// skipped timing case against the row-major AVX-512 kernel (run by hand with --no-skip).
#include <doctest/doctest.h>

#include <time.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/quant_ref.h"
#include "tests/kernels/matmul_fixtures.h"

using namespace tandem;

namespace {

struct q6_weight {
  std::vector<uint8_t> bytes;
  tensor_view view;
};

// rows x cols of random q6_K blocks: every code and scale byte random, some sub-blocks' scales
// at the extremes -128 and 127, some blocks' codes all 0 or all 63 (the largest |q - 32|).
q6_weight random_q6_K(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  q6_weight w;
  const int64_t nb = rows * cols / qk_k;
  w.bytes.resize(size_t(nb) * sizeof(block_q6_K));
  auto* blocks = reinterpret_cast<block_q6_K*>(w.bytes.data());
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  for (int64_t i = 0; i < nb; ++i) {
    block_q6_K& b = blocks[i];
    const uint32_t kind = rng() % 8;
    for (auto& v : b.ql) v = kind == 0 ? 0x00 : kind == 1 ? 0xFF : uint8_t(rng());
    for (auto& v : b.qh) v = kind == 0 ? 0x00 : kind == 1 ? 0xFF : uint8_t(rng());
    for (auto& s : b.scales) {
      const uint32_t r = rng() % 4;
      s = r == 0 ? int8_t(-128) : r == 1 ? int8_t(127) : int8_t(rng());
    }
    b.d = cpu::fp32_to_fp16(scale(rng));
  }
  w.view = test::view_of(ggml_type::q6_K, w.bytes, rows, cols);
  return w;
}

// batch rows of cols activations: mostly gaussian, row 1 all +-1 (codes +-127), an outlier.
std::vector<float> activations(int64_t batch, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(batch * cols));
  for (auto& v : x) v = nd(rng);
  if (batch > 1)
    for (int64_t c = 0; c < cols; ++c) x[size_t(cols + c)] = (rng() % 2 == 0) ? 1.0f : -1.0f;
  x[3] = 30.0f;
  return x;
}

}  // namespace

TEST_CASE("quant packed q6_K: the packed kernel gives rows_scalar's bits for every shape and batch") {
  if (!cpu::quant_detail::has_avx512_vnni()) return;
  const int64_t max_batch = 64;
  for (int64_t cols : {int64_t(256), int64_t(512), int64_t(2048)})
    for (int64_t rows : {int64_t(16), int64_t(17), int64_t(40), int64_t(100)}) {
      const auto w = random_q6_K(rows, cols, uint32_t(rows * 7 + cols));
      const auto x = activations(max_batch, cols, uint32_t(cols + rows));
      // Each activation row's codes do not depend on the others: the reference at batch 64
      // holds every smaller batch's rows.
      cpu::quant_acts a_all;
      cpu::quantize_acts(x.data(), max_batch, cols, 256, a_all);
      std::vector<float> ref(size_t(max_batch * rows));
      cpu::quant_detail::rows_scalar(w.view, a_all, ref.data(), 0, rows);
      const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, cpu::quant_detail::pack_group_q6_K);
      CHECK(p.bytes.size() == w.bytes.size() / size_t(rows) * size_t(p.groups() * 16));
      for (int64_t batch : {1, 2, 3, 4, 5, 8, 17, 64}) {
        cpu::quant_acts a;
        cpu::quantize_acts(x.data(), batch, cols, 256, a);
        std::vector<float> y(size_t(batch * rows), -1.0f);
        cpu::quant_detail::packed_rows_q6_K(p, a, y.data(), 0, p.groups());
        INFO("rows ", rows, " cols ", cols, " batch ", batch);
        CHECK(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)) == 0);
      }
    }
}

TEST_CASE("quant packed q6_K: a range of groups writes its rows and no other") {
  if (!cpu::quant_detail::has_avx512_vnni()) return;
  const int64_t rows = 70, cols = 768;  // 5 groups, the last one partial; odd super-blocks a row
  const auto w = random_q6_K(rows, cols, 11);
  const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, cpu::quant_detail::pack_group_q6_K);
  REQUIRE(p.groups() == 5);
  for (int64_t batch : {1, 3, 9}) {
    const auto x = activations(batch, cols, 5);
    cpu::quant_acts a;
    cpu::quantize_acts(x.data(), batch, cols, 256, a);
    std::vector<float> ref(size_t(batch * rows));
    cpu::quant_detail::rows_scalar(w.view, a, ref.data(), 0, rows);
    const std::pair<int64_t, int64_t> ranges[] = {{1, 3}, {3, 5}, {0, 1}, {2, 2}};
    for (auto [g0, g1] : ranges) {
      std::vector<float> y(size_t(batch * rows), -7.0f);
      cpu::quant_detail::packed_rows_q6_K(p, a, y.data(), g0, g1);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t r = 0; r < rows; ++r) {
          const bool inside = r >= g0 * 16 && r < g1 * 16;
          const float want = inside ? ref[size_t(b * rows + r)] : -7.0f;
          INFO("groups ", g0, "..", g1, " batch ", batch, " row ", b, " weight row ", r);
          CHECK(std::memcmp(&y[size_t(b * rows + r)], &want, sizeof want) == 0);
        }
    }
  }
}

namespace {

double thread_ns() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e9 + double(t.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

// Timing, not a test: thread CPU time of one call, row-major rows_avx512 against the packed
// kernel on the same activations, alternated, medians; batch 1 also over 8 weights bigger
// than the L3 in rotation (bytes from memory), on 1 and 2 threads. Run: test_kernels -tc='*timing*' --no-skip.
TEST_CASE("quant packed q6_K: timing against the row-major kernel" * doctest::skip()) {
  if (!cpu::quant_detail::has_avx512_vnni()) return;
  struct shape {
    int64_t rows, cols;
  };
  for (const shape s : {shape{2048, 2048}, shape{8192, 2048}, shape{2048, 8192}}) {
    const auto w = random_q6_K(s.rows, s.cols, 1);
    const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, cpu::quant_detail::pack_group_q6_K);
    for (int64_t batch : {int64_t(1), int64_t(512)}) {
      const auto x = activations(batch, s.cols, 2);
      cpu::quant_acts a;
      cpu::quantize_acts(x.data(), batch, s.cols, 256, a);
      std::vector<float> y0(size_t(batch * s.rows)), y1(y0.size());
      // Alternated in runs of 4 calls, the first of each run untimed: the weight (the original
      // or the packed copy) warm in L3 where it fits alone.
      const int reps = batch == 1 ? 60 : 3;
      std::vector<double> t0, t1;
      for (int rep = 0; rep < reps; ++rep) {
        for (int c = 0; c < 4; ++c) {
          const double t = thread_ns();
          cpu::quant_detail::rows_avx512(w.view, a, y0.data(), 0, s.rows);
          if (c > 0) t0.push_back(thread_ns() - t);
        }
        for (int c = 0; c < 4; ++c) {
          const double t = thread_ns();
          cpu::quant_detail::packed_rows_q6_K(p, a, y1.data(), 0, p.groups());
          if (c > 0) t1.push_back(thread_ns() - t);
        }
      }
      CHECK(std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float)) == 0);
      const double m0 = median(t0), m1 = median(t1);
      std::printf("q6_K %5lld x %5lld batch %3lld: row-major %10.0f ns, packed %10.0f ns: %.2fx\n",
                  static_cast<long long>(s.rows), static_cast<long long>(s.cols), static_cast<long long>(batch), m0, m1,
                  m0 / m1);
      // Calls of a few groups (a pool's chunks) pay the per-call table of activation sums.
      for (int64_t per : {int64_t(1), int64_t(4), int64_t(16)}) {
        std::vector<double> tc;
        for (int rep = 0; rep < (batch == 1 ? 21 : 3); ++rep) {
          const double t = thread_ns();
          for (int64_t g = 0; g < p.groups(); g += per)
            cpu::quant_detail::packed_rows_q6_K(p, a, y1.data(), g, std::min(p.groups(), g + per));
          tc.push_back(thread_ns() - t);
        }
        std::printf("  packed in calls of %2lld groups: %10.0f ns (%.2fx the one call)\n", static_cast<long long>(per),
                    median(tc), median(tc) / m1);
      }
    }
  }
  // Batch 1 from memory: 8 weights of 8192 x 2048 (110 MB) in rotation, each packed copy read
  // 4 weights after its original.
  const int64_t rows = 8192, cols = 2048;
  std::vector<q6_weight> ws;
  std::vector<cpu::quant_packed> ps;
  for (uint32_t i = 0; i < 8; ++i) {
    ws.push_back(random_q6_K(rows, cols, 100 + i));
    ps.push_back(cpu::quant_detail::pack_groups(ws.back().view, cpu::quant_detail::pack_group_q6_K));
  }
  const auto x = activations(1, cols, 3);
  cpu::quant_acts a;
  cpu::quantize_acts(x.data(), 1, cols, 256, a);
  std::vector<float> y(static_cast<size_t>(rows));
  std::vector<double> t0, t1;
  for (int rep = 0; rep < 60; ++rep)
    for (size_t i = 0; i < ws.size(); ++i) {
      double t = thread_ns();
      cpu::quant_detail::rows_avx512(ws[i].view, a, y.data(), 0, rows);
      t0.push_back(thread_ns() - t);
      const size_t j = (i + 4) % ws.size();
      t = thread_ns();
      cpu::quant_detail::packed_rows_q6_K(ps[j], a, y.data(), 0, ps[j].groups());
      t1.push_back(thread_ns() - t);
    }
  const double bytes = double(ws[0].bytes.size()), m0 = median(t0), m1 = median(t1);
  std::printf("q6_K 8192 x 2048 batch 1 from memory: row-major %.0f ns (%.2f GB/s), packed %.0f ns (%.2f GB/s): %.2fx\n",
              m0, bytes / m0, m1, bytes / m1, m0 / m1);
  // The same with 2 threads, each on half of every weight's rows (wall time of the pair,
  // both started together): a decode step's split.
  std::vector<double> w0, w1;
  std::barrier sync(2);
  auto half = [&](int t, bool packed, size_t i) {
    if (packed) {
      const int64_t g = ps[i].groups() / 2;
      cpu::quant_detail::packed_rows_q6_K(ps[i], a, y.data(), t == 0 ? 0 : g, t == 0 ? g : ps[i].groups());
    } else {
      cpu::quant_detail::rows_avx512(ws[i].view, a, y.data(), t == 0 ? 0 : rows / 2, t == 0 ? rows / 2 : rows);
    }
  };
  std::thread other([&] {
    for (int rep = 0; rep < 60; ++rep)
      for (size_t i = 0; i < ws.size(); ++i)
        for (bool packed : {false, true}) {
          sync.arrive_and_wait();
          half(1, packed, packed ? (i + 4) % ws.size() : i);
          sync.arrive_and_wait();
        }
  });
  for (int rep = 0; rep < 60; ++rep)
    for (size_t i = 0; i < ws.size(); ++i)
      for (bool packed : {false, true}) {
        sync.arrive_and_wait();
        const auto t = std::chrono::steady_clock::now();
        half(0, packed, packed ? (i + 4) % ws.size() : i);
        sync.arrive_and_wait();
        (packed ? w1 : w0).push_back(double(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count()));
      }
  other.join();
  const double n0 = median(w0), n1 = median(w1);
  std::printf("q6_K 8192 x 2048 batch 1 from memory, 2 threads (wall): row-major %.0f ns (%.2f GB/s), packed %.0f ns (%.2f GB/s): %.2fx\n",
              n0, bytes / n0, n1, bytes / n1, n0 / n1);
}
