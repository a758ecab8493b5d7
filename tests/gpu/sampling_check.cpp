// The CUDA backend's sample op against the CPU backend's (the host sampler's code):
// - greedy rows: the same token always (argmax, ties to the lowest id);
// - temperature / top-k / top-p rows: the same token wherever the draw is clear of a boundary:
//   the CPU gives that token also with the uniform moved by +-1e-5 and top_p by +-1e-5 (the
//   device sums in another order and uses expf; a draw that close to a boundary may go either
//   way and is counted, not failed);
// - logprobs: the chosen token's and the top ones within 1e-5 (absolute), the same top ids
//   where the gap between neighbours exceeds 1e-5;
// - only the result rows cross: timed against copying the logits to the host.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "kernels/backend/cpu_backend.h"
#include "kernels/backend/cuda/cuda_backend.h"
#include "tests/gpu/backend_check.h"

namespace tandem::gpu_test {

namespace {

std::vector<float> logits_rows(int64_t rows, int64_t V, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<float> v(size_t(rows * V));
  for (float& x : v) x = d(rng);
  // Ties on purpose: row 0's best value twice (greedy must take the lower id).
  if (V > 10) v[7] = v[3] = 40.0f;
  return v;
}

void check_vocab(backend::ops& cpu, backend::ops& gpu, int64_t V) {
  std::vector<sample_row> rows;
  std::mt19937_64 rng(V);
  for (float t : {0.0f, 0.4f, 1.0f, 1.5f})
    for (int32_t k : {0, 1, 7, 50, 1000})
      for (float tp : {1.0f, 0.95f, 0.5f})
        for (int rep = 0; rep < 2; ++rep) {
          const int32_t top = rep == 0 ? -1 : int32_t(rows.size() % 21);
          rows.push_back(sample_row{.temperature = t, .top_k = k, .top_p = tp, .top_logprobs = top,
                                    .uniform = double(rng() >> 11) * 0x1.0p-53});
        }
  const int64_t n = int64_t(rows.size());
  const std::vector<float> logits = logits_rows(n, V, uint32_t(V));
  std::vector<token_logprobs> want(rows.size()), got(rows.size());
  cpu.sample(logits.data(), V, rows, want);
  gpu.sample(to_device(logits), V, rows, got);
  int same = 0, boundary = 0, wrong = 0;
  float worst_lp = 0.0f;
  bool tops_ok = true;
  for (int64_t i = 0; i < n; ++i) {
    const sample_row& r = rows[size_t(i)];
    const std::span<const float> row(logits.data() + i * V, size_t(V));
    if (got[size_t(i)].token == want[size_t(i)].token) {
      ++same;
    } else {
      bool clear = true;
      for (double du : {-1e-5, 1e-5})
        for (float dp : {-1e-5f, 0.0f, 1e-5f}) {
          sample_row q = r;
          q.uniform = std::clamp(r.uniform + du, 0.0, 0.9999999999);
          if (r.top_p < 1.0f) q.top_p = std::min(1.0f, r.top_p + dp);
          clear = clear && draw_with_uniform(q, row) == want[size_t(i)].token;
        }
      const bool greedy = r.temperature == 0.0f || r.top_k == 1;
      if (clear || greedy) {
        ++wrong;
        std::printf("  row %lld (T %.2f k %d p %.2f u %.6f): gpu %d, cpu %d\n", (long long)i, r.temperature, r.top_k,
                    r.top_p, r.uniform, got[size_t(i)].token, want[size_t(i)].token);
      } else {
        ++boundary;
      }
    }
    if (r.top_logprobs < 0) {
      tops_ok = tops_ok && got[size_t(i)].top.empty();
      continue;
    }
    if (got[size_t(i)].token != want[size_t(i)].token) continue;
    worst_lp = std::fmax(worst_lp, std::fabs(got[size_t(i)].logprob - want[size_t(i)].logprob));
    const auto& gt = got[size_t(i)].top;
    const auto& wt = want[size_t(i)].top;
    tops_ok = tops_ok && gt.size() == wt.size();
    for (size_t j = 0; tops_ok && j < wt.size(); ++j) {
      worst_lp = std::fmax(worst_lp, std::fabs(gt[j].logprob - wt[j].logprob));
      const bool close_next = j + 1 < wt.size() && std::fabs(wt[j].logprob - wt[j + 1].logprob) <= 1e-5f;
      const bool close_prev = j > 0 && std::fabs(wt[j].logprob - wt[j - 1].logprob) <= 1e-5f;
      if (!close_next && !close_prev) tops_ok = gt[j].token == wt[j].token;
    }
  }
  std::printf("sample vocab %lld: %d rows the same, %d at a boundary (allowed), %d wrong\n", (long long)V, same,
              boundary, wrong);
  expect_true(fmt::format("sample vocab {} tokens equal the cpu's off boundaries", V), wrong == 0);
  expect_true(fmt::format("sample vocab {} boundary draws are rare (<= 2 of {})", V, n), boundary <= 2);
  std::printf("sample vocab %lld logprobs max |gpu-cpu| = %.3g (tol 1e-5)\n", (long long)V, worst_lp);
  expect_true(fmt::format("sample vocab {} logprobs within 1e-5, same top ids", V), worst_lp <= 1e-5f && tops_ok);
}

}  // namespace

void check_sampling() {
  auto cpu = backend::make_cpu_backend(cpu_options{.threads = 4});
  auto gpu = backend::make_cuda_backend(backend::cuda_options{});
  for (int64_t V : {int64_t(11), int64_t(1000), int64_t(32000), int64_t(128256)}) check_vocab(*cpu, *gpu, V);

  // Batch 32 of a 128256 vocabulary: the device draw (top-k 40 + top-p 0.95 rows, which sort,
  // and greedy rows) against only copying the logits to the host, as the host path must.
  const int64_t V = 128256, n = 32;
  float* d = to_device(logits_rows(n, V, 5));
  std::vector<float> host(size_t(n * V));
  auto time = [](auto f) {
    f();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10 * 1e3;
  };
  std::vector<token_logprobs> out(static_cast<size_t>(n));
  for (bool greedy : {true, false}) {
    std::vector<sample_row> rows(size_t(n), sample_row{.temperature = greedy ? 0.0f : 0.8f, .top_k = greedy ? 0 : 40,
                                                       .top_p = greedy ? 1.0f : 0.95f, .uniform = 0.5});
    const double ms = time([&] { gpu->sample(d, V, rows, out); });
    std::printf("sample on device, batch 32 x %lld, %s: %.3f ms\n", (long long)V, greedy ? "greedy" : "top-k 40 top-p 0.95",
                ms);
  }
  const double copy_ms = time([&] { gpu->download(d, host.size(), host.data()); });
  std::printf("copying those logits to the host instead: %.3f ms (%.1f MB)\n", copy_ms, double(host.size()) * 4 / 1e6);
}

}  // namespace tandem::gpu_test
