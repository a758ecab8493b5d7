// Split-context attention's math (kernels/backend/cuda/split_softmax.h, split_plan.h), the
// part of the CUDA backend's FlashDecoding path that runs on any CPU: partial softmaxes of
// chunks merged equal one softmax over all positions, the chunks cover a row exactly, and the
// host's plan bounds the partials of one launch without changing any row's splits.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/backend/cuda/split_plan.h"
#include "kernels/backend/cuda/split_softmax.h"

using namespace tandem::cuda_backend;

namespace {

/// Attention output of one head over positions [lo, pos]: softmax(scores) . V.
std::vector<double> direct(const std::vector<float>& sc, const std::vector<float>& v, int dv, int lo, int pos) {
  double mx = -INFINITY;
  for (int p = lo; p <= pos; ++p) mx = std::max(mx, double(sc[size_t(p)]));
  double sum = 0.0;
  std::vector<double> o(size_t(dv), 0.0);
  for (int p = lo; p <= pos; ++p) {
    const double w = std::exp(double(sc[size_t(p)]) - mx);
    sum += w;
    for (int e = 0; e < dv; ++e) o[size_t(e)] += w * v[size_t(p * dv + e)];
  }
  for (double& x : o) x /= sum;
  return o;
}

/// As the kernel leaves a split: [m, l, acc...] of its chunk, acc scaled to its maximum m.
std::vector<float> partials(const std::vector<float>& sc, const std::vector<float>& v, int dv, int lo, int pos) {
  const int n = split_count(lo, pos);
  std::vector<float> out(size_t(n * partial_floats(dv)), 0.0f);
  for (int s = 0; s < n; ++s) {
    float* part = out.data() + s * partial_floats(dv);
    float m = -INFINITY, l = 0.0f;
    for (int p = split_first(lo, s); p <= split_last(lo, pos, s); ++p) m = std::max(m, sc[size_t(p)]);
    for (int p = split_first(lo, s); p <= split_last(lo, pos, s); ++p) {
      const float w = std::exp(sc[size_t(p)] - m);
      l += w;
      for (int e = 0; e < dv; ++e) part[2 + e] += w * v[size_t(p * dv + e)];
    }
    part[0] = m;
    part[1] = l;
  }
  return out;
}

struct row {
  int lo = 0, pos = 0, split_base = -1;
};

}  // namespace

TEST_CASE("split softmax: chunks cover [lo, pos] exactly, one chunk up to k_split_positions") {
  CHECK(k_split_positions == 256);
  CHECK(split_count(0, 0) == 1);
  CHECK(split_count(0, 255) == 1);
  CHECK(split_count(0, 256) == 2);
  CHECK(split_count(100, 355) == 1);
  CHECK(split_count(0, 4095) == 16);
  for (int lo : {0, 3, 700})
    for (int len : {1, 2, 255, 256, 257, 511, 512, 513, 3000}) {
      const int pos = lo + len - 1, n = split_count(lo, pos);
      CAPTURE(lo);
      CAPTURE(len);
      int next = lo;
      for (int s = 0; s < n; ++s) {
        CHECK(split_first(lo, s) == next);
        CHECK(split_last(lo, pos, s) >= split_first(lo, s));
        CHECK(split_last(lo, pos, s) - split_first(lo, s) + 1 <= k_split_positions);
        next = split_last(lo, pos, s) + 1;
      }
      CHECK(next == pos + 1);
    }
}

TEST_CASE("split softmax: merged partials equal one softmax over every position") {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.0f, 4.0f);
  const int dv = 24;
  for (int len : {1, 256, 257, 1000, 2049}) {
    for (int lo : {0, 37}) {
      const int pos = lo + len - 1;
      std::vector<float> sc(size_t(pos + 1)), v(size_t((pos + 1) * dv));
      for (float& x : sc) x = d(rng);
      for (float& x : v) x = d(rng) * 0.25f;
      // One chunk far above the others: the others' weights underflow to 0 after rescaling.
      if (len > 600) sc[size_t(lo + 300)] = 95.0f;
      const std::vector<double> want = direct(sc, v, dv, lo, pos);
      const std::vector<float> P = partials(sc, v, dv, lo, pos);
      const int n = split_count(lo, pos), stride = partial_floats(dv);
      const float M = merged_max(P.data(), n, stride);
      const float L = merged_sum(P.data(), P.data() + 1, n, stride, M);
      CAPTURE(len);
      CAPTURE(lo);
      for (int e = 0; e < dv; ++e) {
        const float got = merged_elem(P.data(), P.data() + 2 + e, n, stride, M, L);
        CHECK(std::fabs(double(got) - want[size_t(e)]) <= 1e-5 * std::max(1.0, std::fabs(want[size_t(e)])));
      }
    }
  }
  // Empty partials (a chunk that saw nothing) are skipped; all empty gives 0, not NaN.
  std::vector<float> P = {-INFINITY, 0.0f, 5.0f, 2.0f, 1.0f, 3.0f};
  const float M = merged_max(P.data(), 2, 3);
  const float L = merged_sum(P.data(), P.data() + 1, 2, 3, M);
  CHECK(M == 2.0f);
  CHECK(L == 1.0f);
  CHECK(merged_elem(P.data(), P.data() + 2, 2, 3, M, L) == 3.0f);
  std::vector<float> E = {-INFINITY, 0.0f, 1.0f};
  CHECK(merged_elem(E.data(), E.data() + 2, 1, 3, merged_max(E.data(), 1, 3), 0.0f) == 0.0f);
}

TEST_CASE("split plan: bases per piece, pieces under the bound, rows keep their splits") {
  // Rows: one chunk, 16 splits, one chunk, 3 splits, 16 splits, window row (lo > 0, 1 chunk).
  std::vector<row> rows = {{0, 10}, {0, 4095}, {0, 255}, {0, 700}, {0, 4095}, {3900, 4000}};
  auto pieces = plan_splits(std::span<row>(rows), 1000);
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0].n_rows == 6);
  CHECK(pieces[0].n_partials == 16 + 3 + 16);
  CHECK(pieces[0].max_splits == 16);
  CHECK(rows[0].split_base == 0);
  CHECK(rows[1].split_base == 0);
  CHECK(rows[3].split_base == 16);
  CHECK(rows[4].split_base == 19);
  CHECK(rows[5].split_base == 0);
  // A bound of 18: the 3-split row fits after the first 16, the second 16 starts a piece.
  pieces = plan_splits(std::span<row>(rows), 18);
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[0].first_row == 0);
  CHECK(pieces[0].n_rows == 3);
  CHECK(pieces[0].n_partials == 16);
  CHECK(pieces[1].first_row == 3);
  CHECK(pieces[1].n_rows == 1);
  CHECK(rows[3].split_base == 0);
  CHECK(pieces[2].first_row == 4);
  CHECK(pieces[2].n_rows == 2);
  CHECK(pieces[2].n_partials == 16);
  CHECK(pieces[2].max_splits == 16);
  CHECK(rows[4].split_base == 0);
  // A row needing more than the bound alone still gets a piece; no rows, no pieces.
  pieces = plan_splits(std::span<row>(rows), 4);
  CHECK(pieces.size() == 4);
  std::vector<row> none;
  CHECK(plan_splits(std::span<row>(none), 10).empty());
  // Short rows only: one piece, nothing split.
  std::vector<row> short_rows = {{0, 5}, {0, 200}};
  pieces = plan_splits(std::span<row>(short_rows), 10);
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0].max_splits == 1);
  CHECK(pieces[0].n_partials == 0);
}
