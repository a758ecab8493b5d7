// Physical cores through hwloc: a second hardware thread of a core shares its FMA units and
// caches, so the kernels gain little from it and default to one thread per core.
#include "actors/common/cpu_cores.h"

#include <hwloc.h>

#include <algorithm>
#include <thread>

namespace tandem {

namespace {

int32_t count_cores() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return 0;
  int n = 0;
  // By default hwloc leaves out the PUs outside this process' cpuset (taskset, cgroups), and
  // cores with none of them.
  if (hwloc_topology_load(topo) == 0) n = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  hwloc_topology_destroy(topo);
  return int32_t(std::max(n, 0));
}

}  // namespace

int32_t physical_cores() {
  static const int32_t n = [] {
    const int32_t cores = count_cores();
    if (cores > 0) return cores;
    return std::max<int32_t>(1, int32_t(std::thread::hardware_concurrency()));
  }();
  return n;
}

}  // namespace tandem
