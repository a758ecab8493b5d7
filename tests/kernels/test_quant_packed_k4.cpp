// Packed (16-row interleaved) q4_K and q5_K weights (kernels/cpu/quant_packed_k4.cpp): the
// packed kernel against rows_scalar bit for bit, over row counts that leave a partial last
// group, several super-block counts and batch sizes, and a group range that is not the whole
// weight. Plus a timing harness against rows_avx512, skipped unless asked for.
#include <doctest/doctest.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant_matmul.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/roofline.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/matmul_fixtures.h"

using namespace tandem;

namespace {

struct k4_weight {
  std::vector<uint8_t> bytes;
  tensor_view view;
};

// Random q4_K / q5_K blocks: random nibbles and fifth bits; scales and mins walk through all
// 64 six-bit values (every block a different phase, so each value meets every sub-block);
// row 0's first block is all maxima (scales 63, codes 15 or 31), the largest integer sums.
template <class Block>
k4_weight make_k4(ggml_type t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255), six(0, 63);
  std::uniform_real_distribution<float> scale(0.0005f, 0.02f);
  const int64_t nb = cols / qk_k;
  k4_weight w;
  w.bytes.resize(size_t(rows * nb) * sizeof(Block));
  auto* blocks = reinterpret_cast<Block*>(w.bytes.data());
  for (int64_t n = 0; n < rows * nb; ++n) {
    Block& b = blocks[n];
    b.d = cpu::fp32_to_fp16(scale(rng));
    b.dmin = cpu::fp32_to_fp16(scale(rng));
    int sc[8], m[8];
    const int phase = six(rng);
    for (int j = 0; j < 8; ++j)
      sc[j] = (phase + int(n) + 8 * j) % 64, m[j] = (phase + 5 * int(n) + 8 * j + 3) % 64;
    for (auto& q : b.qs) q = uint8_t(byte(rng));
    if constexpr (requires { b.qh; })
      for (auto& q : b.qh) q = uint8_t(byte(rng));
    if (n == 0) {
      for (int j = 0; j < 8; ++j) sc[j] = m[j] = 63;
      std::memset(b.qs, 0xFF, sizeof b.qs);
      if constexpr (requires { b.qh; }) std::memset(b.qh, 0xFF, sizeof b.qh);
    }
    test::pack_k4_scales(sc, m, b.scales);
  }
  w.view = test::view_of(t, w.bytes, rows, cols);
  return w;
}

k4_weight make_k4(ggml_type t, int64_t rows, int64_t cols, uint32_t seed) {
  return t == ggml_type::q4_K ? make_k4<block_q4_K>(t, rows, cols, seed)
                              : make_k4<block_q5_K>(t, rows, cols, seed);
}

// Activations: row 0 constant (every code 127, the largest sums with row 0's first block),
// the others gaussian with an outlier.
std::vector<float> make_x(int64_t batch, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(batch * cols));
  for (auto& v : x) v = nd(rng);
  for (int64_t c = 0; c < cols; ++c) x[size_t(c)] = 0.75f;
  if (batch > 1) x[size_t(cols + 3)] = -30.0f;
  return x;
}

using pack_fn = cpu::quant_detail::pack_group_fn;
using rows_fn = void (*)(const cpu::quant_packed&, const cpu::quant_acts&, float*, int64_t, int64_t);

struct k4_kernel {
  ggml_type type;
  pack_fn pack;
  rows_fn rows;
};

constexpr k4_kernel k_kernels[] = {
    {ggml_type::q4_K, cpu::quant_detail::pack_group_q4_K, cpu::quant_detail::packed_rows_q4_K},
    {ggml_type::q5_K, cpu::quant_detail::pack_group_q5_K, cpu::quant_detail::packed_rows_q5_K},
};

}  // namespace

TEST_CASE("quant_packed: q4_K and q5_K packed kernels give rows_scalar's bits") {
  if (!cpu::quant_detail::has_avx512_vnni()) {
    MESSAGE("skipped: the packed kernels need AVX-512 VNNI, which this CPU lacks");
    return;
  }
  const int64_t batches[] = {1, 2, 3, 4, 5, 8, 17, 64};
  for (const k4_kernel& kk : k_kernels)
    for (int64_t rows : {int64_t(16), int64_t(17), int64_t(40), int64_t(100)})
      for (int64_t cols : {int64_t(256), int64_t(512), int64_t(2048)}) {
        const auto w = make_k4(kk.type, rows, cols, uint32_t(rows * 7 + cols));
        const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, kk.pack);
        REQUIRE(p.bytes.size() == size_t(p.groups()) * size_t(cpu::pack_rows) * row_bytes(kk.type, cols));
        const int64_t max_batch = 64;
        const auto x = make_x(max_batch, cols, uint32_t(cols));
        // rows_scalar of the largest batch; a smaller batch's rows are its first rows (each
        // activation row is quantized on its own).
        cpu::quant_acts a;
        cpu::quantize_acts(x.data(), max_batch, cols, 256, a);
        std::vector<float> ref(size_t(max_batch * rows));
        cpu::quant_detail::rows_scalar(w.view, a, ref.data(), 0, rows);
        for (int64_t batch : batches) {
          cpu::quantize_acts(x.data(), batch, cols, 256, a);
          std::vector<float> y(size_t(batch * rows), -1.0f);
          kk.rows(p, a, y.data(), 0, p.groups());
          INFO(to_string(kk.type), " rows ", rows, " cols ", cols, " batch ", batch);
          CHECK(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)) == 0);
        }
      }
}

TEST_CASE("quant_packed: a q4_K or q5_K group range writes its rows and no others") {
  if (!cpu::quant_detail::has_avx512_vnni()) {
    MESSAGE("skipped: the packed kernels need AVX-512 VNNI, which this CPU lacks");
    return;
  }
  for (const k4_kernel& kk : k_kernels)
    for (int64_t batch : {int64_t(1), int64_t(6)}) {
      const int64_t rows = 100, cols = 512;  // 7 groups, the last one 4 rows
      const auto w = make_k4(kk.type, rows, cols, 11);
      const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, kk.pack);
      const auto x = make_x(batch, cols, 12);
      cpu::quant_acts a;
      cpu::quantize_acts(x.data(), batch, cols, 256, a);
      std::vector<float> ref(size_t(batch * rows));
      cpu::quant_detail::rows_scalar(w.view, a, ref.data(), 0, rows);
      for (auto [g0, g1] : {std::pair<int64_t, int64_t>{1, 5}, {6, 7}, {0, 1}}) {
        std::vector<float> y(size_t(batch * rows), -7.0f);
        kk.rows(p, a, y.data(), g0, g1);
        INFO(to_string(kk.type), " batch ", batch, " groups ", g0, "..", g1);
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t r = 0; r < rows; ++r) {
            const bool ours = r >= g0 * cpu::pack_rows && r < g1 * cpu::pack_rows;
            const float want = ours ? ref[size_t(b * rows + r)] : -7.0f;
            if (std::memcmp(&y[size_t(b * rows + r)], &want, sizeof want) != 0) {
              FAIL_CHECK("row ", r, " activation row ", b, ": ", y[size_t(b * rows + r)], " want ", want);
              return;
            }
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

// Medians and quartiles of the thread CPU time of call i of f0 and f1, alternated.
template <class F0, class F1>
void time_pair(int reps, F0&& f0, F1&& f1, double (&q0)[3], double (&q1)[3]) {
  std::vector<double> t0, t1;
  for (int i = 0; i < reps; ++i) {
    double s = thread_ns();
    f0(i);
    t0.push_back(thread_ns() - s);
    s = thread_ns();
    f1(i);
    t1.push_back(thread_ns() - s);
  }
  std::sort(t0.begin(), t0.end());
  std::sort(t1.begin(), t1.end());
  for (int k = 0; k < 3; ++k)
    q0[k] = t0[t0.size() * size_t(k + 1) / 4], q1[k] = t1[t1.size() * size_t(k + 1) / 4];
}

void report(const char* what, double bytes, const double (&q0)[3], const double (&q1)[3]) {
  std::printf(
      "%s: rows_avx512 %10.0f ns (%5.1f GB/s, q1-q3 %.0f-%.0f)  packed %10.0f ns (%5.1f GB/s, q1-q3 "
      "%.0f-%.0f)  x%.2f\n",
      what, q0[1], bytes / q0[1], q0[0], q0[2], q1[1], bytes / q1[1], q1[0], q1[2], q0[1] / q1[1]);
}

}  // namespace

// Run by hand: test_kernels -tc='quant_packed: k4 timing*' --no-skip. Thread CPU time of one
// call, the unpacked rows_avx512 and the packed kernel alternated, medians; batch 512 and 1
// with the weight in cache (L3 here), then batch 1 and 4 with calls rotating over copies of
// the weight larger than the caches together (from memory).
TEST_CASE("quant_packed: k4 timing against rows_avx512" * doctest::skip()) {
  if (!cpu::quant_detail::has_avx512_vnni()) return;
  cpu::thread_pool one(1);
  std::printf("one thread's streaming read bandwidth (roofline.h, 256 MB): %.1f GB/s\n",
              cpu::measure_read_bandwidth(one, size_t(256) << 20, 3) / 1e9);
  for (const k4_kernel& kk : k_kernels)
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2048, 2048}, {8192, 2048}, {2048, 8192}}) {
      const auto w = make_k4(kk.type, rows, cols, 3);
      const cpu::quant_packed p = cpu::quant_detail::pack_groups(w.view, kk.pack);
      const auto x = make_x(512, cols, 4);
      const double bytes = double(w.bytes.size());
      cpu::quant_acts a;
      char what[128];
      double q0[3], q1[3];
      for (int64_t batch : {int64_t(512), int64_t(1)}) {
        cpu::quantize_acts(x.data(), batch, cols, 256, a);
        std::vector<float> y0(size_t(batch * rows)), y1(size_t(batch * rows));
        time_pair(
            batch == 1 ? 301 : 7, [&](int) { cpu::quant_detail::rows_avx512(w.view, a, y0.data(), 0, rows); },
            [&](int) { kk.rows(p, a, y1.data(), 0, p.groups()); }, q0, q1);
        std::snprintf(what, sizeof what, "%s %5lld x %5lld batch %3lld",
                      std::string(to_string(kk.type)).c_str(), (long long)rows, (long long)cols,
                      (long long)batch);
        report(what, bytes, q0, q1);
        CHECK(std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float)) == 0);
      }
      const size_t copies = size_t(256 << 20) / w.bytes.size() + 1;
      std::vector<k4_weight> ws(copies, w);
      std::vector<cpu::quant_packed> ps;
      for (auto& c : ws) {
        c.view.data = c.bytes.data();
        ps.push_back(cpu::quant_detail::pack_groups(c.view, kk.pack));
      }
      for (int64_t batch : {int64_t(1), int64_t(4)}) {
        cpu::quantize_acts(x.data(), batch, cols, 256, a);
        std::vector<float> y0(size_t(batch * rows)), y1(size_t(batch * rows));
        time_pair(
            101,
            [&](int i) {
              cpu::quant_detail::rows_avx512(ws[size_t(i) % copies].view, a, y0.data(), 0, rows);
            },
            [&](int i) { kk.rows(ps[size_t(i) % copies], a, y1.data(), 0, p.groups()); }, q0, q1);
        std::snprintf(what, sizeof what, "%s %5lld x %5lld batch %3lld from memory",
                      std::string(to_string(kk.type)).c_str(), (long long)rows, (long long)cols,
                      (long long)batch);
        report(what, bytes, q0, q1);
        CHECK(std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float)) == 0);
      }
    }
}
