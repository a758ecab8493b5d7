#pragma once
/// How many cores this process can compute on: the default kernel thread count.
#include <cstdint>

namespace tandem {

/// Physical cores (not hardware threads) among the CPUs this process may run on, as hwloc
/// reports them; hardware_concurrency() if hwloc cannot read the topology, and at least 1.
/// Read once, then cached.
int32_t physical_cores();

}  // namespace tandem
