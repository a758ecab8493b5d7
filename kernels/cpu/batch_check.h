#pragma once
/// The checks every CPU model runs on a batch before touching its pages.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/model/kv_pool.h"
#include "kernels/model/llama.h"

namespace tandem::cpu {

/// Throws tandem::error naming the sequence when a position is negative or beyond the context,
/// a sequence wants logits without new tokens, its pages cannot hold its positions or lie
/// outside `pool`, or a token id is outside the vocabulary. Fills `tokens` and `positions` with
/// the batch's new tokens in order and returns how many sequences want logits.
size_t check_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pool& pool,
                   std::vector<int32_t>& tokens, std::vector<int32_t>& positions);

}  // namespace tandem::cpu
