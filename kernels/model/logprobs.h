#pragma once
/// Log-probabilities of sampled tokens (OpenAI's `logprobs` / `top_logprobs`).
///
/// Which distribution: the one the sampler draws from before truncation, i.e. the model's
/// logits after logit_bias and the presence/frequency/repetition penalties, divided by the
/// temperature (temperature 0 = greedy counts as 1), then log-softmaxed over the whole
/// vocabulary. top_k/top_p/min_p truncation is not applied (vLLM's `processed_logprobs`
/// mode), so a token outside the kept set still has its finite log-probability. At
/// temperature 0 the most likely entry is the greedy choice (ties to the lowest id, as the
/// sampler's argmax).
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/model/sampler.h"

namespace tandem {

/// OpenAI's bound on top_logprobs; also bounds the per-token work and the event size.
constexpr int32_t max_top_logprobs = 20;

struct top_logprob {
  int32_t token = -1;
  float logprob = 0.0f;
};

/// The chosen token's log-probability and the `top` most likely ones, most likely first
/// (ties by lowest id).
struct token_logprobs {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<top_logprob> top;
};

/// Log-probabilities of `chosen` and the top `top_n` (clamped to [0, max_top_logprobs] and
/// the vocabulary) in `logits` (one raw row) under `p` with the penalty history `h`.
token_logprobs compute_logprobs(std::span<const float> logits, const sampling_params& p, const token_history& h,
                                int32_t chosen, int32_t top_n);

}  // namespace tandem
