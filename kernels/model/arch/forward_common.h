#pragma once
/// What every architecture's forward pass does the same way around its layers: checking and
/// laying out a batch, and the output head.
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kernels/backend/backend.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/llama.h"

namespace tandem::arch {

/// A checked batch, flattened: the new tokens in order with their positions and KV slots, the
/// flat index of each sequence's first new token, and the rows whose logits are wanted.
struct batch_plan {
  std::vector<int32_t> tokens, positions;
  std::vector<backend::kv_slot> slots;
  std::vector<std::pair<int64_t, const batch_seq*>> starts;  ///< sequences with new tokens
  std::vector<int32_t> last;                                 ///< last token of each wanting logits
  int64_t n_tokens() const { return int64_t(tokens.size()); }
};

/// Refuses a pool whose layout is not `want` (naming both) and a bad batch (check_batch);
/// fills `plan` (its vectors reused between calls).
void plan_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pool& pool, const kv_layout& want,
                batch_plan& plan);

/// The output head: the final norm of the planned rows of `x` ([tokens][n_embd]) into `xn`,
/// the output matmul into `logits` (one row per plan.last entry; through `staging` when the
/// backend's memory is not the host's), then soft-capping when `softcap` > 0.
void output_logits(backend::ops& o, const batch_plan& plan, const float* x, float* xn, const float* norm, float eps,
                   int64_t n_embd, backend::weight_id output, float softcap, backend::buffer& staging,
                   std::vector<float>& logits);

}  // namespace tandem::arch
