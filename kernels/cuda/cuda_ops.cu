// CUDA versions of the CPU kernels. Simple, bandwidth-oriented: one block per row, warp
// reductions, 16-byte vector copies for pages.
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_ops.h"

namespace tandem::cuda {
namespace {

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void rms_norm_kernel(const float* x, const float* w, float* y, int n, float eps) {
  const float* xr = x + size_t(blockIdx.x) * n;
  float* yr = y + size_t(blockIdx.x) * n;
  float acc = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += xr[i] * xr[i];
  __shared__ float partial[32];
  acc = warp_sum(acc);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  const float scale = rsqrtf(partial[0] / n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

__global__ void rope_kernel(float* x, const int32_t* pos, int n_heads, int head_dim, float freq_base) {
  const int row = blockIdx.x;
  const int half = head_dim / 2;
  float* xr = x + size_t(row) * n_heads * head_dim;
  for (int j = threadIdx.x; j < n_heads * half; j += blockDim.x) {
    const int h = j / half, i = j % half;
    const float theta = float(pos[row]) * powf(freq_base, -2.0f * i / head_dim);
    float c, s;
    sincosf(theta, &s, &c);
    float* p = xr + h * head_dim + 2 * i;
    const float a = p[0], b = p[1];
    p[0] = a * c - b * s;
    p[1] = a * s + b * c;
  }
}

__global__ void swiglu_kernel(const float* g, const float* u, float* o, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float v = g[i];
    o[i] = v / (1.f + __expf(-v)) * u[i];
  }
}

__global__ void copy_pages_kernel(const uint8_t* src, const int32_t* src_ids, uint8_t* dst, const int32_t* dst_ids,
                                  size_t page_bytes) {
  const uint8_t* s = src + size_t(src_ids[blockIdx.y]) * page_bytes;
  uint8_t* d = dst + size_t(dst_ids[blockIdx.y]) * page_bytes;
  const size_t n16 = page_bytes / 16;
  const uint4* s4 = reinterpret_cast<const uint4*>(s);
  uint4* d4 = reinterpret_cast<uint4*>(d);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x)
    d4[i] = s4[i];
  for (size_t i = n16 * 16 + blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < page_bytes;
       i += size_t(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s) {
  rms_norm_kernel<<<rows, 256, 0, s>>>(x, w, y, n, eps);
}

void rope(float* x, const int32_t* pos, int rows, int n_heads, int head_dim, float freq_base, cudaStream_t s) {
  rope_kernel<<<rows, 128, 0, s>>>(x, pos, n_heads, head_dim, freq_base);
}

void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t s) {
  const int blocks = int((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
  swiglu_kernel<<<blocks > 0 ? blocks : 1, 256, 0, s>>>(gate, up, out, n);
}

void copy_pages(const uint8_t* src, const int32_t* src_ids, uint8_t* dst, const int32_t* dst_ids, int n,
                size_t page_bytes, cudaStream_t s) {
  if (n <= 0) return;
  // Page pointers must be 16-byte aligned for the vector path (pool pages are).
  const int per_page = int((page_bytes / 16 + 255) / 256 < 64 ? (page_bytes / 16 + 255) / 256 : 64);
  dim3 grid(per_page > 0 ? per_page : 1, n);
  copy_pages_kernel<<<grid, 256, 0, s>>>(src, src_ids, dst, dst_ids, page_bytes);
}

}  // namespace tandem::cuda
