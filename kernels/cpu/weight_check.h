#pragma once
/// Checks of a model's weight views against its config, shared by the CPU models: a missing,
/// mis-shaped or unsupported tensor is refused at load naming it, never run.
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/tensor.h"

namespace tandem::cpu {

/// Throws tandem::error naming `name` unless `t` is present, of a type the kernels run, and
/// `mats` stacked matrices of `rows` x `cols` (ne = {cols, rows, mats}) whose bytes are there.
void check_weight(const tensor_view& t, const std::string& name, int64_t cols, int64_t rows, int64_t mats = 1);

/// A vector weight (norm, bias) as f32 values; `t` must be present with `n` elements.
std::vector<float> vector_weight(const tensor_view& t, const std::string& name, int64_t n);

/// vector_weight, or empty when the architecture leaves it out (t.data == nullptr).
std::vector<float> optional_vector_weight(const tensor_view& t, const std::string& name, int64_t n);

}  // namespace tandem::cpu
