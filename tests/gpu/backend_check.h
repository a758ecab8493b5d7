#pragma once
// Shared helpers of test_cuda_backend (the CUDA backend against the CPU backend): counters,
// tolerance checks, device copies. Plain main(), no test framework: the GPU machines have no
// Debian packages (doctest included).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tandem::gpu_test {

/// Prints "ok"/"FAIL" with the largest |gpu - cpu| relative to max(1, max |cpu|); counts it.
void expect_close(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& cpu, float tol);
/// Bit-for-bit equality (same sizes, same bytes).
void expect_same(const std::string& what, const void* a, const void* b, size_t bytes);
void expect_true(const std::string& what, bool ok);
int failures();
int passes_count();

/// A device copy of `v` (freed at exit) and a host copy of n floats of device memory.
float* to_device(const std::vector<float>& v);
void* to_device_bytes(const void* p, size_t bytes);
std::vector<float> to_host(const float* d, size_t n);
std::vector<uint8_t> to_host_bytes(const void* d, size_t bytes);
void free_device();

/// n uniform floats in [-scale, scale) from `seed`.
std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f);

/// The op-by-op comparison (backend_ops_check.cpp) and the whole-model greedy comparison
/// (greedy_check.cpp); `dir` holds the model files the latter writes.
void check_backend_ops();
/// The sample op against the CPU backend's (sampling_check.cpp).
void check_sampling();
void check_greedy(const std::string& dir);
/// Paged decode attention of the CUDA backend at batch 32 x 4096 positions and device page
/// copies as fractions of the measured device-to-device cudaMemcpy bandwidth.
void report_bandwidth();

}  // namespace tandem::gpu_test
