#pragma once
// The CPU kernels (kernels/cpu) behind a plain interface for the CUDA test, compiled by the
// host compiler so nvcc never parses the C++20 kernel headers.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace tandem::gpu_test {

void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps);
void rope(float* x, const int32_t* pos, int rows, int n_heads, int head_dim, float freq_base);
void swiglu(const float* gate, const float* up, float* out, size_t n);
/// Row-major [n][k] floats as f16 bits / ggml q8_0 blocks (ggml's reference quantizer).
std::vector<uint16_t> to_f16(const std::vector<float>& w);
std::vector<uint8_t> to_q8_0(const std::vector<float>& w, int n, int k);
/// y[b][r] with the CPU matmul; `q8` selects q8_0 weights, else f16.
void matmul(bool q8, const void* w, size_t nbytes, int n, int k, const float* x, int batch, float* y);
/// Decode attention with cpu::paged_attention over a kv_pool holding `pool` (all pages, the
/// kv_pool byte layout); one query token per sequence at position lens[i] - 1.
void attention_decode(const std::vector<float>& pool, int n_pages, int n_layers, int n_kv, int head_dim,
                      int page_size, int layer, const float* q, int n_heads,
                      const std::vector<std::vector<int32_t>>& tables, const std::vector<int32_t>& lens, float* out);
/// The same over an f16 cache (`pool` holds IEEE halves in the kv_pool byte layout).
void attention_decode_f16(const std::vector<uint16_t>& pool, int n_pages, int n_layers, int n_kv, int head_dim,
                          int page_size, int layer, const float* q, int n_heads,
                          const std::vector<std::vector<int32_t>>& tables, const std::vector<int32_t>& lens,
                          float* out);

}  // namespace tandem::gpu_test
