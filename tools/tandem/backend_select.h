#pragma once
/// Picks what `tandem serve` runs the model on ([model] backend / --backend): the CPU backend,
/// or the CUDA device in a build with -DTANDEM_CUDA=ON.
#include <cstdint>
#include <string>

#include "kernels/backend/device.h"

namespace tandem::cli {

/// "cpu": an empty device (the CPU backend); "cuda": that device. Throws tandem::error naming
/// the fix for any other name, a build without CUDA, or a device that is not there.
backend::device select_backend(const std::string& name, int32_t device);

/// CUDA devices this build sees; -1 in a build without the CUDA backend.
int32_t cuda_devices_here();

}  // namespace tandem::cli
