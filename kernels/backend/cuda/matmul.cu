// The CUDA backend's matmul helpers (kernels.h): the hi/lo split that lets cuBLAS's 16-bit GEMMs
// see f32 activations, and the matmul of the ggml block types on int8 activations.
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

// ---- quantized matmul: kernels/cpu/quant_matmul.h's recipe, step for step, so the bits are
// the CPU's: activations to int8 groups, exact integer dot products per weight block, and the
// same floating-point steps in the same order (products rounded before each fma).

// One warp per (activation row, group of `G` values): d = max|x| / 127, q = round-to-even of
// x * 127 / max|x| clamped to [-127, 127], and the sum of every 32 q.
template <int G>
__device__ __forceinline__ void quantize_group(const float* x, int64_t k, int8_t* qs, float* d, int16_t* sums,
                                               int64_t block) {
  const int64_t groups = k / G, b = block / groups, g = block % groups;
  const int lane = threadIdx.x;
  const float* v = x + b * k + g * G;
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < G / 32; ++j) amax = fmaxf(amax, fabsf(v[lane + 32 * j]));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float id = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
  if (lane == 0) d[b * groups + g] = __fdiv_rn(amax, 127.0f);
  int8_t* q = qs + b * k + g * G;
#pragma unroll
  for (int j = 0; j < G / 32; ++j) {
    const float r = __fsub_rn(__fadd_rn(__fmul_rn(v[lane + 32 * j], id), 12582912.0f), 12582912.0f);
    const int qi = r >= 127.0f ? 127 : r <= -127.0f ? -127 : r == r ? int(r) : 0;
    q[lane + 32 * j] = int8_t(qi);
    int s = qi;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sums[b * (k / 32) + g * (G / 32) + j] = int16_t(s);
  }
}

template <int G>
__global__ void quantize_acts_kernel(const float* x, int64_t k, int8_t* qs, float* d, int16_t* sums) {
  quantize_group<G>(x, k, qs, d, sums, blockIdx.x);
}

// The entry of a grouped launch's table holding work item `item` (entries sorted by `first`).
template <class E>
__device__ __forceinline__ int find_entry(const E* e, int n, int64_t item) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (e[mid].first <= item) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// quantize_acts of every input of a grouped launch: block b is block b - first of its input.
template <int G>
__global__ void quantize_grouped_kernel(const quant_input* in, int n_inputs) {
  const quant_input I = in[find_entry(in, n_inputs, blockIdx.x)];
  quantize_group<G>(I.x, I.k, I.qs, I.d, I.sums, int64_t(blockIdx.x) - I.first);
}

__device__ __forceinline__ int warp_isum(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// q4_0: per block acc = fma(d dx, s, acc), s = sum of (q - 8) x over the block (thread t holds
// element t; the warp's sum is exact in any order); every lane keeps the same acc.
__device__ float dot_q4_0(const uint8_t* w, const int8_t* x, const float* dx, int64_t nb, int t) {
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * 18;
    const int q = (t < 16 ? b[2 + t] & 0xF : b[2 + t - 16] >> 4) - 8;
    const int s = warp_isum(q * int(x[32 * i + t]));
    acc = fmaf(__fmul_rn(half_at(b), dx[i]), float(s), acc);
  }
  return acc;
}

// q8_0: 16 float lanes (threads 0-15), lane 8 (i % 2) + l of block i gets
// fma(d * dx, s_l, lane), s_l the integer dot of elements 4l .. 4l + 3; then tree16.
template <bool Q8>
__device__ float dot_32(const uint8_t* w, const int8_t* x, const float* dx, int64_t nb, int t) {
  constexpr int bytes = Q8 ? 34 : 18;
  float lane = 0.0f;
  for (int64_t i = 0; i < nb; i += 2) {
    const int64_t blk = i + (t & 15) / 8;
    if (t < 16 && blk < nb) {
      const uint8_t* b = w + blk * bytes;
      const int l = t & 7;
      int s = 0;
#pragma unroll
      for (int e = 4 * l; e < 4 * l + 4; ++e) {
        const int q = Q8 ? int(int8_t(b[2 + e])) : (e < 16 ? b[2 + e] & 0xF : b[2 + e - 16] >> 4) - 8;
        s += q * int(x[32 * blk + e]);
      }
      lane = fmaf(__fmul_rn(half_at(b), dx[blk]), float(s), lane);
    }
  }
  // tree16: t8[i] = a[i] + a[i + 8], t4[i] = t8[i] + t8[i + 4], (t4[0] + t4[2]) + (t4[1] + t4[3]).
  const float t8 = __fadd_rn(lane, __shfl_down_sync(0xffffffffu, lane, 8));
  const float t4 = __fadd_rn(t8, __shfl_down_sync(0xffffffffu, t8, 4));
  const float a0 = __shfl_sync(0xffffffffu, t4, 0), a1 = __shfl_sync(0xffffffffu, t4, 1),
              a2 = __shfl_sync(0xffffffffu, t4, 2), a3 = __shfl_sync(0xffffffffu, t4, 3);
  return __fadd_rn(__fadd_rn(a0, a2), __fadd_rn(a1, a3));
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

// q4_K / q5_K: per block acc = fma(d dx, isum, acc); acc = fma(-(dmin dx), msum, acc) with the
// integer sums over the warp (exact in any order); every lane keeps the same acc.
template <bool Q5>
__device__ float dot_k4(const uint8_t* w, const int8_t* x, const float* dx, const int16_t* sums, int64_t nb, int t) {
  constexpr int bytes = Q5 ? 176 : 144;
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * bytes;
    const uint8_t* qs = b + 16 + (Q5 ? 32 : 0);
    int isum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      k4_scale_min(j, b + 4, sc, m);
      const int e = 32 * j + t, g = e / 64;
      int q = e % 64 < 32 ? qs[32 * g + t] & 0xF : qs[32 * g + t] >> 4;
      if (Q5) q += ((b[16 + t] >> j) & 1) << 4;
      isum += sc * q * int(x[256 * i + e]);
    }
    int msum = 0;
    if (t < 8) {
      int sc, m;
      k4_scale_min(t, b + 4, sc, m);
      msum = m * int(sums[8 * i + t]);
    }
    isum = warp_isum(isum);
    msum = warp_isum(msum);
    acc = fmaf(__fmul_rn(half_at(b), dx[i]), float(isum), acc);
    acc = fmaf(-__fmul_rn(half_at(b + 2), dx[i]), float(msum), acc);
  }
  return acc;
}

// q6_K: per block acc = fma(d dx, isum, acc), isum = sum_j sc_j sum (q - 32) x.
__device__ float dot_q6_K(const uint8_t* w, const int8_t* x, const float* dx, int64_t nb, int t) {
  float acc = 0.0f;
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = w + i * 210;
    int isum = 0;
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int e = t + 32 * m, h = e / 128, r = e % 128, l = r % 32, kk = r / 32;
      const uint8_t lo = b[64 * h + 32 * (kk % 2) + l];
      const int q = ((kk < 2 ? lo & 0xF : lo >> 4) | ((b[128 + 32 * h + l] >> (2 * kk)) & 3) << 4) - 32;
      isum += int(int8_t(b[192 + e / 16])) * q * int(x[256 * i + e]);
    }
    isum = warp_isum(isum);
    acc = fmaf(__fmul_rn(half_at(b + 208), dx[i]), float(isum), acc);
  }
  return acc;
}

// ggml type ids -> block bytes and elements.
__host__ __device__ constexpr int block_bytes(uint32_t t) {
  return t == t_q8_0 ? 34 : t == t_q4_0 ? 18 : t == t_q4_K ? 144 : t == t_q5_K ? 176 : 210;
}
__host__ __device__ constexpr int block_elems(uint32_t t) { return t == t_q8_0 || t == t_q4_0 ? 32 : 256; }

constexpr int k_warps_per_block = 8;

// One warp per (weight row, activation row): y[b][row] for work item row + n b.
template <uint32_t T>
__device__ __forceinline__ void quant_item(const uint8_t* __restrict__ w, const int8_t* __restrict__ qs,
                                           const float* __restrict__ d, const int16_t* __restrict__ sums,
                                           float* __restrict__ y, int64_t n, int64_t k, int64_t item) {
  const int64_t row = item % n, b = item / n;
  const int t = threadIdx.x & 31;
  const int64_t nb = k / block_elems(T);
  const uint8_t* wr = w + row * nb * block_bytes(T);
  const int8_t* x = qs + b * k;
  const float* dx = d + b * (k / block_elems(T));
  float v;
  if constexpr (T == t_q8_0)
    v = dot_32<true>(wr, x, dx, nb, t);
  else if constexpr (T == t_q4_0)
    v = dot_q4_0(wr, x, dx, nb, t);
  else if constexpr (T == t_q6_K)
    v = dot_q6_K(wr, x, dx, nb, t);
  else
    v = dot_k4<T == t_q5_K>(wr, x, dx, sums + b * (k / 32), nb, t);
  if (t == 0) y[b * n + row] = v;
}

template <uint32_t T>
__global__ void quant_matmul_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ qs,
                                    const float* __restrict__ d, const int16_t* __restrict__ sums, int64_t batch,
                                    float* __restrict__ y, int64_t n, int64_t k) {
  const int64_t item = int64_t(blockIdx.x) * k_warps_per_block + (threadIdx.x >> 5);
  if (item >= n * batch) return;
  quant_item<T>(w, qs, d, sums, y, n, k, item);
}

// Every task of a grouped launch (one weight type): warp item - first of its task.
template <uint32_t T>
__global__ void quant_grouped_kernel(const quant_task* __restrict__ tasks, int n_tasks, int64_t total) {
  const int64_t item = int64_t(blockIdx.x) * k_warps_per_block + (threadIdx.x >> 5);
  if (item >= total) return;
  const quant_task& q = tasks[find_entry(tasks, n_tasks, item)];
  quant_item<T>(static_cast<const uint8_t*>(q.w), q.qs, q.d, q.sums, q.y, q.n, q.k, item - q.first);
}

template <uint32_t T>
void run_quant(const uint8_t* w, const int8_t* qs, const float* d, const int16_t* sums, int64_t batch, float* y,
               int64_t n, int64_t k, cudaStream_t s) {
  const int64_t blocks = (n * batch + k_warps_per_block - 1) / k_warps_per_block;
  quant_matmul_kernel<T><<<unsigned(blocks), 32 * k_warps_per_block, 0, s>>>(w, qs, d, sums, batch, y, n, k);
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

int quant_group(uint32_t type) { return block_elems(type); }

cudaError_t quantize_acts(const float* x, int64_t batch, int64_t k, int group, int8_t* qs, float* d, int16_t* sums,
                          cudaStream_t s) {
  if (batch <= 0) return cudaSuccess;
  if ((group != 32 && group != 256) || k % group != 0) return cudaErrorInvalidValue;
  const int64_t blocks = batch * (k / group);
  if (group == 32)
    quantize_acts_kernel<32><<<unsigned(blocks), 32, 0, s>>>(x, k, qs, d, sums);
  else
    quantize_acts_kernel<256><<<unsigned(blocks), 32, 0, s>>>(x, k, qs, d, sums);
  return cudaGetLastError();
}

cudaError_t matmul_quant(uint32_t type, const void* w, const int8_t* qs, const float* d, const int16_t* sums,
                         int64_t batch, float* y, int64_t n, int64_t k, cudaStream_t s) {
  if (batch < 0 || n <= 0 || k <= 0 || k % block_elems(type) != 0) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  switch (type) {
    case t_q8_0: run_quant<t_q8_0>(wb, qs, d, sums, batch, y, n, k, s); break;
    case t_q4_0: run_quant<t_q4_0>(wb, qs, d, sums, batch, y, n, k, s); break;
    case t_q4_K: run_quant<t_q4_K>(wb, qs, d, sums, batch, y, n, k, s); break;
    case t_q5_K: run_quant<t_q5_K>(wb, qs, d, sums, batch, y, n, k, s); break;
    case t_q6_K: run_quant<t_q6_K>(wb, qs, d, sums, batch, y, n, k, s); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t quantize_acts_grouped(const quant_input* inputs, int n_inputs, int64_t total_blocks, int group,
                                  cudaStream_t s) {
  if (n_inputs <= 0 || total_blocks <= 0) return cudaSuccess;
  if ((group != 32 && group != 256) || total_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  if (group == 32)
    quantize_grouped_kernel<32><<<unsigned(total_blocks), 32, 0, s>>>(inputs, n_inputs);
  else
    quantize_grouped_kernel<256><<<unsigned(total_blocks), 32, 0, s>>>(inputs, n_inputs);
  return cudaGetLastError();
}

cudaError_t matmul_quant_grouped(uint32_t type, const quant_task* tasks, int n_tasks, int64_t total_items,
                                 cudaStream_t s) {
  if (n_tasks <= 0 || total_items <= 0) return cudaSuccess;
  const int64_t blocks = (total_items + k_warps_per_block - 1) / k_warps_per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const unsigned g = unsigned(blocks), th = 32 * k_warps_per_block;
  switch (type) {
    case t_q8_0: quant_grouped_kernel<t_q8_0><<<g, th, 0, s>>>(tasks, n_tasks, total_items); break;
    case t_q4_0: quant_grouped_kernel<t_q4_0><<<g, th, 0, s>>>(tasks, n_tasks, total_items); break;
    case t_q4_K: quant_grouped_kernel<t_q4_K><<<g, th, 0, s>>>(tasks, n_tasks, total_items); break;
    case t_q5_K: quant_grouped_kernel<t_q5_K><<<g, th, 0, s>>>(tasks, n_tasks, total_items); break;
    case t_q6_K: quant_grouped_kernel<t_q6_K><<<g, th, 0, s>>>(tasks, n_tasks, total_items); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::cuda_backend
