#pragma once
/// The checks every model runs, whatever its backend: weight views against the config at load
/// (a missing, mis-shaped or unsupported tensor is refused naming it, never run) and a batch
/// before it touches its pages.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/model/kv_pool.h"
#include "kernels/model/llama.h"
#include "kernels/tensor.h"

namespace tandem::arch {

/// Throws tandem::error naming `name` unless `t` is present, of a type the kernels run, and
/// `mats` stacked matrices of `rows` x `cols` (ne = {cols, rows, mats}) whose bytes are there.
void check_weight(const tensor_view& t, const std::string& name, int64_t cols, int64_t rows, int64_t mats = 1);

/// A vector weight (norm, bias) as f32 values; `t` must be present with `n` elements.
std::vector<float> vector_weight(const tensor_view& t, const std::string& name, int64_t n);

/// vector_weight, or empty when the architecture leaves it out (t.data == nullptr).
std::vector<float> optional_vector_weight(const tensor_view& t, const std::string& name, int64_t n);

/// Throws tandem::error naming the sequence when a position is negative or beyond the context,
/// a sequence wants logits without new tokens, it has not one page table per pool, its pages
/// cannot hold its positions or (those the step reads) lie outside their pool, or a token id is
/// outside the vocabulary. Fills `tokens` and `positions` with the batch's new tokens in order
/// and returns how many sequences want logits.
size_t check_batch(std::span<const batch_seq> batch, const model_config& c, const kv_pools& pools,
                   std::vector<int32_t>& tokens, std::vector<int32_t>& positions);

}  // namespace tandem::arch
