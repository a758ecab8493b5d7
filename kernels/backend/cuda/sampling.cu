// Device sampling (sampling.h): one block per row. The draw follows kernels/model/sampler.cpp
// step for step where the order matters (the same products, divisions and exp inputs, the
// same walk order, ties to the lowest id); sums run in double over per-thread chunks, so a
// cumulative sum may differ from the host's sequential one in the last bits of a double, and
// expf from the host's std::exp in the last bit of a float: the same token whenever the
// uniform number is not within that of a boundary between two tokens.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>
#include <cuda_runtime.h>

#include <climits>

#include "kernels/backend/cuda/sampling.h"

namespace tandem::cuda_backend {
namespace {

constexpr int k_threads = 512;

__device__ __forceinline__ int64_t lmin(int64_t a, int64_t b) { return a < b ? a : b; }

struct best {
  float v;
  int i;
};

// (v, i) ranks before (w, j) when v is larger, or equal with a lower id; NaN never ranks.
__device__ __forceinline__ bool before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// The block's first maximum of the values for which `ok(v, i)` holds ({-inf, INT_MAX} if none).
template <class F, class Ok>
__device__ best block_best(F value, Ok ok, int64_t n) {
  __shared__ float sv[k_threads / 32];
  __shared__ int si[k_threads / 32];
  best b{-INFINITY, INT_MAX};
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = value(i);
    if (v != v || !ok(v, int(i))) continue;
    if (before(v, int(i), b.v, b.i) || b.i == INT_MAX) b = best{v, int(i)};
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int i = __shfl_xor_sync(0xffffffffu, b.i, o);
    if (i != INT_MAX && (b.i == INT_MAX || before(v, i, b.v, b.i))) b = best{v, i};
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // the shared slots may still be read by a previous call
  if (lane == 0) sv[warp] = b.v, si[warp] = b.i;
  __syncthreads();
  best r{-INFINITY, INT_MAX};
  for (int w = 0; w < int(blockDim.x >> 5); ++w)
    if (si[w] != INT_MAX && (r.i == INT_MAX || before(sv[w], si[w], r.v, r.i))) r = best{sv[w], si[w]};
  return r;
}

__device__ int block_min_int(int v) {
  __shared__ int s[k_threads / 32];
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = INT_MAX;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r = min(r, s[w]);
  return r;
}

__device__ double block_sum_double(double v) {
  __shared__ double s[k_threads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  double r = 0.0;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r += s[w];
  return r;
}

using scan_t = cub::BlockScan<double, k_threads>;

// Prefix sums of f over [0, n) in chunks: thread t owns [t c, (t + 1) c) and gets the sum of
// the chunks before it (`before`) and the total.
struct chunks {
  int64_t c = 0, lo = 0, hi = 0;
  double before = 0.0, total = 0.0;
};

template <class F>
__device__ chunks chunk_prefix(F f, int64_t n, typename scan_t::TempStorage& tmp) {
  chunks k;
  k.c = (n + k_threads - 1) / k_threads;
  k.lo = lmin(n, int64_t(threadIdx.x) * k.c);
  k.hi = lmin(n, k.lo + k.c);
  double local = 0.0;
  for (int64_t i = k.lo; i < k.hi; ++i) local += double(f(i));
  __syncthreads();
  scan_t(tmp).ExclusiveSum(local, k.before, k.total);
  __syncthreads();
  return k;
}

// The first i < n whose inclusive prefix sum passes `target` (> when strict, else >=), INT_MAX if none.
template <class F>
__device__ int first_past(F f, const chunks& k, int64_t n, double target, bool strict) {
  int found = INT_MAX;
  double cum = k.before;
  for (int64_t i = k.lo; i < lmin(k.hi, n); ++i) {
    cum += double(f(i));
    if (strict ? target < cum : cum >= target) {
      found = int(i);
      break;
    }
  }
  return block_min_int(found);
}

__global__ void __launch_bounds__(k_threads)
    draw_kernel(const float* __restrict__ logits, int64_t V, const sample_desc* __restrict__ descs,
                const float* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_ids, sample_out* out) {
  __shared__ scan_t::TempStorage tmp;
  __shared__ double shared_cum;
  const int64_t r = blockIdx.x;
  const sample_desc D = descs[r];
  const float* x = logits + r * V;
  const auto all = [](float, int) { return true; };
  int token;
  if (D.temperature == 0.0f || D.top_k == 1) {
    // cpu::argmax: a NaN at 0 wins (nothing compares larger), else the first largest.
    token = x[0] != x[0] ? 0 : block_best([&](int64_t i) { return x[i]; }, all, V).i;
    if (token == INT_MAX) token = 0;
  } else if (D.sorted < 0) {
    // The whole distribution in id order: p_i = exp(l_i / T - max / T) with the sampler's
    // float steps (no fused multiply-add), zeros skipped, the last positive one if u is past
    // the total by rounding.
    const float inv_t = __fdiv_rn(1.0f, D.temperature);
    const best m = block_best([&](int64_t i) { return x[i]; }, all, V);
    const float mx = __fmul_rn(x[m.i == INT_MAX ? 0 : m.i], inv_t);
    const auto p = [&](int64_t i) { return expf(__fsub_rn(__fmul_rn(x[i], inv_t), mx)); };
    const chunks k = chunk_prefix(p, V, tmp);
    token = first_past(p, k, V, D.uniform * k.total, true);
    if (token == INT_MAX) {
      // The last positive probability: the highest id with p > 0.
      const best last = block_best([&](int64_t i) { return p(i) > 0.0f ? float(i) : -INFINITY; },
                                   [](float v, int) { return v > -INFINITY; }, V);
      token = last.i == INT_MAX ? 0 : int(last.v);
    }
  } else {
    // Highest first (sorted), top_k kept, softmax over them, then the top_p cut.
    const float* keys = sorted_keys + int64_t(D.sorted) * V;
    const int32_t* ids = sorted_ids + int64_t(D.sorted) * V;
    int64_t keep = D.top_k > 0 && D.top_k < V ? D.top_k : V;
    const float mx = keys[0];
    const auto e = [&](int64_t i) { return expf(__fsub_rn(keys[i], mx)); };
    const chunks k = chunk_prefix(e, keep, tmp);
    double sum = k.total;
    if (D.top_p < 1.0f) {
      // The sampler stops at the first i where sum_{j <= i} e_j / sum >= top_p.
      const int cut = first_past(e, k, keep, double(D.top_p) * k.total, false);
      if (cut != INT_MAX) {
        keep = cut + 1;
        if (threadIdx.x == 0) shared_cum = 0.0;
        __syncthreads();
        // The sum of the kept ones: the inclusive prefix at the cut, from the thread owning it.
        if (k.lo <= cut && cut < k.hi) {
          double cum = k.before;
          for (int64_t i = k.lo; i <= cut; ++i) cum += double(e(i));
          shared_cum = cum;
        }
        __syncthreads();
        sum = shared_cum;
      }
    }
    const int at = first_past(e, k, keep, D.uniform * sum, true);
    token = ids[at == INT_MAX ? keep - 1 : at];
  }
  if (threadIdx.x == 0) {
    out[r].token = token;
    out[r].logprob = 0.0f;
    out[r].n_top = 0;
  }
}

__device__ double block_max_double(double v) {
  __shared__ double s[k_threads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
  __syncthreads();
  double r = -INFINITY;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) r = fmax(r, s[w]);
  return r;
}

__global__ void __launch_bounds__(k_threads)
    logprobs_kernel(const float* __restrict__ logits, int64_t V, const sample_desc* __restrict__ descs,
                    sample_out* out) {
  const int64_t r = blockIdx.x;
  const sample_desc D = descs[r];
  if (D.top_n < 0) return;
  const float* x = logits + r * V;
  // compute_logprobs: log-sum-exp in double around the maximum of l / T.
  const double inv_t = D.temperature > 0.0f ? 1.0 / double(D.temperature) : 1.0;
  double mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) mx = fmax(mx, double(x[i]) * inv_t);
  mx = block_max_double(mx);
  double sum = 0.0;
  if (isfinite(mx))
    for (int64_t i = threadIdx.x; i < V; i += blockDim.x) sum += exp(double(x[i]) * inv_t - mx);
  sum = block_sum_double(sum);
  const double lse = mx + log(sum);
  const int chosen = out[r].token;
  const int k = int(lmin(lmin(int64_t(D.top_n), int64_t(k_max_top_logprobs)), V));
  float pv = INFINITY;
  int pi = -1;
  for (int j = 0; j < k; ++j) {
    // The next after (pv, pi) in the order highest first, ties by lowest id.
    const best b = block_best([&](int64_t i) { return x[i]; },
                              [&](float v, int i) { return v < pv || (v == pv && i > pi); }, V);
    if (b.i == INT_MAX) break;
    if (threadIdx.x == 0) {
      out[r].top_ids[j] = b.i;
      out[r].top_logprobs[j] = float(double(b.v) * inv_t - lse);
      out[r].n_top = j + 1;
    }
    pv = b.v;
    pi = b.i;
  }
  if (threadIdx.x == 0 && chosen >= 0 && chosen < V) out[r].logprob = float(double(x[chosen]) * inv_t - lse);
}

__global__ void sort_keys_kernel(const float* logits, int64_t V, const sample_desc* descs, const int32_t* rows,
                                 int64_t n_sorted, float* keys, int32_t* ids) {
  const size_t total = size_t(n_sorted) * size_t(V);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const size_t j = i / size_t(V), e = i % size_t(V);
    const int32_t r = rows[j];
    keys[i] = __fdiv_rn(logits[size_t(r) * size_t(V) + e], descs[r].temperature);
    ids[i] = int32_t(e);
  }
}

}  // namespace

cudaError_t sort_keys(const float* logits, int64_t n_vocab, const sample_desc* descs, const int32_t* rows,
                      int64_t n_sorted, float* keys, int32_t* ids, cudaStream_t s) {
  if (n_sorted <= 0) return cudaSuccess;
  const size_t total = size_t(n_sorted) * size_t(n_vocab);
  const size_t blocks = (total + 255) / 256;
  sort_keys_kernel<<<unsigned(blocks < 65536 ? blocks : 65536), 256, 0, s>>>(logits, n_vocab, descs, rows, n_sorted,
                                                                              keys, ids);
  return cudaGetLastError();
}

size_t sort_scratch_bytes(int64_t n_sorted, int64_t n_vocab) {
  size_t bytes = 0;
  cub::DeviceSegmentedRadixSort::SortPairsDescending(nullptr, bytes, static_cast<const float*>(nullptr),
                                                     static_cast<float*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr),
                                                     static_cast<int32_t*>(nullptr), int(n_sorted * n_vocab),
                                                     int(n_sorted), static_cast<const int32_t*>(nullptr),
                                                     static_cast<const int32_t*>(nullptr));
  return bytes;
}

cudaError_t sort_rows_desc(void* scratch, size_t scratch_bytes, const float* keys_in, float* keys_out,
                           const int32_t* ids_in, int32_t* ids_out, int64_t n_sorted, int64_t n_vocab,
                           const int32_t* offsets, cudaStream_t s) {
  if (n_sorted <= 0) return cudaSuccess;
  if (n_sorted * n_vocab > INT_MAX) return cudaErrorInvalidValue;
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(scratch, scratch_bytes, keys_in, keys_out, ids_in, ids_out,
                                                            int(n_sorted * n_vocab), int(n_sorted), offsets,
                                                            offsets + 1, 0, int(sizeof(float) * 8), s);
}

cudaError_t draw_tokens(const float* logits, int64_t n_vocab, const sample_desc* descs, int64_t rows,
                        const float* sorted_keys, const int32_t* sorted_ids, sample_out* out, cudaStream_t s) {
  if (rows <= 0) return cudaSuccess;
  if (n_vocab <= 0 || n_vocab > INT_MAX || rows > INT_MAX) return cudaErrorInvalidValue;
  draw_kernel<<<unsigned(rows), k_threads, 0, s>>>(logits, n_vocab, descs, sorted_keys, sorted_ids, out);
  return cudaGetLastError();
}

cudaError_t token_logprobs(const float* logits, int64_t n_vocab, const sample_desc* descs, int64_t rows,
                           sample_out* out, cudaStream_t s) {
  if (rows <= 0) return cudaSuccess;
  if (n_vocab <= 0 || n_vocab > INT_MAX || rows > INT_MAX) return cudaErrorInvalidValue;
  logprobs_kernel<<<unsigned(rows), k_threads, 0, s>>>(logits, n_vocab, descs, out);
  return cudaGetLastError();
}

}  // namespace tandem::cuda_backend
