// GPU check of the CUDA kernels against scalar CPU references, plus a page-copy bandwidth
// figure. Needs a GPU: run by tests/gpu/run.sh on a lent machine, never by ctest here.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_ops.h"

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

static int failures = 0;
static void expect_close(const char* what, const std::vector<float>& a, const std::vector<float>& b, float tol) {
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::fmax(worst, std::fabs(a[i] - b[i]));
  std::printf("%-10s max |gpu-cpu| = %.3g (tol %.3g) %s\n", what, worst, tol, worst <= tol ? "ok" : "FAIL");
  if (worst > tol) ++failures;
}

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0, 1);
  const int rows = 64, n = 768, heads = 12, hd = 64;
  std::vector<float> x(rows * n), w(n), y(rows * n), ref(rows * n);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng);
  float *dx, *dw, *dy;
  CHECK(cudaMalloc(&dx, x.size() * 4));
  CHECK(cudaMalloc(&dw, w.size() * 4));
  CHECK(cudaMalloc(&dy, y.size() * 4));
  CHECK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));

  tandem::cuda::rms_norm(dx, dw, dy, rows, n, 1e-5f, nullptr);
  CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(x[r * n + i]) * x[r * n + i];
    float sc = float(1.0 / std::sqrt(ss / n + 1e-5));
    for (int i = 0; i < n; ++i) ref[r * n + i] = x[r * n + i] * sc * w[i];
  }
  expect_close("rms_norm", y, ref, 1e-4f);

  std::vector<int32_t> pos(rows);
  for (int r = 0; r < rows; ++r) pos[r] = r * 7;
  int32_t* dpos;
  CHECK(cudaMalloc(&dpos, rows * 4));
  CHECK(cudaMemcpy(dpos, pos.data(), rows * 4, cudaMemcpyHostToDevice));
  tandem::cuda::rope(dx, dpos, rows, heads, hd, 10000.f, nullptr);
  CHECK(cudaMemcpy(y.data(), dx, y.size() * 4, cudaMemcpyDeviceToHost));
  ref = x;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < hd / 2; ++i) {
        double th = pos[r] * std::pow(10000.0, -2.0 * i / hd);
        float* p = &ref[r * n + h * hd + 2 * i];
        float a = p[0], b = p[1];
        p[0] = float(a * std::cos(th) - b * std::sin(th));
        p[1] = float(a * std::sin(th) + b * std::cos(th));
      }
  expect_close("rope", y, ref, 2e-3f);

  CHECK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  tandem::cuda::swiglu(dx, dx, dy, x.size(), nullptr);
  CHECK(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < x.size(); ++i) ref[i] = x[i] / (1 + std::exp(-x[i])) * x[i];
  expect_close("swiglu", y, ref, 1e-4f);

  // Page copy: correctness then bandwidth, device pool -> device pool.
  const size_t page_bytes = 256 << 10;
  const int pages = 2048;
  uint8_t *src, *dst;
  CHECK(cudaMalloc(&src, page_bytes * pages));
  CHECK(cudaMalloc(&dst, page_bytes * pages));
  std::vector<int32_t> ids(pages), rid(pages);
  for (int i = 0; i < pages; ++i) ids[i] = i, rid[i] = pages - 1 - i;
  int32_t *dids, *drid;
  CHECK(cudaMalloc(&dids, pages * 4));
  CHECK(cudaMalloc(&drid, pages * 4));
  CHECK(cudaMemcpy(dids, ids.data(), pages * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(drid, rid.data(), pages * 4, cudaMemcpyHostToDevice));
  std::vector<uint8_t> hp(page_bytes * 2);
  for (auto& b : hp) b = uint8_t(rng());
  CHECK(cudaMemcpy(src, hp.data(), page_bytes * 2, cudaMemcpyHostToDevice));
  tandem::cuda::copy_pages(src, dids, dst, drid, 2, page_bytes, nullptr);
  std::vector<uint8_t> back(page_bytes);
  CHECK(cudaMemcpy(back.data(), dst + (pages - 1) * page_bytes, page_bytes, cudaMemcpyDeviceToHost));
  bool same = std::equal(back.begin(), back.end(), hp.begin());
  std::printf("copy_pages content %s\n", same ? "ok" : "FAIL");
  if (!same) ++failures;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  tandem::cuda::copy_pages(src, dids, dst, drid, pages, page_bytes, nullptr);
  cudaEventRecord(a);
  const int iters = 10;
  for (int i = 0; i < iters; ++i) tandem::cuda::copy_pages(src, dids, dst, drid, pages, page_bytes, nullptr);
  cudaEventRecord(b);
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  double gbs = 2.0 * page_bytes * pages * iters / (ms / 1e3) / 1e9;  // read + write
  std::printf("copy_pages bandwidth %.0f GB/s (read+write), %d pages of %zu KiB\n", gbs, pages, page_bytes >> 10);
  std::printf("%d passed, %d failed\n", 4 - failures, failures);
  return failures ? 1 : 0;
}
