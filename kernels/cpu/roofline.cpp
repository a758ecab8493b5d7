#include "kernels/cpu/roofline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "kernels/base/error.h"
#include "kernels/cpu/huge_pages.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/simd.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::cpu {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Sums 64-byte lines with 4 independent accumulators so the loads, not the adds, bound it.
__attribute__((target("avx2"))) float read_avx2(const float* p, size_t n, size_t ahead) {
  __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    if (ahead > 0)
      for (int l = 0; l < 2; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p + i) + ahead + 64 * l, _MM_HINT_T1);
    a = _mm256_add_ps(a, _mm256_load_ps(p + i));
    b = _mm256_add_ps(b, _mm256_load_ps(p + i + 8));
    c = _mm256_add_ps(c, _mm256_load_ps(p + i + 16));
    d = _mm256_add_ps(d, _mm256_load_ps(p + i + 24));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
  return t[0] + t[7];
}

// With `ahead` > 0, each 256-byte step also requests the lines `ahead` bytes further on into
// L2: the batch-1 matmuls prefetch that way (kernels/cpu/matmul.cpp), and measured side by
// side it streamed 5-10% faster than the hardware prefetcher alone (2 threads, Zen 4: 34 vs
// 31 GB/s), so a probe without it let a decode step beat its "roofline".
__attribute__((target("avx512f"))) float read_avx512(const float* p, size_t n, size_t ahead) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i + 64 <= n; i += 64) {
    if (ahead > 0)
      for (int l = 0; l < 4; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p + i) + ahead + 64 * l, _MM_HINT_T1);
    a = _mm512_add_ps(a, _mm512_load_ps(p + i));
    b = _mm512_add_ps(b, _mm512_load_ps(p + i + 16));
    c = _mm512_add_ps(c, _mm512_load_ps(p + i + 32));
    d = _mm512_add_ps(d, _mm512_load_ps(p + i + 48));
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
  return t[0] + t[15];
}

float read_scalar(const float* p, size_t n) {
  float a = 0, b = 0, c = 0, d = 0;
  for (size_t i = 0; i + 16 <= n; i += 16) {
    a += p[i];
    b += p[i + 4];
    c += p[i + 8];
    d += p[i + 12];
  }
  return a + b + c + d;
}

// `iters` rounds of 12 independent FMA chains (enough to cover FMA latency x ports).
__attribute__((target("avx512f"))) float fma_avx512(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(float(j) * 1e-3f);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  alignas(64) float t[16];
  __m512 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, acc[j]);
  _mm512_store_ps(t, s);
  return t[0];
}

__attribute__((target("avx2,fma"))) float fma_avx2(int64_t iters) {
  __m256 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm256_set1_ps(float(j) * 1e-3f);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  alignas(32) float t[8];
  __m256 s = acc[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, acc[j]);
  _mm256_store_ps(t, s);
  return t[0];
}

float fma_scalar(int64_t iters) {
  float acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = float(j) * 1e-3f;
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] * 0.999999f + 1e-7f;
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

}  // namespace

double measure_read_bandwidth(thread_pool& pool, size_t bytes, int reps) {
  const size_t n = bytes / sizeof(float) / 64 * 64;
  if (n == 0 || reps < 1) throw tandem::error("bandwidth probe needs at least 256 bytes and one repetition");
  // On 2 MiB pages where the kernel grants them: what the machine streams without a TLB miss
  // every 4 KiB (a decode step's weights, mmapped, sit on page-cache pages of either size).
  size_t allocated = 0;
  std::unique_ptr<void, huge_free> buf(huge_alloc(n * sizeof(float), allocated));
  if (!buf) throw tandem::error("bandwidth probe: cannot allocate its buffer; use a smaller size");
  float* p = static_cast<float*>(buf.get());
  // First touch from the threads that will read (NUMA placement), then the timed passes.
  const int64_t parts = pool.size() * 16;
  auto range = [&](int64_t i, size_t& b, size_t& e) {
    b = n / size_t(parts) * size_t(i) / 64 * 64;
    e = i + 1 == parts ? n : n / size_t(parts) * size_t(i + 1) / 64 * 64;
  };
  pool.parallel_for(parts, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      size_t b, e;
      range(i, b, e);
      for (size_t j = b; j < e; ++j) p[j] = float(j & 7);
    }
  });
  const cpu_isa isa = vector_isa(detected_isa());
  std::atomic<float> sink{0};
  double best = 0;
  // Each repetition reads it three times: plainly without and with software prefetch 16 KiB
  // ahead (see read_avx512), and as a batch-1 f16 matmul over rows of 2048 columns, the
  // decode kernel's own pattern (8 rows side by side, the next 8 requested ahead; see
  // kernels/cpu/matmul.cpp), so that the roofline is never below what that kernel streams.
  // The fastest pass counts. Measured, 1 thread, 512 MiB on 2 MiB pages (Zen 4 EPYC VM): plain
  // 29-31 GB/s, with prefetch 28, the matmul 28-29; on 4 KiB pages the plain read fell to
  // 25-26 GB/s while the matmul kept 26-27 (a llama-1b f16 decode step streamed its mmapped
  // weights at 25-26).
  constexpr int64_t probe_cols = 2048;
  const std::vector<float> ones(size_t(probe_cols), 1.0f);
  std::atomic<size_t> matmul_bytes{0};  // a part's rows end up to a row short of its end
  for (int pass = 0; pass < 3 * (reps + 1); ++pass) {  // the first three only warm the TLB and page tables
    const size_t ahead = pass % 3 == 1 ? size_t(16) << 10 : 0;
    matmul_bytes.store(0);
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(parts, [&](int64_t i0, int64_t i1) {
      size_t b, e0, b1, e;
      range(i0, b, e0);
      range(i1 - 1, b1, e);
      float s = 0;
      if (pass % 3 == 2) {
        tensor_view w;
        w.type = ggml_type::f16;
        w.ne[0] = probe_cols;
        w.ne[1] = int64_t((e - b) * sizeof(float) / (2 * probe_cols));
        w.n_dims = 2;
        w.data = p + b;
        w.nbytes = size_t(w.ne[1]) * 2 * probe_cols;
        std::vector<float> y(size_t(w.ne[1])), scratch;
        matmul(w, ones.data(), 1, y.data(), scratch, nullptr, isa);
        matmul_bytes.fetch_add(w.nbytes, std::memory_order_relaxed);
        s = y.empty() ? 0.0f : y.back();
      } else {
        s = isa == cpu_isa::avx512 ? read_avx512(p + b, e - b, ahead)
            : isa == cpu_isa::avx2 ? read_avx2(p + b, e - b, ahead)
                                   : read_scalar(p + b, e - b);
      }
      sink.store(s, std::memory_order_relaxed);
    });
    const double sec = seconds_since(t0);
    const size_t bytes = pass % 3 == 2 ? matmul_bytes.load() : n * sizeof(float);
    if (pass >= 3) best = std::max(best, double(bytes) / sec);
  }
  return best;
}

double measure_peak_fma(thread_pool& pool, cpu_isa isa, int reps) {
  isa = vector_isa(resolve_isa(isa));
  const int lanes = isa == cpu_isa::avx512 ? 16 : isa == cpu_isa::avx2 ? 8 : 1;
  const int chains = isa == cpu_isa::scalar ? 8 : 12;
  const int64_t iters = isa == cpu_isa::scalar ? (int64_t(1) << 24) : (int64_t(1) << 22);
  std::atomic<float> sink{0};
  double best = 0;
  for (int r = 0; r < std::max(1, reps); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(pool.size(), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const float s = isa == cpu_isa::avx512 ? fma_avx512(iters)
                        : isa == cpu_isa::avx2 ? fma_avx2(iters)
                                               : fma_scalar(iters);
        sink.store(s, std::memory_order_relaxed);
      }
    });
    const double sec = seconds_since(t0);
    best = std::max(best, 2.0 * double(lanes) * chains * double(iters) * pool.size() / sec);
  }
  return best;
}

}  // namespace tandem::cpu
