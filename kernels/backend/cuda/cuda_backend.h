#pragma once
/// The CUDA backend: the op table (kernels/backend/backend.h) on one device's memory, with
/// cuBLAS for f32/f16/bf16 weights and dequantizing kernels for the ggml block types
/// (kernels/backend/cuda/kernels.h). Built with -DTANDEM_CUDA=ON (preset `cuda`); the CPU build
/// has none of it.
///
/// Memory: activations (make_buffer), prepared weights and the KV pool (device_kv_pool) live on
/// the device. Host descriptors (token ids, page tables, rope angles, routing weights) are copied
/// per call. Vector weights the forward passes keep on the host (norms, biases) are uploaded on
/// first use and their host copy compared on each use, so a changed vector is re-sent.
///
/// Every op gives a row the same bits whatever else is in the batch: cuBLAS runs on fixed
/// chunks of k_matmul_rows rows, the other kernels compute a row from its own inputs. The bits
/// differ from the CPU backend's (another rounding order, cuBLAS's tensor cores, expf/tanhf):
/// tests/gpu/test_cuda_backend.cpp states the tolerance of each op.
#include <cstdint>
#include <memory>

#include "kernels/backend/backend.h"
#include "kernels/backend/device.h"
#include "kernels/model/kv_pool.h"

namespace tandem::backend {

/// Options for the CUDA backend.
struct cuda_options {
  int32_t device = 0;  ///< CUDA device index
  /// Decode-step graphs kept (CUDA graphs, cuda_graphs.h); 0 runs every step eagerly.
  int32_t max_graphs = 16;
};

/// Devices the CUDA runtime sees (0 when there is no driver or no device).
int32_t cuda_device_count();

/// Throws tandem::error naming the device and the fix when it is absent or unusable.
std::unique_ptr<ops> make_cuda_backend(const cuda_options& opt);

/// A KV pool in device memory (cudaMalloc'd, zeroed): the pool to hand a CUDA backend's
/// kv_write / attention / mla_attention. Its page pointers are device addresses.
class device_kv_pool {
 public:
  /// Throws tandem::error when the device lacks the memory (naming the bytes and the fix).
  device_kv_pool(const kv_layout& layout, int32_t n_pages, int32_t device = 0);
  ~device_kv_pool();
  device_kv_pool(const device_kv_pool&) = delete;
  device_kv_pool& operator=(const device_kv_pool&) = delete;
  kv_pool& pool() { return *pool_; }

 private:
  void* memory_ = nullptr;
  std::unique_ptr<kv_pool> pool_;
};

/// The CUDA device for serving (kernels/backend/device.h): its op table, KV pools in its memory,
/// page copies with cudaMemcpy. Throws tandem::error naming the device and the fix when absent.
device make_cuda_device(const cuda_options& opt);

}  // namespace tandem::backend
