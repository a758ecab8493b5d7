#pragma once
/// Machine ceilings measured in the same run as a benchmark, so kernel numbers can be
/// printed as fractions of what this machine does right now (not of a datasheet).
#include <cstddef>

#include "kernels/cpu/isa.h"

namespace tandem::cpu {

class thread_pool;

/// Streaming read bandwidth in bytes/s over `bytes` (make it well above the last-level
/// cache; on 2 MiB pages where the kernel grants them), all of `pool`'s threads reading
/// disjoint parts: plain wide loads with and without software prefetch, and the batch-1 f16
/// matmul's own pattern; the best of `reps` of each.
double measure_read_bandwidth(thread_pool& pool, size_t bytes, int reps);

/// Peak fused multiply-add rate in FLOP/s (an FMA = 2 FLOP) of the `isa` path on all of
/// `pool`'s threads: independent register accumulators, no memory traffic; best of `reps`.
double measure_peak_fma(thread_pool& pool, cpu_isa isa, int reps);

}  // namespace tandem::cpu
