#pragma once
/// The CUDA backend's sample op (backend::ops::sample): the draw and the asked logprobs run
/// on the device where the logits are (sampling.cu); per row only 176 bytes come back (the
/// token, its logprob, up to 20 top entries), never the logits row.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend/cuda/device_memory.h"
#include "kernels/backend/cuda/sampling.h"
#include "kernels/model/logprobs.h"

namespace tandem::backend::cuda_detail {

class device_sampler {
 public:
  device_sampler(cudaStream_t s, host_staging* staging);
  /// As ops::sample; waits for the stream (the tokens are wanted on the host).
  void run(const float* logits, int64_t n_vocab, std::span<const sample_row> rows, std::span<token_logprobs> out);

 private:
  cudaStream_t stream_;
  /// descriptors, sorted-row list, row offsets, sort keys/ids in and out, sort scratch, results
  device_bytes descs_, sorted_rows_, offsets_, keys_in_, keys_out_, ids_in_, ids_out_, scratch_, results_;
  std::vector<cuda_backend::sample_desc> host_descs_;
  std::vector<int32_t> host_sorted_, host_offsets_;
  std::vector<cuda_backend::sample_out> host_out_;
};

}  // namespace tandem::backend::cuda_detail
