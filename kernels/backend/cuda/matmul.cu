// The CUDA backend's matmul helpers (kernels.h): the hi/lo split that lets cuBLAS's 16-bit GEMMs
// see f32 activations, and the dequantizing matmul of the ggml block types.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/backend/cuda/kernels.h"

namespace tandem::cuda_backend {
namespace {

constexpr int k_threads = 256;

// ggml type ids (kernels/tensor.h's ggml_type).
constexpr uint32_t t_q4_0 = 2, t_q8_0 = 8, t_q4_K = 12, t_q5_K = 13, t_q6_K = 14;

int blocks_for(size_t n) {
  const size_t b = (n + k_threads - 1) / k_threads;
  return int(b == 0 ? 1 : b < 65536 ? b : 65536);
}

template <bool BF16>
__global__ void split_kernel(const float* x, size_t total, size_t lo, void* xs) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    if constexpr (BF16) {
      const __nv_bfloat16 hi = __float2bfloat16_rn(v);
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(xs);
      o[i] = hi;
      o[lo + i] = __float2bfloat16_rn(v - __bfloat162float(hi));
    } else {
      const __half hi = __float2half_rn(v);
      __half* o = static_cast<__half*>(xs);
      o[i] = hi;
      o[lo + i] = __float2half_rn(v - __half2float(hi));
    }
  }
}

__global__ void join_kernel(const float* t, size_t half_elems, size_t total, float* y) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    y[i] = t[i] + t[half_elems + i];
}

__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(uint16_t(p[0] | p[1] << 8)));
}

// Element e of one block of each type (the layouts of kernels/tensor.h).
template <uint32_t T>
__device__ __forceinline__ float dequant(const uint8_t* b, int e);

template <>
__device__ __forceinline__ float dequant<t_q8_0>(const uint8_t* b, int e) {
  return half_at(b) * float(int8_t(b[2 + e]));
}
template <>
__device__ __forceinline__ float dequant<t_q4_0>(const uint8_t* b, int e) {
  const uint8_t q = b[2 + e % 16];
  return half_at(b) * float((e < 16 ? q & 0xF : q >> 4) - 8);
}

__device__ __forceinline__ void k4_scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// q4_K: {d, dmin, scales[12], qs[128]}; q5_K: {d, dmin, scales[12], qh[32], qs[128]}.
template <bool Q5>
__device__ __forceinline__ float dequant_k4(const uint8_t* b, int e) {
  const float d = half_at(b), dmin = half_at(b + 2);
  int sc, m;
  k4_scale_min(e / 32, b + 4, sc, m);
  const uint8_t* qs = b + 16 + (Q5 ? 32 : 0);
  const int g = e / 64, l = e % 32;
  int q = e % 64 < 32 ? qs[32 * g + l] & 0xF : qs[32 * g + l] >> 4;
  if (Q5 && (b[16 + e % 32] >> (e / 32) & 1)) q += 16;
  return d * float(sc) * float(q) - dmin * float(m);
}
template <>
__device__ __forceinline__ float dequant<t_q4_K>(const uint8_t* b, int e) {
  return dequant_k4<false>(b, e);
}
template <>
__device__ __forceinline__ float dequant<t_q5_K>(const uint8_t* b, int e) {
  return dequant_k4<true>(b, e);
}
// q6_K: {ql[128], qh[64], scales[16] (int8), d}.
template <>
__device__ __forceinline__ float dequant<t_q6_K>(const uint8_t* b, int e) {
  const int h = e / 128, r = e % 128, l = r % 32, k = r / 32;
  const uint8_t lo = b[64 * h + 32 * (k % 2) + l];
  const int low = k < 2 ? lo & 0xF : lo >> 4;
  const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
  return half_at(b + 208) * float(int8_t(b[192 + e / 16])) * float((low | high << 4) - 32);
}

template <uint32_t T>
struct block_info;
template <>
struct block_info<t_q8_0> {
  static constexpr int elems = 32, bytes = 34;
};
template <>
struct block_info<t_q4_0> {
  static constexpr int elems = 32, bytes = 18;
};
template <>
struct block_info<t_q4_K> {
  static constexpr int elems = 256, bytes = 144;
};
template <>
struct block_info<t_q5_K> {
  static constexpr int elems = 256, bytes = 176;
};
template <>
struct block_info<t_q6_K> {
  static constexpr int elems = 256, bytes = 210;
};

constexpr int k_rows_per_block = 8;  // one warp per weight row

// y[b0 + b][row] for b < B: lane handles elements lane, lane + 32, ... of every block, each
// decoded once and used for the B activation rows; then the warp's sum in a fixed tree.
template <uint32_t T, int B>
__global__ void matmul_quant_kernel(const uint8_t* __restrict__ w, const float* __restrict__ x, int64_t b0,
                                    float* __restrict__ y, int64_t n, int64_t k) {
  using I = block_info<T>;
  const int64_t row = int64_t(blockIdx.x) * k_rows_per_block + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  const int64_t nb = k / I::elems;
  const uint8_t* wr = w + size_t(row) * size_t(nb) * I::bytes;
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.0f;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* bp = wr + size_t(blk) * I::bytes;
#pragma unroll
    for (int j = 0; j < I::elems / 32; ++j) {
      const int e = lane + 32 * j;
      const float wv = dequant<T>(bp, e);
      const int64_t col = blk * I::elems + e;
#pragma unroll
      for (int b = 0; b < B; ++b) acc[b] = fmaf(wv, x[size_t(b0 + b) * size_t(k) + size_t(col)], acc[b]);
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float v = acc[b];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) y[size_t(b0 + b) * size_t(n) + size_t(row)] = v;
  }
}

template <uint32_t T, int B>
void launch_quant(const uint8_t* w, const float* x, int64_t b0, float* y, int64_t n, int64_t k, cudaStream_t s) {
  const int64_t blocks = (n + k_rows_per_block - 1) / k_rows_per_block;
  matmul_quant_kernel<T, B><<<unsigned(blocks), 32 * k_rows_per_block, 0, s>>>(w, x, b0, y, n, k);
}

// The batch 8 rows at a time (registers), then the rest with an exact-size kernel: every
// row's arithmetic is the same in each.
template <uint32_t T>
void run_quant(const uint8_t* w, const float* x, int64_t batch, float* y, int64_t n, int64_t k, cudaStream_t s) {
  int64_t b = 0;
  for (; b + 8 <= batch; b += 8) launch_quant<T, 8>(w, x, b, y, n, k, s);
  switch (batch - b) {
    case 7: return launch_quant<T, 7>(w, x, b, y, n, k, s);
    case 6: return launch_quant<T, 6>(w, x, b, y, n, k, s);
    case 5: return launch_quant<T, 5>(w, x, b, y, n, k, s);
    case 4: return launch_quant<T, 4>(w, x, b, y, n, k, s);
    case 3: return launch_quant<T, 3>(w, x, b, y, n, k, s);
    case 2: return launch_quant<T, 2>(w, x, b, y, n, k, s);
    case 1: return launch_quant<T, 1>(w, x, b, y, n, k, s);
    default: return;
  }
}

}  // namespace

cudaError_t split_hi_lo(const float* x, int64_t rows, int64_t k, bool bf16, void* xs, int64_t stride,
                        cudaStream_t s) {
  const size_t total = size_t(rows) * size_t(k), lo = size_t(stride) * size_t(k);
  if (total == 0) return cudaSuccess;
  if (rows > stride) return cudaErrorInvalidValue;
  if (bf16)
    split_kernel<true><<<blocks_for(total), k_threads, 0, s>>>(x, total, lo, xs);
  else
    split_kernel<false><<<blocks_for(total), k_threads, 0, s>>>(x, total, lo, xs);
  return cudaGetLastError();
}

cudaError_t join_hi_lo(const float* t, int64_t rows, int64_t used, int64_t n, float* y, cudaStream_t s) {
  const size_t total = size_t(used) * size_t(n);
  if (total == 0) return cudaSuccess;
  join_kernel<<<blocks_for(total), k_threads, 0, s>>>(t, size_t(rows) * size_t(n), total, y);
  return cudaGetLastError();
}

bool quant_supported(uint32_t type) {
  return type == t_q4_0 || type == t_q8_0 || type == t_q4_K || type == t_q5_K || type == t_q6_K;
}

cudaError_t matmul_quant(uint32_t type, const void* w, const float* x, int64_t batch, float* y, int64_t n, int64_t k,
                         cudaStream_t s) {
  if (batch < 0 || n <= 0 || k <= 0) return cudaErrorInvalidValue;
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  switch (type) {
    case t_q8_0: run_quant<t_q8_0>(wb, x, batch, y, n, k, s); break;
    case t_q4_0: run_quant<t_q4_0>(wb, x, batch, y, n, k, s); break;
    case t_q4_K: run_quant<t_q4_K>(wb, x, batch, y, n, k, s); break;
    case t_q5_K: run_quant<t_q5_K>(wb, x, batch, y, n, k, s); break;
    case t_q6_K: run_quant<t_q6_K>(wb, x, batch, y, n, k, s); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::cuda_backend
