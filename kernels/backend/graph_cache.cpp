#include "kernels/backend/graph_cache.h"

#include <iterator>

namespace tandem::backend {

int32_t context_bucket(int32_t positions) {
  int32_t b = 256;
  while (b < positions && b < (int32_t(1) << 30)) b *= 2;
  return b;
}

graph_cache::graph_cache(size_t max_graphs, std::function<void(void*)> destroy)
    : max_(max_graphs), destroy_(std::move(destroy)) {}

graph_cache::~graph_cache() {
  for (auto& [k, g] : lru_) destroy_(g);
}

graph_cache::action graph_cache::on_step(const graph_key& k) {
  if (max_ == 0) {
    ++stats_.eager;
    return action::eager;
  }
  auto it = keys_.find(k);
  if (it == keys_.end()) {
    if (keys_.size() >= max_keys) {
      // Forget the keys without a graph; a forgotten one warms up again on its next step.
      for (auto i = keys_.begin(); i != keys_.end();) i = graphs_.count(i->first) != 0 ? std::next(i) : keys_.erase(i);
    }
    keys_.emplace(k, state::seen);
    ++stats_.eager;
    return action::eager;
  }
  if (it->second == state::failed) {
    ++stats_.eager;
    return action::eager;
  }
  return action::capture;
}

void* graph_cache::graph(const graph_key& k) {
  auto it = graphs_.find(k);
  if (it == graphs_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

void graph_cache::keep(const graph_key& k, void* g) {
  ++stats_.captures;
  auto it = graphs_.find(k);
  if (it != graphs_.end()) {
    if (it->second->second != g) destroy_(it->second->second);
    it->second->second = g;
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  lru_.emplace_front(k, g);
  graphs_[k] = lru_.begin();
  while (lru_.size() > max_) {
    ++stats_.evictions;
    graphs_.erase(lru_.back().first);
    destroy_(lru_.back().second);
    lru_.pop_back();
  }
}

void graph_cache::drop(const graph_key& k) {
  auto it = graphs_.find(k);
  if (it == graphs_.end()) return;
  destroy_(it->second->second);
  lru_.erase(it->second);
  graphs_.erase(it);
}

void graph_cache::failed(const graph_key& k) {
  ++stats_.failures;
  drop(k);
  keys_[k] = state::failed;
}

graph_stats graph_cache::stats() const {
  graph_stats s = stats_;
  s.graphs = lru_.size();
  return s;
}

}  // namespace tandem::backend
