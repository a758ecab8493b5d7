#include "kernels/backend/cuda/cuda_graphs.h"

namespace tandem::backend::cuda_detail {

step_graphs::step_graphs(cudaStream_t s, host_staging* staging, size_t max_graphs)
    : stream_(s), staging_(staging), cache_(max_graphs, [](void* g) {
        if (g != nullptr) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(g));
      }) {}

bool step_graphs::begin(const graph_key& k) {
  if (capturing_) abort();
  if (cache_.on_step(k) == graph_cache::action::eager) return false;
  // The ring restarts so the capture's descriptor copies never wrap it (a wrap waits for the
  // stream, which a capture cannot).
  check(cudaStreamSynchronize(stream_), "finishing the previous step before a graph");
  staging_->rewind();
  if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    cache_.failed(k);
    return false;
  }
  key_ = k;
  capturing_ = true;
  return true;
}

bool step_graphs::end() {
  if (!capturing_) return false;
  capturing_ = false;
  cudaGraph_t g = nullptr;
  if (cudaStreamEndCapture(stream_, &g) != cudaSuccess || g == nullptr) {
    cudaGetLastError();
    if (g != nullptr) cudaGraphDestroy(g);
    cache_.failed(key_);
    return false;
  }
  auto exec = static_cast<cudaGraphExec_t>(cache_.graph(key_));
  bool updated = false;
  if (exec != nullptr) {
    cudaGraphExecUpdateResultInfo info{};
    updated = cudaGraphExecUpdate(exec, g, &info) == cudaSuccess;
    if (!updated) cudaGetLastError();
  }
  if (!updated) {
    cudaGraphExec_t fresh = nullptr;
    if (cudaGraphInstantiate(&fresh, g, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaGraphDestroy(g);
      cache_.failed(key_);
      return false;
    }
    cache_.keep(key_, fresh);  // destroys the one it replaces
    exec = fresh;
  } else {
    cache_.replayed();
  }
  cudaGraphDestroy(g);
  check(cudaGraphLaunch(exec, stream_), "launching a decode step's graph");
  return true;
}

void step_graphs::abort() {
  if (!capturing_) return;
  capturing_ = false;
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(stream_, &g);
  if (g != nullptr) cudaGraphDestroy(g);
  cudaGetLastError();
  cache_.failed(key_);
}

}  // namespace tandem::backend::cuda_detail
