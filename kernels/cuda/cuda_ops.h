#pragma once
/// CUDA kernels (sm_90). Host-callable launchers; all pointers are device pointers unless
/// named `host_*`. Each op mirrors a CPU kernel in kernels/cpu and is checked against it by
/// tests/gpu/test_cuda_ops.cu on a GPU machine (tests/gpu/run.sh).
#include <cstddef>
#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace tandem::cuda {

/// y[r][i] = x[r][i] * w[i] / sqrt(mean(x[r]^2) + eps), rows of n floats.
void rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps, cudaStream_t s);
/// In place: rotate adjacent pairs (x[2i], x[2i+1]) of each head by pos[r] * base^(-2i/head_dim)
/// (llama.cpp "normal" RoPE). x is [rows][n_heads][head_dim].
void rope(float* x, const int32_t* pos, int rows, int n_heads, int head_dim, float freq_base, cudaStream_t s);
/// out[i] = silu(gate[i]) * up[i]
void swiglu(const float* gate, const float* up, float* out, size_t n, cudaStream_t s);
/// Copies `n` pages of `page_bytes` each: dst page dst_ids[i] <- src page src_ids[i].
/// Used to stage device pool pages through pinned host memory (gather) and back (scatter);
/// either side may be mapped pinned host memory.
void copy_pages(const uint8_t* src, const int32_t* src_ids, uint8_t* dst, const int32_t* dst_ids, int n,
                size_t page_bytes, cudaStream_t s);

}  // namespace tandem::cuda
