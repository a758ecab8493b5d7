// GPU check of the CUDA backend (kernels/backend/cuda) against the CPU backend: every op on
// random inputs with a stated tolerance, batch invariance, greedy decoding of make-model
// presets, and bandwidth figures. Needs a GPU: run by tests/gpu/run.sh on a lent machine,
// never by ctest here. Any mismatch prints FAIL and the process exits 1.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "kernels/backend/cuda/cuda_backend.h"
#include "kernels/base/error.h"
#include "tests/gpu/backend_check.h"

namespace tandem::gpu_test {

namespace {
int fails = 0, passes = 0;
std::vector<void*> allocations;

void count(bool ok) { ok ? ++passes : ++fails; }

void cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::printf("FAIL: %s: %s\n", what, cudaGetErrorString(e));
  std::exit(1);
}
}  // namespace

void expect_close(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& cpu, float tol) {
  float worst = 0, ref = 1;
  size_t at = 0;
  bool finite = gpu.size() == cpu.size();
  for (size_t i = 0; finite && i < cpu.size(); ++i) ref = std::fmax(ref, std::fabs(cpu[i]));
  for (size_t i = 0; finite && i < gpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) finite = false;
    const float d = std::fabs(gpu[i] - cpu[i]) / ref;
    if (d > worst) worst = d, at = i;
  }
  const bool ok = finite && worst <= tol;
  std::printf("%-44s max |gpu-cpu|/max(1,|cpu|) = %.3g at %zu (tol %.3g) %s\n", what.c_str(), worst, at, tol,
              ok ? "ok" : "FAIL");
  count(ok);
}

void expect_same(const std::string& what, const void* a, const void* b, size_t bytes) {
  expect_true(what + " (same bits)", std::memcmp(a, b, bytes) == 0);
}

void expect_true(const std::string& what, bool ok) {
  std::printf("%-44s %s\n", what.c_str(), ok ? "ok" : "FAIL");
  count(ok);
}

int failures() { return fails; }
int passes_count() { return passes; }

void* to_device_bytes(const void* p, size_t bytes) {
  void* d = nullptr;
  cuda_ok(cudaMalloc(&d, bytes + 16), "cudaMalloc");
  allocations.push_back(d);
  if (bytes > 0) cuda_ok(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to the device");
  return d;
}

float* to_device(const std::vector<float>& v) {
  return static_cast<float*>(to_device_bytes(v.data(), v.size() * sizeof(float)));
}

std::vector<uint8_t> to_host_bytes(const void* d, size_t bytes) {
  std::vector<uint8_t> h(bytes);
  cuda_ok(cudaDeviceSynchronize(), "running the kernels");
  if (bytes > 0) cuda_ok(cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
  return h;
}

std::vector<float> to_host(const float* d, size_t n) {
  std::vector<float> h(n);
  cuda_ok(cudaDeviceSynchronize(), "running the kernels");
  if (n > 0) cuda_ok(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy to the host");
  return h;
}

void free_device() {
  for (void* p : allocations) cudaFree(p);
  allocations.clear();
}

std::vector<float> random_floats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

}  // namespace tandem::gpu_test

int main(int argc, char** argv) {
  using namespace tandem::gpu_test;
  const std::string dir = argc > 1 ? argv[1] : "/tmp";
  if (tandem::backend::cuda_device_count() == 0) {
    std::printf("FAIL: no CUDA device visible\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device 0: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  try {
    check_backend_ops();
    free_device();
    check_sampling();
    free_device();
    check_greedy(dir);
    report_bandwidth();
    free_device();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%d passed, %d failed\n", passes_count(), failures());
  return failures() == 0 ? 0 : 1;
}
