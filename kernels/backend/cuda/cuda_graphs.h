#pragma once
/// CUDA graphs for the CUDA backend's decode steps (ops::begin_graph / end_graph): the step's
/// launches are captured on the backend's stream, then run through the graph kept for the
/// step's key (graph_cache.h): cudaGraphExecUpdate refreshes its parameters (pointers, page
/// tables, positions, grid sizes) when the topology is unchanged, else a new graph is
/// instantiated in its place. The GPU then runs the step without a gap between kernels.
///
/// What a capture must not do (each throws, the step is recorded no further, and the key
/// runs eagerly from then on): grow a device buffer (the key's first step runs eagerly and
/// grows them), wait for the stream (a host download: MoE routing), wrap the pinned staging
/// ring (rewound before each capture) or copy from pageable memory.
#include <cuda_runtime_api.h>

#include <memory>

#include "kernels/backend/cuda/device_memory.h"
#include "kernels/backend/graph_cache.h"

namespace tandem::backend::cuda_detail {

class step_graphs {
 public:
  step_graphs(cudaStream_t s, host_staging* staging, size_t max_graphs);
  /// True: the stream is capturing the step of key k (end() runs it).
  bool begin(const graph_key& k);
  /// Ends the capture and launches the step's graph; false when the capture failed (nothing
  /// ran: run the step again eagerly).
  bool end();
  /// Ends a capture an exception interrupted (nothing ran; the key fails).
  void abort();
  graph_stats stats() const { return cache_.stats(); }

 private:
  cudaStream_t stream_;
  host_staging* staging_;
  graph_cache cache_;
  graph_key key_;
  bool capturing_ = false;
};

}  // namespace tandem::backend::cuda_detail
