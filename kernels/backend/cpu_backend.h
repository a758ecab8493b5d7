#pragma once
/// The CPU backend: the op table on host memory over kernels/cpu (one thread pool, one kernel
/// path chosen for this CPU).
#include <memory>

#include "kernels/backend/backend.h"
#include "kernels/model/llama.h"

namespace tandem::backend {

/// Throws tandem::error when the thread count is out of range or the CPU lacks `opt.isa`.
std::unique_ptr<ops> make_cpu_backend(const cpu_options& opt);

}  // namespace tandem::backend
