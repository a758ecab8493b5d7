#pragma once
/// CUDA kernels (sm_90). Host-callable launchers; all pointers are device pointers unless
/// named `host_*`. Each op mirrors a CPU kernel in kernels/cpu and is checked against it by
/// tests/gpu/test_cuda_ops.cu on a GPU machine (tests/gpu/run.sh). Launchers that can be
/// given bad shapes return cudaErrorInvalidValue instead of launching.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tandem::cuda {

/// y[r][i] = x[r][i] * w[i] / sqrt(mean(x[r]^2) + eps), rows of n floats.
void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s);
/// In place: rotate adjacent pairs (x[2i], x[2i+1]) of each head by pos[r] * base^(-2i/head_dim)
/// (llama.cpp "normal" RoPE). x is [rows][n_heads][head_dim].
void rope(float* x, const int32_t* pos, int rows, int n_heads, int head_dim, float freq_base, cudaStream_t s);
/// out[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t s);
/// Copies `n` pages of `page_bytes` each: dst page dst_ids[i] <- src page src_ids[i] (a null
/// id list: page i). Either side may be mapped pinned host memory. Any n and page size: 16-byte
/// copies where both areas and the page size allow them, bytes otherwise.
void copy_pages(const uint8_t* src, const int32_t* src_ids, uint8_t* dst, const int32_t* dst_ids, int n,
                size_t page_bytes, cudaStream_t s);

/// KV pages between the device pool and a contiguous staging area (typically mapped pinned
/// host memory from cudaHostAlloc(..., cudaHostAllocMapped), passed as its device pointer):
/// gather: staging page i <- pool page ids[i]; scatter: pool page ids[i] <- staging page i.
/// page_bytes must be a multiple of 16 (kv_pool pages are).
cudaError_t gather_pages(const uint8_t* pool, const int32_t* ids, int n, size_t page_bytes, uint8_t* staging,
                       cudaStream_t s);
cudaError_t scatter_pages(const uint8_t* staging, const int32_t* ids, int n, size_t page_bytes, uint8_t* pool,
                        cudaStream_t s);

/// y[b][r] = sum_k W[r][k] x[b][k] for an f16 weight matrix W [n][k] (IEEE half bits, row
/// major) and f32 activations x [batch][k]. k must be a multiple of 8 (16-byte rows).
/// One warp per row, the batch accumulated in registers 8 rows at a time, so each weight is
/// read from memory once per 8 activation rows.
cudaError_t matmul_f16(const uint16_t* w, const float* x, int batch, float* y, int n, int k, cudaStream_t s);
/// Same for q8_0 weights (ggml blocks of {half d; int8 qs[32]}, k a multiple of 32).
cudaError_t matmul_q8_0(const void* w, const float* x, int batch, float* y, int n, int k, cudaStream_t s);

/// Decode attention over the paged KV pool (the layout of tandem::kv_pool: page p, layer l:
/// K at pool + (p * n_layers + l) * 2 * page_size * n_kv_heads * head_dim elements (f32, or
/// IEEE halves with f16 = true: kv_dtype::f16), V after it;
/// slot s, KV head h at (s * n_kv_heads + h) * head_dim). One query token per sequence:
/// q is [n_seqs][n_heads][head_dim]; sequence i attends positions [0, seq_lens[i]) through
/// page_table[i * max_pages ...]. out is [n_seqs][n_heads][head_dim]. Scale 1/sqrt(head_dim);
/// query head h reads KV head h / (n_heads / n_kv_heads). head_dim a multiple of 32, <= 256.
struct paged_kv {
  const void* pool = nullptr;
  int n_layers = 0, n_kv_heads = 0, head_dim = 0, page_size = 0;
  bool f16 = false;  ///< elements are IEEE halves (kv_dtype::f16), else f32
};
cudaError_t paged_attention_decode(const float* q, int n_seqs, int n_heads, const paged_kv& kv, int layer,
                                 const int32_t* page_table, int max_pages, const int32_t* seq_lens, float* out,
                                 cudaStream_t s);

}  // namespace tandem::cuda
