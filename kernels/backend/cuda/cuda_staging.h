#pragma once
/// The CUDA device's staging copies (kernels/backend/device.h's staging_ops): pinned host
/// memory from cudaHostAlloc / cudaHostRegister, and copies on a stream of their own (not the
/// backend's compute stream) whose fences are CUDA events.
#include <cstdint>

#include "kernels/backend/device.h"

namespace tandem::backend {

/// Staging copies for CUDA device `device` (the stream is created on first use).
staging_ops make_cuda_staging(int32_t device);

}  // namespace tandem::backend
