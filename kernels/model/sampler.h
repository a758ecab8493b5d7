#pragma once
/// Token sampling: greedy, temperature, top-k, top-p, min-p, seeded; logit bias and
/// presence/frequency/repetition penalties over the sequence's tokens.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/grammar/grammar_spec.h"

namespace tandem {

/// Entries of one logit_bias map: bounds the per-token work of the bias.
constexpr size_t max_logit_bias_entries = 1024;

struct sampling_params {
  float temperature = 1.0f;  ///< 0 = greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;         ///< 0 = off
  float top_p = 1.0f;        ///< 1 = off
  uint64_t seed = 0;
  /// OpenAI's: subtracted once from the logit of every token generated so far. [-2, 2], 0 = off.
  float presence_penalty = 0.0f;
  /// OpenAI's: subtracted per occurrence in the generated tokens. [-2, 2], 0 = off.
  float frequency_penalty = 0.0f;
  /// HF/llama.cpp's: logits of tokens in prompt + generated are divided by it (multiplied when
  /// negative). (0, 2], 1 = off.
  float repetition_penalty = 1.0f;
  /// Keeps tokens whose probability (after temperature) is at least min_p times the most
  /// likely one's. [0, 1], 0 = off.
  float min_p = 0.0f;
  /// (token id, bias in [-100, 100]) added to the logits before everything else.
  std::vector<std::pair<int32_t, float>> logit_bias;
  /// The output must match this (applied by the worker as a mask before the draw).
  grammar_spec grammar;
  /// Empty if valid, else a message naming the parameter, its value and the valid range.
  std::string validate() const;
  /// True when logits must be rewritten before the draw (bias, penalties or min_p set).
  bool processes_logits() const;
};

/// The tokens a sequence's penalties look at.
struct token_history {
  std::span<const int32_t> prompt;
  std::span<const int32_t> generated;
};

/// Adds logit_bias and applies the repetition, frequency and presence penalties to `logits`
/// in place (ids outside the row are ignored: the front end validated them).
void apply_logit_processing(std::span<float> logits, const sampling_params& p, const token_history& h);

/// One row of a draw a backend makes where the logits are (backend::ops::sample): the sampler's
/// draw (greedy, temperature, top-k, top-p) with the uniform number the host drew, and no logit
/// rewriting. Rows whose parameters rewrite logits (logit_bias, penalties, min_p) or carry a
/// grammar take the host path: they need the sequence's token history or the grammar's mask,
/// which live on the host.
struct sample_row {
  float temperature = 1.0f;  ///< 0 = greedy
  int32_t top_k = 0;         ///< 0 = off
  float top_p = 1.0f;        ///< 1 = off
  int32_t top_logprobs = -1;  ///< -1: none; else the chosen token's logprob and this many top ones
  double uniform = 0.0;       ///< the draw in [0, 1): sampler::first_uniform(seed)
};

/// True when `p` can be drawn by a backend from the raw logits (sample_row): no logit_bias,
/// penalties, min_p or grammar.
bool samples_raw(const sampling_params& p);
/// The row of `p` (its seed gives the uniform), with `top_logprobs` (-1: none).
sample_row sample_row_of(const sampling_params& p, int32_t top_logprobs);
/// The parameters a row draws with (temperature, top-k, top-p; nothing else applies to raw logits).
sampling_params params_of(const sample_row& r);
/// The sampler's draw over one raw logits row with the uniform `u` in [0, 1): the token
/// sampler(p).sample(logits) gives when u = sampler::first_uniform(p.seed) and samples_raw(p).
int32_t draw_with_uniform(const sample_row& r, std::span<const float> logits);

/// One sampler per sequence; the same seed and logits give the same tokens. Cheap to
/// construct (the worker makes one per token from a per-token seed): the generator is
/// splitmix64, O(1) to seed. Without top-k/top-p the draw walks the vocabulary in id order
/// in O(n_vocab); only top-k/top-p sort.
class sampler {
 public:
  explicit sampler(const sampling_params& p);
  int32_t sample(std::span<const float> logits, const token_history& h = {});
  /// The uniform number in [0, 1) a fresh sampler of `seed` draws first (the one a token's
  /// draw uses: the worker makes one sampler per token).
  static double first_uniform(uint64_t seed);

 private:
  friend int32_t draw_with_uniform(const sample_row& r, std::span<const float> logits);
  uint64_t next_u64();
  double next_uniform();
  int32_t draw(std::span<const float> logits);
  /// draw() with the uniform `u` given (greedy rows ignore it).
  int32_t draw_with(std::span<const float> logits, double u);
  sampling_params p_;
  uint64_t state_;
  std::vector<std::pair<float, int32_t>> scratch_;
  std::vector<float> probs_;
  std::vector<float> work_;  ///< the processed logits row
};

}  // namespace tandem
