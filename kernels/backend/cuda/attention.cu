// The CUDA backend's paged attention (kernels.h): every (query row, head) of a call, prefill
// chunks and decode rows alike, over the standard K/V pool or the MLA latent pool. One block of
// k_warps warps per (row, head); warp w takes positions lo + w, lo + w + k_warps, ..., k_unroll
// of them per step with all their K loads in flight together, and keeps its own online-softmax
// state (max, sum, the weighted V sum with element lane + 32 j in register j); the warps merge at
// the end. A row's arithmetic depends only on its own query and positions.
//
// Split context (split_softmax.h): a row of more than k_split_positions positions is cut into
// chunks of that many, one block each (grid z); each leaves its partial (max, sum, unnormalised
// V sum) and merge_kernel combines them. Rows of one chunk are computed as before, in one block.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/backend/cuda/kernels.h"
#include "kernels/backend/cuda/split_softmax.h"

namespace tandem::cuda_backend {
namespace {

constexpr int k_warps = 4;
constexpr int k_unroll = 4;
constexpr int k_max_dim = 1024;

__device__ __forceinline__ float load(const float* p, int i) { return __ldg(p + i); }
__device__ __forceinline__ float load(const __half* p, int i) { return __half2float(p[i]); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// J: elements per lane (dk <= 32 J).
template <class E, int J>
__global__ void __launch_bounds__(32 * k_warps)
    attention_kernel(const attn_row* __restrict__ rows, const int32_t* __restrict__ tables, attn_shape sh,
                     float* __restrict__ partials) {
  const attn_row R = rows[blockIdx.x];
  const int h = blockIdx.y;
  const int split = blockIdx.z, n_splits = split_count(R.lo, R.pos);
  if (split >= n_splits) return;
  const int first = split_first(R.lo, split), last = split_last(R.lo, R.pos, split);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kvh = h / (sh.n_heads / sh.n_kv);
  const float* qh = R.q + size_t(h) * sh.q_split;
  const float* qp = R.q_pe + size_t(h) * (sh.dk - sh.q_split);
  const int32_t* table = tables + R.table;
  float qv[J], acc[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    qv[j] = e < sh.q_split ? qh[e] : e < sh.dk ? qp[e - sh.q_split] : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const size_t row_bytes = size_t(sh.dk) * sh.elem_bytes;
  for (int base = first + warp; base <= last; base += k_warps * k_unroll) {
    const E* krow[k_unroll];
    float sc[k_unroll];
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      const int p = base + u * k_warps;
      krow[u] = nullptr;
      if (p <= last) {
        const uint8_t* page = sh.pool + size_t(table[p / sh.page_size]) * sh.page_stride;
        krow[u] = reinterpret_cast<const E*>(page + sh.k_offset +
                                             (size_t(p % sh.page_size) * sh.n_kv + kvh) * row_bytes);
      }
    }
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      float d = 0.0f;
      if (krow[u] != nullptr) {
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int e = lane + 32 * j;
          if (e < sh.dk) d = fmaf(qv[j], load(krow[u], e), d);
        }
      }
      d = warp_sum(d) * sh.scale;
      if (sh.softcap > 0.0f) d = sh.softcap * tanhf(d * (1.0f / sh.softcap));
      sc[u] = krow[u] != nullptr ? d : -INFINITY;
    }
    float mx = m;
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) mx = fmaxf(mx, sc[u]);
    const float corr = __expf(m - mx);  // m = -inf at first: corr 0, nothing to scale
    l *= corr;
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j] *= corr;
#pragma unroll
    for (int u = 0; u < k_unroll; ++u) {
      if (krow[u] == nullptr) continue;
      const float w = __expf(sc[u] - mx);
      l += w;
      const E* vrow = reinterpret_cast<const E*>(reinterpret_cast<const uint8_t*>(krow[u]) - sh.k_offset +
                                                 sh.v_offset);
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int e = lane + 32 * j;
        if (e < sh.dv) acc[j] = fmaf(w, load(vrow, e), acc[j]);
      }
    }
    m = mx;
  }
  __shared__ float sm[k_warps], sl[k_warps];
  __shared__ float sacc[k_warps][k_max_dim];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    if (e < sh.dv) sacc[warp][e] = acc[j];
  }
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int w = 0; w < k_warps; ++w) M = fmaxf(M, sm[w]);
  float L = 0.0f;
#pragma unroll
  for (int w = 0; w < k_warps; ++w) L += sm[w] == -INFINITY ? 0.0f : sl[w] * __expf(sm[w] - M);
  if (n_splits > 1) {
    // This chunk's partial: its maximum, its sum and the V sum scaled to that maximum.
    float* part = partials + (size_t(R.split_base + split) * sh.n_heads + h) * size_t(partial_floats(sh.dv));
    if (threadIdx.x == 0) {
      part[0] = M;
      part[1] = L;
    }
    for (int e = threadIdx.x; e < sh.dv; e += blockDim.x) {
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < k_warps; ++w)
        if (sm[w] != -INFINITY) o += sacc[w][e] * __expf(sm[w] - M);
      part[2 + e] = o;
    }
    return;
  }
  float* oh = R.out + size_t(h) * sh.dv;
  for (int e = threadIdx.x; e < sh.dv; e += blockDim.x) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < k_warps; ++w)
      if (sm[w] != -INFINITY) o += sacc[w][e] * __expf(sm[w] - M);
    oh[e] = L > 0.0f ? o / L : 0.0f;
  }
}

// One block per (row, head) of split rows: the partials rescaled to their common maximum.
__global__ void merge_kernel(const attn_row* __restrict__ rows, int dv, int n_heads, const float* __restrict__ partials) {
  const attn_row R = rows[blockIdx.x];
  const int n = split_count(R.lo, R.pos);
  if (n <= 1) return;
  const int h = blockIdx.y;
  const int stride = n_heads * partial_floats(dv);
  const float* m = partials + (size_t(R.split_base) * n_heads + h) * size_t(partial_floats(dv));
  const float M = merged_max(m, n, stride);
  const float L = merged_sum(m, m + 1, n, stride, M);
  float* oh = R.out + size_t(h) * dv;
  for (int e = threadIdx.x; e < dv; e += blockDim.x) oh[e] = merged_elem(m, m + 2 + e, n, stride, M, L);
}

template <class E, int J>
void launch(const attn_row* rows, int64_t n_rows, const int32_t* tables, const attn_shape& sh, int max_splits,
            float* partials, cudaStream_t s) {
  // gridDim.x allows 2^31 - 1 rows; the heads go in y and the splits in z (at most 65535 each).
  attention_kernel<E, J><<<dim3(unsigned(n_rows), unsigned(sh.n_heads), unsigned(max_splits)), 32 * k_warps, 0, s>>>(
      rows, tables, sh, partials);
}

template <class E>
void launch_dim(const attn_row* rows, int64_t n_rows, const int32_t* tables, const attn_shape& sh, int max_splits,
                float* partials, cudaStream_t s) {
  if (sh.dk <= 64) return launch<E, 2>(rows, n_rows, tables, sh, max_splits, partials, s);
  if (sh.dk <= 128) return launch<E, 4>(rows, n_rows, tables, sh, max_splits, partials, s);
  if (sh.dk <= 256) return launch<E, 8>(rows, n_rows, tables, sh, max_splits, partials, s);
  if (sh.dk <= 576) return launch<E, 18>(rows, n_rows, tables, sh, max_splits, partials, s);
  return launch<E, 32>(rows, n_rows, tables, sh, max_splits, partials, s);
}

}  // namespace

cudaError_t paged_attention(const attn_row* rows, int64_t n_rows, const int32_t* tables, const attn_shape& sh,
                            int max_splits, float* partials, cudaStream_t s) {
  if (n_rows < 0 || n_rows > 0x7fffffff || sh.n_kv <= 0 || sh.n_heads <= 0 || sh.n_heads > 65535 ||
      sh.n_heads % sh.n_kv != 0 || sh.dk <= 0 || sh.dk > k_max_dim || sh.dv <= 0 || sh.dv > sh.dk ||
      sh.page_size <= 0 || sh.q_split <= 0 || sh.q_split > sh.dk || (sh.elem_bytes != 2 && sh.elem_bytes != 4) ||
      max_splits < 1 || max_splits > 65535 || (max_splits > 1 && partials == nullptr))
    return cudaErrorInvalidValue;
  if (n_rows == 0) return cudaSuccess;
  if (sh.elem_bytes == 2)
    launch_dim<__half>(rows, n_rows, tables, sh, max_splits, partials, s);
  else
    launch_dim<float>(rows, n_rows, tables, sh, max_splits, partials, s);
  if (max_splits > 1) merge_kernel<<<dim3(unsigned(n_rows), unsigned(sh.n_heads)), 128, 0, s>>>(rows, sh.dv, sh.n_heads,
                                                                                                partials);
  return cudaGetLastError();
}

}  // namespace tandem::cuda_backend
