#pragma once
/// Launchers of the device sampling kernels (sampling.cu): the draw of kernels/model/sampler.h
/// on logits in device memory, with the uniform number the host drew, and the logprobs of
/// kernels/model/logprobs.h. C++17 and free of Tandem's C++20 headers (nvcc parses it). All
/// pointers are device pointers; every launcher enqueues on `s` and returns the launch error.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace tandem::cuda_backend {

/// At most this many top logprobs per row (logprobs.h's max_top_logprobs).
constexpr int k_max_top_logprobs = 20;

/// One row's draw: sampler.h's sample_row plus where its sorted copy is.
struct sample_desc {
  float temperature = 1.0f;  ///< 0 = greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  int32_t top_n = -1;        ///< logprobs asked: -1 none
  double uniform = 0.0;      ///< in [0, 1)
  int32_t sorted = -1;       ///< the row's index in the sorted arrays (top-k / top-p rows), else -1
  int32_t pad = 0;
};
static_assert(sizeof(sample_desc) == 32, "host and device agree on the row descriptor");

/// What comes back to the host per row: 176 bytes, whatever the vocabulary.
struct sample_out {
  int32_t token = -1;
  float logprob = 0.0f;
  int32_t n_top = 0;
  int32_t pad = 0;
  int32_t top_ids[k_max_top_logprobs];
  float top_logprobs[k_max_top_logprobs];
};
static_assert(sizeof(sample_out) == 176, "host and device agree on the row result");

/// True when a row draws from a sorted copy (top-k or top-p truncation, not greedy).
inline bool sample_needs_sort(const sample_desc& d, int64_t n_vocab) {
  const bool greedy = d.temperature == 0.0f || d.top_k == 1;
  const bool whole = d.top_p >= 1.0f && (d.top_k <= 0 || d.top_k >= n_vocab);
  return !greedy && !whole;
}

/// keys [n_sorted][n_vocab] = logits row rows[j] / its temperature (the sampler's division), ids
/// = 0 .. n_vocab - 1: the input of sort_rows_desc.
cudaError_t sort_keys(const float* logits, int64_t n_vocab, const sample_desc* descs, const int32_t* rows,
                      int64_t n_sorted, float* keys, int32_t* ids, cudaStream_t s);
/// Scratch bytes sort_rows_desc needs for n_sorted rows of n_vocab.
size_t sort_scratch_bytes(int64_t n_sorted, int64_t n_vocab);
/// Sorts every row of keys (with its ids) highest first, ties by lowest id (a stable radix
/// sort of ids in ascending order): the sampler's order. offsets: [n_sorted + 1] row starts.
cudaError_t sort_rows_desc(void* scratch, size_t scratch_bytes, const float* keys_in, float* keys_out,
                           const int32_t* ids_in, int32_t* ids_out, int64_t n_sorted, int64_t n_vocab,
                           const int32_t* offsets, cudaStream_t s);
/// out[r].token for every row: greedy (first maximum, NaN at 0 wins as std::max_element's),
/// the whole distribution walked in id order, or the sorted copy cut at top_k then top_p.
cudaError_t draw_tokens(const float* logits, int64_t n_vocab, const sample_desc* descs, int64_t rows,
                        const float* sorted_keys, const int32_t* sorted_ids, sample_out* out, cudaStream_t s);
/// For rows with top_n >= 0 (after draw_tokens): out[r].logprob of out[r].token and the top_n
/// (at most k_max_top_logprobs) most likely, highest first, ties by lowest id, under the
/// temperature-scaled log-softmax of the whole row (temperature 0 counts as 1).
cudaError_t token_logprobs(const float* logits, int64_t n_vocab, const sample_desc* descs, int64_t rows,
                           sample_out* out, cudaStream_t s);

}  // namespace tandem::cuda_backend
