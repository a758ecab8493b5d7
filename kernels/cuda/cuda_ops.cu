// CUDA versions of the CPU kernels. Simple, bandwidth-oriented: one block per row, warp
// reductions, 16-byte vector copies for pages.
#include <cuda_fp16.h>
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

// Page `first + blockIdx.y` of the list (a grid has at most 65535 rows of blocks, so longer
// lists take several launches). 16-byte vector copies where every page is 16-byte aligned
// (`vec`), else bytes.
__global__ void copy_pages_kernel(const uint8_t* src, const int32_t* src_ids, uint8_t* dst, const int32_t* dst_ids,
                                  size_t page_bytes, int first, bool vec) {
  // A null id list means "page i" (a contiguous staging area).
  const int i = first + int(blockIdx.y);
  const uint8_t* s = src + size_t(src_ids ? src_ids[i] : i) * page_bytes;
  uint8_t* d = dst + size_t(dst_ids ? dst_ids[i] : i) * page_bytes;
  const size_t n16 = vec ? page_bytes / 16 : 0;
  const uint4* s4 = reinterpret_cast<const uint4*>(s);
  uint4* d4 = reinterpret_cast<uint4*>(d);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += size_t(gridDim.x) * blockDim.x)
    d4[i] = s4[i];
  for (size_t i = n16 * 16 + blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < page_bytes;
       i += size_t(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

// ---- matmul (decode GEMV with a small batch in registers) ----

constexpr int k_rows_per_block = 8;  // one warp per weight row, 8 warps per block

template <int B>
__global__ void matmul_f16_kernel(const uint16_t* __restrict__ w, const float* __restrict__ x, int b0,
                                  float* __restrict__ y, int n, int k) {
  const int row = blockIdx.x * k_rows_per_block + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= n) return;
  const uint4* wr = reinterpret_cast<const uint4*>(w + size_t(row) * k);  // 8 halves per load
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.f;
  for (int i = lane; i < k / 8; i += 32) {
    const uint4 raw = __ldg(wr + i);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
    float wf[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      wf[2 * j] = f.x;
      wf[2 * j + 1] = f.y;
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4* xr = reinterpret_cast<const float4*>(x + size_t(b0 + b) * k) + 2 * i;
      const float4 x0 = xr[0], x1 = xr[1];
      acc[b] += wf[0] * x0.x + wf[1] * x0.y + wf[2] * x0.z + wf[3] * x0.w + wf[4] * x1.x + wf[5] * x1.y +
                wf[6] * x1.z + wf[7] * x1.w;
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float v = warp_sum(acc[b]);
    if (lane == 0) y[size_t(b0 + b) * n + row] = v;
  }
}

struct q8_block {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(q8_block) == 34, "ggml q8_0 block is 34 bytes");

// A warp loads 32 consecutive blocks (1088 bytes) into shared memory with coalesced 2-byte
// loads (blocks are only 2-byte aligned), then lane j works on block j.
template <int B>
__global__ void matmul_q8_0_kernel(const uint8_t* __restrict__ w, const float* __restrict__ x, int b0,
                                   float* __restrict__ y, int n, int k) {
  __shared__ uint16_t stage[k_rows_per_block][32 * 17];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * k_rows_per_block + warp;
  if (row >= n) return;
  const int nb = k / 32;
  const uint16_t* wr = reinterpret_cast<const uint16_t*>(w + size_t(row) * nb * 34);
  float acc[B];
#pragma unroll
  for (int b = 0; b < B; ++b) acc[b] = 0.f;
  uint16_t* st = stage[warp];
  for (int c = 0; c < nb; c += 32) {
    const int blocks = min(32, nb - c);
    for (int i = lane; i < blocks * 17; i += 32) st[i] = __ldg(wr + size_t(c) * 17 + i);
    __syncwarp();
    if (lane < blocks) {
      const q8_block* blk = reinterpret_cast<const q8_block*>(st + lane * 17);
      const float d = __half2float(__ushort_as_half(blk->d));
      const int base = (c + lane) * 32;
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4* xr = reinterpret_cast<const float4*>(x + size_t(b0 + b) * k + base);
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float4 xv = xr[j];
          s += float(blk->qs[4 * j]) * xv.x + float(blk->qs[4 * j + 1]) * xv.y + float(blk->qs[4 * j + 2]) * xv.z +
               float(blk->qs[4 * j + 3]) * xv.w;
        }
        acc[b] += d * s;
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float v = warp_sum(acc[b]);
    if (lane == 0) y[size_t(b0 + b) * n + row] = v;
  }
}

template <int B>
struct f16_launch {
  static void go(const uint16_t* w, const float* x, int b0, float* y, int n, int k, cudaStream_t s) {
    matmul_f16_kernel<B><<<(n + k_rows_per_block - 1) / k_rows_per_block, 32 * k_rows_per_block, 0, s>>>(
        w, x, b0, y, n, k);
  }
};
template <int B>
struct q8_launch {
  static void go(const uint8_t* w, const float* x, int b0, float* y, int n, int k, cudaStream_t s) {
    matmul_q8_0_kernel<B><<<(n + k_rows_per_block - 1) / k_rows_per_block, 32 * k_rows_per_block, 0, s>>>(
        w, x, b0, y, n, k);
  }
};

// Batch in chunks of 8 (registers), then the remainder with an exact-size kernel.
template <template <int> class L, class W>
void run_batched(const W* w, const float* x, int batch, float* y, int n, int k, cudaStream_t s) {
  int b = 0;
  for (; b + 8 <= batch; b += 8) L<8>::go(w, x, b, y, n, k, s);
  switch (batch - b) {
    case 7: L<7>::go(w, x, b, y, n, k, s); break;
    case 6: L<6>::go(w, x, b, y, n, k, s); break;
    case 5: L<5>::go(w, x, b, y, n, k, s); break;
    case 4: L<4>::go(w, x, b, y, n, k, s); break;
    case 3: L<3>::go(w, x, b, y, n, k, s); break;
    case 2: L<2>::go(w, x, b, y, n, k, s); break;
    case 1: L<1>::go(w, x, b, y, n, k, s); break;
    default: break;
  }
}

// ---- paged attention, decode (one query token per sequence) ----

constexpr int k_attn_warps = 4;

// How a warp reads K and V rows of HD elements of T with 16-byte loads: `vec` elements per
// load, `tpr` threads per row (a power of two, so a row's partial dot products reduce by xor
// shuffles within the group), `ch` loads per thread per row, `rpw` rows per warp at a time,
// `unroll` positions per group per loop step (K and V of all of them requested before any is
// used: a step's loads are in flight together instead of one row's round trip at a time).
template <class T, int HD>
struct attn_shape {
  static constexpr int vec = 16 / int(sizeof(T));
  static constexpr int units = HD / vec;  // 16-byte pieces per row
  static constexpr int tpr = (units & -units) < 32 ? (units & -units) : 32;
  static constexpr int ch = units / tpr;
  static constexpr int rpw = 32 / tpr;
  static constexpr int unroll = ch >= 4 ? 1 : 4 / ch;
  static_assert(HD % 32 == 0 && units % tpr == 0 && tpr >= 4, "head_dim a multiple of 32");
};

// 16 bytes of K or V widened to f32.
__device__ __forceinline__ void widen(const uint4& raw, float* out, const float*) {
  const float4 f = *reinterpret_cast<const float4*>(&raw);
  out[0] = f.x, out[1] = f.y, out[2] = f.z, out[3] = f.w;
}
__device__ __forceinline__ void widen(const uint4& raw, float* out, const __half*) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]);
    out[2 * j] = f.x, out[2 * j + 1] = f.y;
  }
}

// One block per (query head, sequence), k_attn_warps warps. Each group of `tpr` threads owns
// the positions p = group + i * groups (groups = warps * rpw) and keeps its own online-softmax
// state (max m, sum l, and its slice of the weighted V sum); the groups are merged at the end.
// T: float or __half (an f16 cache is widened on load; the arithmetic is the f32 cache's).
template <class T, int HD>
__global__ void __launch_bounds__(32 * k_attn_warps)
    paged_attention_decode_kernel(const float* __restrict__ q, int n_heads, const T* __restrict__ pool, int n_layers,
                                  int n_kv, int ps, int layer, const int32_t* __restrict__ table, int max_pages,
                                  const int32_t* __restrict__ lens, float* __restrict__ out) {
  using S = attn_shape<T, HD>;
  constexpr int groups = k_attn_warps * S::rpw;
  const int h = blockIdx.x, seq = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int grp = warp * S::rpw + lane / S::tpr, t = lane % S::tpr;
  const int kvh = h / (n_heads / n_kv);
  const int len = lens[seq];
  const size_t layer_elems = size_t(ps) * n_kv * HD;
  const int32_t* pages = table + size_t(seq) * max_pages;
  // This thread's elements of a row: piece c covers [(c * tpr + t) * vec, + vec).
  float qv[S::ch][S::vec], acc[S::ch][S::vec];
  const float scale = rsqrtf(float(HD));
  const float* qh = q + (size_t(seq) * n_heads + h) * HD;
#pragma unroll
  for (int c = 0; c < S::ch; ++c)
#pragma unroll
    for (int e = 0; e < S::vec; ++e) {
      qv[c][e] = qh[(c * S::tpr + t) * S::vec + e] * scale;
      acc[c][e] = 0.f;
    }
  float m = -INFINITY, l = 0.f;
  // Warp-uniform trip count (every lane reaches every shuffle); positions past len are masked.
  for (int base = warp * S::rpw; base < len; base += groups * S::unroll) {
    uint4 kraw[S::unroll][S::ch], vraw[S::unroll][S::ch];
    bool valid[S::unroll];
#pragma unroll
    for (int u = 0; u < S::unroll; ++u) {
      const int p = base + lane / S::tpr + u * groups;
      valid[u] = p < len;
      if (valid[u]) {
        const T* row = pool + (size_t(pages[p / ps]) * n_layers + layer) * 2 * layer_elems +
                       (size_t(p % ps) * n_kv + kvh) * HD;
#pragma unroll
        for (int c = 0; c < S::ch; ++c) {
          kraw[u][c] = __ldg(reinterpret_cast<const uint4*>(row + (c * S::tpr + t) * S::vec));
          vraw[u][c] = __ldg(reinterpret_cast<const uint4*>(row + layer_elems + (c * S::tpr + t) * S::vec));
        }
      }
    }
    float sc[S::unroll];
    float mx = m;
#pragma unroll
    for (int u = 0; u < S::unroll; ++u) {
      float d = 0.f;
      if (valid[u]) {
#pragma unroll
        for (int c = 0; c < S::ch; ++c) {
          float k[S::vec];
          widen(kraw[u][c], k, static_cast<const T*>(nullptr));
#pragma unroll
          for (int e = 0; e < S::vec; ++e) d += qv[c][e] * k[e];
        }
      }
#pragma unroll
      for (int o = S::tpr / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      sc[u] = d;
      if (valid[u]) mx = fmaxf(mx, d);
    }
    if (mx == -INFINITY) continue;  // no position of this group in this step (uniform per group)
    const float corr = __expf(m - mx);
    l *= corr;
#pragma unroll
    for (int c = 0; c < S::ch; ++c)
#pragma unroll
      for (int e = 0; e < S::vec; ++e) acc[c][e] *= corr;
#pragma unroll
    for (int u = 0; u < S::unroll; ++u) {
      if (!valid[u]) continue;
      const float w = __expf(sc[u] - mx);
      l += w;
#pragma unroll
      for (int c = 0; c < S::ch; ++c) {
        float v[S::vec];
        widen(vraw[u][c], v, static_cast<const T*>(nullptr));
#pragma unroll
        for (int e = 0; e < S::vec; ++e) acc[c][e] += w * v[e];
      }
    }
    m = mx;
  }
  __shared__ float sm[groups], sl[groups], sacc[groups][HD];
  if (t == 0) {
    sm[grp] = m;
    sl[grp] = l;
  }
#pragma unroll
  for (int c = 0; c < S::ch; ++c)
#pragma unroll
    for (int e = 0; e < S::vec; ++e) sacc[grp][(c * S::tpr + t) * S::vec + e] = acc[c][e];
  __syncthreads();
  float M = -INFINITY;
  for (int g = 0; g < groups; ++g) M = fmaxf(M, sm[g]);
  float L = 0.f;
  for (int g = 0; g < groups; ++g) L += sm[g] == -INFINITY ? 0.f : sl[g] * __expf(sm[g] - M);
  float* oh = out + (size_t(seq) * n_heads + h) * HD;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float o = 0.f;
    for (int g = 0; g < groups; ++g)
      if (sm[g] != -INFINITY) o += sacc[g][d] * __expf(sm[g] - M);
    oh[d] = L > 0.f ? o / L : 0.f;
  }
}

template <class T, int HD>
void launch_attention(const float* q, int n_seqs, int n_heads, const paged_kv& kv, int layer, const int32_t* table,
                      int max_pages, const int32_t* lens, float* out, cudaStream_t s) {
  paged_attention_decode_kernel<T, HD><<<dim3(n_heads, n_seqs), 32 * k_attn_warps, 0, s>>>(
      q, n_heads, static_cast<const T*>(kv.pool), kv.n_layers, kv.n_kv_heads, kv.page_size, layer, table, max_pages,
      lens, out);
}

template <class T>
void launch_attention_hd(const float* q, int n_seqs, int n_heads, const paged_kv& kv, int layer, const int32_t* table,
                         int max_pages, const int32_t* lens, float* out, cudaStream_t s) {
  switch (kv.head_dim) {
#define TANDEM_ATTN_HD(hd) \
  case hd: return launch_attention<T, hd>(q, n_seqs, n_heads, kv, layer, table, max_pages, lens, out, s);
    TANDEM_ATTN_HD(32)
    TANDEM_ATTN_HD(64)
    TANDEM_ATTN_HD(96)
    TANDEM_ATTN_HD(128)
    TANDEM_ATTN_HD(160)
    TANDEM_ATTN_HD(192)
    TANDEM_ATTN_HD(224)
    TANDEM_ATTN_HD(256)
#undef TANDEM_ATTN_HD
    default: return;  // checked by the caller
  }
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
  if (n <= 0 || page_bytes == 0) return;
  const uintptr_t bases = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  const bool vec = page_bytes % 16 == 0 && bases % 16 == 0;
  const size_t units = vec ? page_bytes / 16 : page_bytes;
  const int per_page = int((units + 255) / 256 < 64 ? (units + 255) / 256 : 64);
  constexpr int max_rows = 65535;  // gridDim.y
  for (int first = 0; first < n; first += max_rows) {
    dim3 grid(per_page, n - first < max_rows ? n - first : max_rows);
    copy_pages_kernel<<<grid, 256, 0, s>>>(src, src_ids, dst, dst_ids, page_bytes, first, vec);
  }
}

cudaError_t gather_pages(const uint8_t* pool, const int32_t* ids, int n, size_t page_bytes, uint8_t* staging,
                         cudaStream_t s) {
  if (n < 0 || page_bytes % 16 != 0 || (n > 0 && (pool == nullptr || ids == nullptr || staging == nullptr)))
    return cudaErrorInvalidValue;
  copy_pages(pool, ids, staging, nullptr, n, page_bytes, s);
  return cudaGetLastError();
}

cudaError_t scatter_pages(const uint8_t* staging, const int32_t* ids, int n, size_t page_bytes, uint8_t* pool,
                          cudaStream_t s) {
  if (n < 0 || page_bytes % 16 != 0 || (n > 0 && (pool == nullptr || ids == nullptr || staging == nullptr)))
    return cudaErrorInvalidValue;
  copy_pages(staging, nullptr, pool, ids, n, page_bytes, s);
  return cudaGetLastError();
}

cudaError_t matmul_f16(const uint16_t* w, const float* x, int batch, float* y, int n, int k, cudaStream_t s) {
  if (batch < 0 || n <= 0 || k <= 0 || k % 8 != 0) return cudaErrorInvalidValue;
  run_batched<f16_launch>(w, x, batch, y, n, k, s);
  return cudaGetLastError();
}

cudaError_t matmul_q8_0(const void* w, const float* x, int batch, float* y, int n, int k, cudaStream_t s) {
  if (batch < 0 || n <= 0 || k <= 0 || k % 32 != 0) return cudaErrorInvalidValue;
  run_batched<q8_launch>(static_cast<const uint8_t*>(w), x, batch, y, n, k, s);
  return cudaGetLastError();
}

cudaError_t paged_attention_decode(const float* q, int n_seqs, int n_heads, const paged_kv& kv, int layer,
                                   const int32_t* page_table, int max_pages, const int32_t* seq_lens, float* out,
                                   cudaStream_t s) {
  if (n_seqs < 0 || kv.n_kv_heads <= 0 || n_heads % kv.n_kv_heads != 0 || kv.head_dim % 32 != 0 ||
      kv.head_dim > 256 || kv.page_size <= 0 || layer < 0 || layer >= kv.n_layers || max_pages <= 0)
    return cudaErrorInvalidValue;
  if (n_seqs == 0) return cudaSuccess;
  if (kv.f16)
    launch_attention_hd<__half>(q, n_seqs, n_heads, kv, layer, page_table, max_pages, seq_lens, out, s);
  else
    launch_attention_hd<float>(q, n_seqs, n_heads, kv, layer, page_table, max_pages, seq_lens, out, s);
  return cudaGetLastError();
}

}  // namespace tandem::cuda
