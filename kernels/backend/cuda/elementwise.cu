// The CUDA backend's elementwise and row-wise kernels (kernels.h). Grid-stride loops; every
// output element depends only on its own inputs.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/backend/cuda/kernels.h"

namespace tandem::cuda_backend {
namespace {

constexpr int k_threads = 256;

int blocks_for(size_t n) {
  const size_t b = (n + k_threads - 1) / k_threads;
  return int(b == 0 ? 1 : b < 65536 ? b : 65536);
}

__global__ void rope_kernel(float* x, const float* cs, int64_t rows, int n_heads, int head_dim, bool neox) {
  const int half = head_dim / 2;
  const size_t total = size_t(rows) * n_heads * half;
  for (size_t j = blockIdx.x * size_t(blockDim.x) + threadIdx.x; j < total; j += size_t(gridDim.x) * blockDim.x) {
    const size_t r = j / (size_t(n_heads) * half);
    const int h = int(j / half % n_heads), i = int(j % half);
    const float c = cs[(r * half + i) * 2], s = cs[(r * half + i) * 2 + 1];
    float* p = x + (r * n_heads + h) * head_dim;
    float* a = neox ? p + i : p + 2 * i;
    float* b = neox ? p + i + half : p + 2 * i + 1;
    const float x0 = *a, x1 = *b;
    // No fused multiply-add: the CPU's rotation rounds each product.
    *a = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    *b = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  }
}

__global__ void geglu_kernel(const float* g, const float* u, float* o, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float x = g[i];
    const float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
    o[i] = 0.5f * x * (1.0f + t) * u[i];
  }
}

__global__ void softcap_kernel(float* x, size_t n, float cap) {
  const float inv = 1.0f / cap;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = cap * tanhf(x[i] * inv);
}

__global__ void add_kernel(float* y, const float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}

__global__ void scale_kernel(float* x, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] *= v;
}

__global__ void add_bias_kernel(float* y, const float* b, size_t total, int64_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    y[i] += b[i % size_t(n)];
}

// dst row (scatter ? rows[j] : j) = src row (scatter ? j : rows[j]).
__global__ void move_rows_kernel(const float* src, const int32_t* rows, int64_t n_rows, float* dst, int64_t width,
                                 bool scatter) {
  const size_t total = size_t(n_rows) * size_t(width);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t j = i / size_t(width), e = i % size_t(width);
    const size_t r = size_t(rows[j]);
    if (scatter)
      dst[r * size_t(width) + e] = src[i];
    else
      dst[i] = src[r * size_t(width) + e];
  }
}

__global__ void moe_combine_kernel(const float* eo, const float* w, int64_t rows, int64_t k, int64_t n,
                                   const float* shared, float* y) {
  const size_t total = size_t(rows) * size_t(n);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / size_t(n), e = i % size_t(n);
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const float v = __fmul_rn(eo[(t * size_t(k) + size_t(j)) * size_t(n) + e], w[t * size_t(k) + size_t(j)]);
      acc = j == 0 ? v : __fadd_rn(acc, v);
    }
    y[i] = shared != nullptr ? __fadd_rn(acc, shared[i]) : acc;
  }
}

__global__ void kv_write_kernel(uint8_t* pool, size_t page_stride, size_t comp_offset, const int32_t* slots,
                                int64_t n, const float* rows, int64_t width, int elem_bytes) {
  const size_t total = size_t(n) * size_t(width);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(width), e = i % size_t(width);
    uint8_t* base = pool + size_t(slots[2 * r]) * page_stride + comp_offset +
                    size_t(slots[2 * r + 1]) * size_t(width) * size_t(elem_bytes);
    const float v = rows[i];
    if (elem_bytes == 2) {
      // As cpu::fp32_to_fp16_row: finite values past the half range clamp to +-65504.
      const float c = isfinite(v) ? fminf(fmaxf(v, -65504.0f), 65504.0f) : v;
      reinterpret_cast<__half*>(base)[e] = __float2half_rn(c);
    } else {
      reinterpret_cast<float*>(base)[e] = v;
    }
  }
}

}  // namespace

cudaError_t rope(float* x, const float* cos_sin, int64_t rows, int n_heads, int head_dim, bool neox, cudaStream_t s) {
  if (rows <= 0) return cudaSuccess;
  rope_kernel<<<blocks_for(size_t(rows) * n_heads * (head_dim / 2)), k_threads, 0, s>>>(x, cos_sin, rows, n_heads,
                                                                                       head_dim, neox);
  return cudaGetLastError();
}

cudaError_t geglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  geglu_kernel<<<blocks_for(n), k_threads, 0, s>>>(gate, up, out, n);
  return cudaGetLastError();
}

cudaError_t softcap(float* x, size_t n, float cap, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  softcap_kernel<<<blocks_for(n), k_threads, 0, s>>>(x, n, cap);
  return cudaGetLastError();
}

cudaError_t add(float* y, const float* x, int64_t n, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  add_kernel<<<blocks_for(size_t(n)), k_threads, 0, s>>>(y, x, size_t(n));
  return cudaGetLastError();
}

cudaError_t scale(float* x, int64_t n, float v, cudaStream_t s) {
  if (n <= 0) return cudaSuccess;
  scale_kernel<<<blocks_for(size_t(n)), k_threads, 0, s>>>(x, size_t(n), v);
  return cudaGetLastError();
}

cudaError_t add_bias(float* y, const float* b, int64_t rows, int64_t n, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  add_bias_kernel<<<blocks_for(size_t(rows * n)), k_threads, 0, s>>>(y, b, size_t(rows * n), n);
  return cudaGetLastError();
}

cudaError_t gather_rows(const float* src, const int32_t* rows, int64_t n_rows, float* dst, int64_t width,
                        cudaStream_t s) {
  if (n_rows <= 0 || width <= 0) return cudaSuccess;
  move_rows_kernel<<<blocks_for(size_t(n_rows * width)), k_threads, 0, s>>>(src, rows, n_rows, dst, width, false);
  return cudaGetLastError();
}

cudaError_t scatter_rows(const float* src, const int32_t* rows, int64_t n_rows, float* dst, int64_t width,
                         cudaStream_t s) {
  if (n_rows <= 0 || width <= 0) return cudaSuccess;
  move_rows_kernel<<<blocks_for(size_t(n_rows * width)), k_threads, 0, s>>>(src, rows, n_rows, dst, width, true);
  return cudaGetLastError();
}

cudaError_t moe_combine(const float* expert_out, const float* weights, int64_t rows, int64_t k, int64_t n,
                        const float* shared, float* y, cudaStream_t s) {
  if (rows <= 0 || n <= 0) return cudaSuccess;
  moe_combine_kernel<<<blocks_for(size_t(rows * n)), k_threads, 0, s>>>(expert_out, weights, rows, k, n, shared, y);
  return cudaGetLastError();
}

cudaError_t kv_write(uint8_t* pool, size_t page_stride, size_t comp_offset, const int32_t* slots, int64_t n,
                     const float* rows, int64_t width, int elem_bytes, cudaStream_t s) {
  if (n <= 0 || width <= 0) return cudaSuccess;
  if (elem_bytes != 2 && elem_bytes != 4) return cudaErrorInvalidValue;
  kv_write_kernel<<<blocks_for(size_t(n * width)), k_threads, 0, s>>>(pool, page_stride, comp_offset, slots, n, rows,
                                                                     width, elem_bytes);
  return cudaGetLastError();
}

}  // namespace tandem::cuda_backend
