#pragma once
/// The matmul weights the kernels read straight from the GGUF file (f32, f16, bf16, q8_0, and
/// low-bit weights left unpacked), copied out of the file's mapping into anonymous memory on
/// 2 MiB pages when the model is prepared. A batch-1 decode step streams every weight once,
/// and the mapping's page-cache pages stream slower than huge anonymous pages (kernels/cpu/
/// huge_pages.h). Measured on the llama-1b preset in f16 (1.96 GB of weights), 2 threads,
/// Zen 5, the same binary alternating: 20-23 tokens/s from the mapping, 26 from the copy.
#include <cstdint>
#include <memory>
#include <span>

#include "kernels/tensor.h"

namespace tandem::cpu {

class thread_pool;

/// False when the environment has TANDEM_COPY_WEIGHTS=0: the kernels then read the weights
/// from the file's mapping (the same bits; no second copy in RAM, slower decode). Read once.
bool weight_copy_enabled();

/// Copies the bytes of every view in `views` into one buffer on 2 MiB pages and points each
/// view at its copy; views with the same bytes (the same data and size) share one copy.
/// Returns the buffer, which must outlive the views (null when `views` is empty). The copy is
/// split across `pool`'s threads. Throws tandem::error when the memory is not there.
std::shared_ptr<const uint8_t> copy_weights(std::span<tensor_view* const> views, thread_pool* pool);

/// The bytes copy_weights allocates for `views`: each distinct view's size rounded up to 64
/// bytes. (The RAM check counts the same tensors by their file sizes, from the GGUF metadata
/// alone: within 64 bytes a tensor of this.)
uint64_t weight_copy_bytes(std::span<const tensor_view> views);

}  // namespace tandem::cpu
