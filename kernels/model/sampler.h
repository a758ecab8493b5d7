#pragma once
/// Token sampling: greedy, temperature, top-k, top-p, seeded.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tandem {

struct sampling_params {
  float temperature = 1.0f;  ///< 0 = greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;         ///< 0 = off
  float top_p = 1.0f;        ///< 1 = off
  uint64_t seed = 0;
  /// Empty if valid, else a message naming the parameter, its value and the valid range.
  std::string validate() const;
};

/// One sampler per sequence; the same seed and logits give the same tokens. Cheap to
/// construct (the worker makes one per token from a per-token seed): the generator is
/// splitmix64, O(1) to seed. Without top-k/top-p the draw walks the vocabulary in id order
/// in O(n_vocab); only top-k/top-p sort.
class sampler {
 public:
  explicit sampler(const sampling_params& p);
  int32_t sample(std::span<const float> logits);

 private:
  uint64_t next_u64();
  sampling_params p_;
  uint64_t state_;
  std::vector<std::pair<float, int32_t>> scratch_;
  std::vector<float> probs_;
};

}  // namespace tandem
