// GPU check of the CUDA kernels against the CPU kernels (tests/gpu/cpu_reference.cpp wraps
// kernels/cpu), then a bandwidth figure per kernel as achieved GB/s and as a fraction of the
// card's peak (memory clock x bus width from cudaDeviceGetAttribute). Needs a GPU: run by
// tests/gpu/run.sh on a lent machine, never by ctest here. Any mismatch prints FAIL and the
// process exits 1.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_ops.h"
#include "tests/gpu/cpu_reference.h"

namespace ref = tandem::gpu_test;
namespace gpu = tandem::cuda;

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::printf("FAIL: CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

static int failures = 0, passes = 0;
static double peak_gbs = 0;

static void expect_close(const char* what, const std::vector<float>& gpu_out, const std::vector<float>& cpu_out,
                         float tol) {
  float worst = 0;
  size_t at = 0;
  bool finite = gpu_out.size() == cpu_out.size();
  for (size_t i = 0; finite && i < gpu_out.size(); ++i) {
    if (!std::isfinite(gpu_out[i])) finite = false;
    const float d = std::fabs(gpu_out[i] - cpu_out[i]);
    if (d > worst) worst = d, at = i;
  }
  const bool ok = finite && worst <= tol;
  std::printf("%-28s max |gpu-cpu| = %.3g at %zu (tol %.3g) %s\n", what, worst, at, tol, ok ? "ok" : "FAIL");
  ok ? ++passes : ++failures;
}

static void expect_true(const char* what, bool ok) {
  std::printf("%-28s %s\n", what, ok ? "ok" : "FAIL");
  ok ? ++passes : ++failures;
}

template <class T>
static T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
  if (!v.empty()) CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
static std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

static std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

/// Runs `launch` `iters` times between events; prints GB/s for `bytes` moved per launch.
template <class F>
static void bandwidth(const char* what, double bytes, int iters, F launch) {
  launch();  // warm-up
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) launch();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  const double gbs = bytes * iters / (double(ms) / 1e3) / 1e9;
  std::printf("bandwidth %-34s %8.1f GB/s  %.3f of peak  (%.3f ms/launch)\n", what, gbs, gbs / peak_gbs, ms / iters);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

static void check_elementwise() {
  const int rows = 64, n = 768, heads = 12, hd = 64;
  const auto x = randn(size_t(rows) * n, 1), w = randn(n, 2);
  float *dx = to_device(x), *dw = to_device(w), *dy = to_device(std::vector<float>(x.size()));
  std::vector<float> want(x.size());
  gpu::rms_norm(dx, dw, dy, rows, n, 1e-5f, nullptr);
  ref::rms_norm(x.data(), w.data(), want.data(), rows, n, 1e-5f);
  expect_close("rms_norm", to_host(dy, x.size()), want, 1e-4f);

  std::vector<int32_t> pos(rows);
  for (int r = 0; r < rows; ++r) pos[r] = r * 37;  // up to ~2300: exercises the angle range
  int32_t* dpos = to_device(pos);
  gpu::rope(dx, dpos, rows, heads, hd, 10000.f, nullptr);
  want = x;
  ref::rope(want.data(), pos.data(), rows, heads, hd, 10000.f);
  expect_close("rope", to_host(dx, x.size()), want, 2e-3f);

  const auto up = randn(x.size(), 3);
  CHECK(cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
  float* dup = to_device(up);
  gpu::swiglu(dx, dup, dy, x.size(), nullptr);
  ref::swiglu(x.data(), up.data(), want.data(), x.size());
  expect_close("swiglu", to_host(dy, x.size()), want, 1e-4f);
  CHECK(cudaGetLastError());
  cudaFree(dx), cudaFree(dw), cudaFree(dy), cudaFree(dpos), cudaFree(dup);

  // Bandwidth: 4096 rows of 8192 floats (128 MiB in, 128 MiB out).
  const int br = 4096, bn = 8192;
  float *bx, *by, *bw;
  CHECK(cudaMalloc(&bx, size_t(br) * bn * 4));
  CHECK(cudaMalloc(&by, size_t(br) * bn * 4));
  CHECK(cudaMalloc(&bw, size_t(bn) * 4));
  CHECK(cudaMemset(bx, 0, size_t(br) * bn * 4));
  CHECK(cudaMemset(bw, 0, size_t(bn) * 4));
  bandwidth("rms_norm 4096x8192 (read+write)", 2.0 * br * bn * 4, 20,
            [&] { gpu::rms_norm(bx, bw, by, br, bn, 1e-5f, nullptr); });
  bandwidth("swiglu 32M (2 reads + write)", 3.0 * br * bn * 4 / 2, 20,
            [&] { gpu::swiglu(bx, bx + size_t(br) * bn / 2, by, size_t(br) * bn / 2, nullptr); });
  cudaFree(bx), cudaFree(by), cudaFree(bw);
}

static void check_matmul() {
  for (bool q8 : {false, true}) {
    const int n = 520, k = 1024;  // 520: a partial block of rows
    const auto w = randn(size_t(n) * k, 4, 0.05f);
    std::vector<uint8_t> bytes;
    if (q8) {
      bytes = ref::to_q8_0(w, n, k);
    } else {
      const auto h = ref::to_f16(w);
      bytes.resize(h.size() * 2);
      std::memcpy(bytes.data(), h.data(), bytes.size());
    }
    uint8_t* dw = to_device(bytes);
    for (int batch : {1, 3, 8, 13}) {
      const auto x = randn(size_t(batch) * k, 5 + batch);
      float* dx = to_device(x);
      float* dy = to_device(std::vector<float>(size_t(batch) * n, NAN));
      CHECK(q8 ? gpu::matmul_q8_0(dw, dx, batch, dy, n, k, nullptr)
               : gpu::matmul_f16(reinterpret_cast<const uint16_t*>(dw), dx, batch, dy, n, k, nullptr));
      std::vector<float> want(size_t(batch) * n);
      ref::matmul(q8, bytes.data(), bytes.size(), n, k, x.data(), batch, want.data());
      char name[64];
      std::snprintf(name, sizeof name, "matmul %s batch %d", q8 ? "q8_0" : "f16", batch);
      expect_close(name, to_host(dy, want.size()), want, 1e-3f);
      cudaFree(dx), cudaFree(dy);
    }
    expect_true(q8 ? "matmul q8_0 rejects k % 32" : "matmul f16 rejects k % 8",
                (q8 ? gpu::matmul_q8_0(dw, nullptr, 1, nullptr, n, 40, nullptr)
                    : gpu::matmul_f16(nullptr, nullptr, 1, nullptr, n, 12, nullptr)) == cudaErrorInvalidValue);
    cudaFree(dw);
  }
  // Bandwidth: an 8192 x 8192 weight matrix (beyond L2), batch 1 and 8.
  const int n = 8192, k = 8192;
  for (bool q8 : {false, true}) {
    const size_t wbytes = q8 ? size_t(n) * k / 32 * 34 : size_t(n) * k * 2;
    uint8_t* dw;
    float *dx, *dy;
    CHECK(cudaMalloc(&dw, wbytes));
    CHECK(cudaMemset(dw, 0, wbytes));
    CHECK(cudaMalloc(&dx, size_t(8) * k * 4));
    CHECK(cudaMemset(dx, 0, size_t(8) * k * 4));
    CHECK(cudaMalloc(&dy, size_t(8) * n * 4));
    for (int batch : {1, 8}) {
      char name[64];
      std::snprintf(name, sizeof name, "matmul %s 8192x8192 batch %d", q8 ? "q8_0" : "f16", batch);
      bandwidth(name, double(wbytes), 20, [&] {
        CHECK(q8 ? gpu::matmul_q8_0(dw, dx, batch, dy, n, k, nullptr)
                 : gpu::matmul_f16(reinterpret_cast<const uint16_t*>(dw), dx, batch, dy, n, k, nullptr));
      });
    }
    cudaFree(dw), cudaFree(dx), cudaFree(dy);
  }
}

static void check_attention() {
  // GQA 8 query heads over 4 KV heads, pages of 16, 2 layers, scattered pages; every head size
  // class of the kernel's thread layout (a row's 16-byte pieces split over 4 to 32 threads,
  // 1 to 7 pieces per thread), on an f32 and an f16 cache.
  const int n_layers = 2, n_kv = 4, ps = 16, n_heads = 8, layer = 1;
  const std::vector<int32_t> lens = {1, 17, 100, 255, 513};
  int max_pages = 0, total = 0;
  for (int l : lens) max_pages = std::max(max_pages, (l + ps - 1) / ps), total += (l + ps - 1) / ps;
  const int n_pages = total + 7;
  std::vector<int32_t> perm(n_pages);
  for (int i = 0; i < n_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(9));
  std::vector<std::vector<int32_t>> tables;
  std::vector<int32_t> flat(lens.size() * size_t(max_pages), 0);
  int next = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    std::vector<int32_t> t;
    for (int p = 0; p < (lens[s] + ps - 1) / ps; ++p) t.push_back(perm[next++]);
    std::copy(t.begin(), t.end(), flat.begin() + s * max_pages);
    tables.push_back(t);
  }
  int32_t *dtab = to_device(flat), *dlens = to_device(lens);
  for (int hd : {64, 32, 96, 128, 224, 256}) {
    const size_t page_floats = size_t(2) * n_layers * ps * n_kv * hd;
    const auto pool = randn(page_floats * n_pages, 10);
    const auto q = randn(lens.size() * n_heads * hd, 11);
    float *dpool = to_device(pool), *dq = to_device(q), *dout = to_device(std::vector<float>(q.size(), NAN));
    const gpu::paged_kv kv{dpool, n_layers, n_kv, hd, ps};
    CHECK(gpu::paged_attention_decode(dq, int(lens.size()), n_heads, kv, layer, dtab, max_pages, dlens, dout, nullptr));
    std::vector<float> want(q.size());
    ref::attention_decode(pool, n_pages, n_layers, n_kv, hd, ps, layer, q.data(), n_heads, tables, lens, want.data());
    char name[64];
    std::snprintf(name, sizeof name, "paged_attention_decode hd %d", hd);
    expect_close(name, to_host(dout, q.size()), want, 1e-4f);
    // The same cache in f16 (kv_cache_dtype = "f16"): against the CPU kernels on the same halves.
    const std::vector<uint16_t> pool16 = ref::to_f16(pool);
    uint16_t* dpool16 = to_device(pool16);
    CHECK(gpu::paged_attention_decode(dq, int(lens.size()), n_heads, gpu::paged_kv{dpool16, n_layers, n_kv, hd, ps, true},
                                      layer, dtab, max_pages, dlens, dout, nullptr));
    ref::attention_decode_f16(pool16, n_pages, n_layers, n_kv, hd, ps, layer, q.data(), n_heads, tables, lens,
                              want.data());
    std::snprintf(name, sizeof name, "paged_attention_decode hd %d f16", hd);
    expect_close(name, to_host(dout, q.size()), want, 1e-4f);
    if (hd == 64)
      expect_true("attention rejects head_dim 48",
                  gpu::paged_attention_decode(dq, 1, n_heads, gpu::paged_kv{dpool, n_layers, n_kv, 48, ps}, layer, dtab,
                                              max_pages, dlens, dout, nullptr) == cudaErrorInvalidValue);
    cudaFree(dpool), cudaFree(dpool16), cudaFree(dq), cudaFree(dout);
  }
  cudaFree(dtab), cudaFree(dlens);

  // Bandwidth: 32 sequences x 4096 positions, 8 KV heads x 128, 32 query heads, 1 layer
  // (1 GiB of K and V, each byte read once from memory; the 4 query heads of a group share it via L2).
  const int bs = 32, blen = 4096, bkv = 8, bhd = 128, bheads = 32, bpages = blen / ps;
  const size_t bpage_floats = size_t(2) * ps * bkv * bhd;
  float *bpool, *bq, *bout;
  CHECK(cudaMalloc(&bpool, bpage_floats * bs * bpages * 4));
  CHECK(cudaMemset(bpool, 0, bpage_floats * bs * bpages * 4));
  CHECK(cudaMalloc(&bq, size_t(bs) * bheads * bhd * 4));
  CHECK(cudaMemset(bq, 0, size_t(bs) * bheads * bhd * 4));
  CHECK(cudaMalloc(&bout, size_t(bs) * bheads * bhd * 4));
  std::vector<int32_t> btab(size_t(bs) * bpages), blens(bs, blen);
  for (size_t i = 0; i < btab.size(); ++i) btab[i] = int32_t(i);
  int32_t *dbtab = to_device(btab), *dblens = to_device(blens);
  bandwidth("paged_attention_decode 32x4096", double(bpage_floats) * bs * bpages * 4, 10, [&] {
    CHECK(gpu::paged_attention_decode(bq, bs, bheads, gpu::paged_kv{bpool, 1, bkv, bhd, ps}, 0, dbtab, bpages, dblens,
                                      bout, nullptr));
  });
  // The same positions in an f16 cache: half the bytes (the first half of the zeroed buffer).
  bandwidth("paged_attention_decode 32x4096 f16 cache", double(bpage_floats) * bs * bpages * 2, 10, [&] {
    CHECK(gpu::paged_attention_decode(bq, bs, bheads, gpu::paged_kv{bpool, 1, bkv, bhd, ps, true}, 0, dbtab, bpages,
                                      dblens, bout, nullptr));
  });
  cudaFree(bpool), cudaFree(bq), cudaFree(bout), cudaFree(dbtab), cudaFree(dblens);
}

static void check_pages() {
  // Gather scattered device pages into mapped pinned host memory and scatter them back.
  const size_t page_bytes = 256 << 10;
  const int pages = 512, moved = 64;
  uint8_t *pool, *pool2;
  CHECK(cudaMalloc(&pool, page_bytes * pages));
  CHECK(cudaMalloc(&pool2, page_bytes * pages));
  std::vector<uint8_t> content(page_bytes * pages);
  std::mt19937 rng(12);
  for (auto& b : content) b = uint8_t(rng());
  CHECK(cudaMemcpy(pool, content.data(), content.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(pool2, 0, page_bytes * pages));
  std::vector<int32_t> ids(moved), ids2(moved);
  for (int i = 0; i < moved; ++i) ids[i] = (i * 37 + 5) % pages, ids2[i] = pages - 1 - i;
  int32_t *dids = to_device(ids), *dids2 = to_device(ids2);
  uint8_t *host, *host_dev;
  CHECK(cudaHostAlloc(&host, page_bytes * pages, cudaHostAllocMapped));
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), host, 0));
  std::memset(host, 0, page_bytes * moved);
  CHECK(gpu::gather_pages(pool, dids, moved, page_bytes, host_dev, nullptr));
  CHECK(cudaDeviceSynchronize());
  bool same = true;
  for (int i = 0; i < moved && same; ++i)
    same = std::memcmp(host + size_t(i) * page_bytes, content.data() + size_t(ids[i]) * page_bytes, page_bytes) == 0;
  expect_true("gather_pages to pinned host", same);
  CHECK(gpu::scatter_pages(host_dev, dids2, moved, page_bytes, pool2, nullptr));
  auto back = to_host(pool2, page_bytes * pages);
  same = true;
  for (int i = 0; i < moved && same; ++i)
    same = std::memcmp(back.data() + size_t(ids2[i]) * page_bytes, content.data() + size_t(ids[i]) * page_bytes,
                       page_bytes) == 0;
  expect_true("scatter_pages from pinned host", same);
  // Untouched pages stay zero.
  same = true;
  for (size_t i = 0; i < page_bytes && same; ++i) same = back[i] == 0;
  expect_true("scatter leaves other pages", same);
  expect_true("gather rejects page_bytes % 16",
              gpu::gather_pages(pool, dids, 1, 100, host_dev, nullptr) == cudaErrorInvalidValue);
  // More pages than one grid holds (65535 rows of blocks), reversed; and pages of 100 bytes
  // (no 16-byte copies).
  for (size_t pb : {size_t(16), size_t(100)}) {
    const int many = pb == 16 ? 70000 : 3000;
    std::vector<int32_t> rev(many);
    for (int i = 0; i < many; ++i) rev[i] = many - 1 - i;
    int32_t* drev = to_device(rev);
    CHECK(cudaMemset(pool2, 0, pb * many));
    gpu::copy_pages(pool, nullptr, pool2, drev, many, pb, nullptr);
    auto got = to_host(pool2, pb * many);
    same = true;
    for (int i = 0; i < many && same; ++i)
      same = std::memcmp(got.data() + size_t(many - 1 - i) * pb, content.data() + size_t(i) * pb, pb) == 0;
    expect_true(pb == 16 ? "copy_pages of 70000 pages" : "copy_pages of 100-byte pages", same);
    cudaFree(drev);
  }

  // Bandwidth: device pool -> device pool (read + write), device -> pinned host by the
  // gather kernel, and cudaMemcpyAsync of the same bytes to pinned host, side by side.
  std::vector<int32_t> all(pages), rall(pages);
  for (int i = 0; i < pages; ++i) all[i] = i, rall[i] = pages - 1 - i;
  int32_t *dall = to_device(all), *drall = to_device(rall);
  bandwidth("copy_pages device->device (r+w)", 2.0 * page_bytes * pages, 10,
            [&] { gpu::copy_pages(pool, dall, pool2, drall, pages, page_bytes, nullptr); });
  bandwidth("gather_pages device->pinned host", double(page_bytes) * pages, 5,
            [&] { CHECK(gpu::gather_pages(pool, drall, pages, page_bytes, host_dev, nullptr)); });
  bandwidth("cudaMemcpyAsync device->pinned host", double(page_bytes) * pages, 5,
            [&] { CHECK(cudaMemcpyAsync(host, pool, page_bytes * pages, cudaMemcpyDeviceToHost, nullptr)); });
  bandwidth("scatter_pages pinned host->device", double(page_bytes) * pages, 5,
            [&] { CHECK(gpu::scatter_pages(host_dev, drall, pages, page_bytes, pool2, nullptr)); });
  cudaFreeHost(host);
  cudaFree(pool), cudaFree(pool2), cudaFree(dids), cudaFree(dids2), cudaFree(dall), cudaFree(drall);
}

int main() {
  int dev = 0, clock_khz = 0, bus_bits = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev));
  CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  // Double data rate: two transfers per clock.
  peak_gbs = 2.0 * double(clock_khz) * 1e3 * (bus_bits / 8) / 1e9;
  std::printf("%s: memory clock %d MHz x %d bits -> peak %.0f GB/s\n", prop.name, clock_khz / 1000, bus_bits, peak_gbs);
  if (peak_gbs <= 0) {
    std::printf("FAIL: the device reports no memory bandwidth\n");
    return 1;
  }
  check_elementwise();
  check_matmul();
  check_attention();
  check_pages();
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures ? 1 : 0;
}
