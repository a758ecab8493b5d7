#pragma once
/// Which decode steps a device backend runs as a captured graph (CUDA graphs), as plain logic:
/// steps are keyed by their shape (batch size, context bucket); the first step of a key runs
/// eagerly (it grows every buffer to the key's size, so a capture never allocates), later ones
/// are captured and replayed through the key's graph; a key whose capture failed runs eagerly
/// from then on. At most `max_graphs` graphs are kept (least recently used goes first) and the
/// keys remembered are bounded too. The graph itself is an opaque handle the owner destroys.
#include <cstdint>
#include <functional>
#include <list>
#include <unordered_map>

namespace tandem::backend {

/// The shape of a decode step as far as its graph's topology goes.
struct graph_key {
  int32_t batch = 0;        ///< sequences (one new token each)
  int32_t ctx_bucket = 0;   ///< context_bucket of the longest sequence
  bool operator==(const graph_key&) const = default;
};

/// The bucket of a step whose longest sequence attends `positions` positions: the next power
/// of two from 256 (so a bucket spans at most a doubling of the context).
int32_t context_bucket(int32_t positions);

/// Counters of a graph cache (exported by the backend, printed by the GPU check).
struct graph_stats {
  uint64_t eager = 0;      ///< steps run without a graph (a key's first step, failed keys)
  uint64_t captures = 0;   ///< graphs made (a first capture, or a re-instantiation)
  uint64_t replays = 0;    ///< steps that ran through a kept graph
  uint64_t evictions = 0;  ///< graphs dropped for the bound
  uint64_t failures = 0;   ///< keys whose capture failed (they run eagerly after)
  uint64_t graphs = 0;     ///< graphs kept now
};

class graph_cache {
 public:
  enum class action { eager, capture };
  /// `destroy` frees a handle the cache drops (eviction, replacement, destruction).
  graph_cache(size_t max_graphs, std::function<void(void*)> destroy);
  ~graph_cache();
  graph_cache(const graph_cache&) = delete;
  graph_cache& operator=(const graph_cache&) = delete;

  /// What to do with a step of key `k`: eager for a new key (then remembered), a failed key,
  /// or a cache of 0 graphs; capture otherwise (the step is recorded, then run through the
  /// key's graph: graph(k) when kept, else a new one given to keep()).
  action on_step(const graph_key& k);
  /// The key's graph (null if none); marks it most recently used.
  void* graph(const graph_key& k);
  /// Keeps `g` as k's graph (replacing and destroying an older one), evicting the least
  /// recently used graph beyond the bound.
  void keep(const graph_key& k, void* g);
  /// Counts a step run through k's graph.
  void replayed() { ++stats_.replays; }
  /// The capture of k failed: its graph (if any) is dropped and k runs eagerly from now on.
  void failed(const graph_key& k);
  graph_stats stats() const;
  size_t max_graphs() const { return max_; }

 private:
  struct hash {
    size_t operator()(const graph_key& k) const { return std::hash<int64_t>()((int64_t(k.batch) << 32) ^ k.ctx_bucket); }
  };
  enum class state { seen, failed };
  void drop(const graph_key& k);

  size_t max_;
  std::function<void(void*)> destroy_;
  /// Keys seen or failed (bounded: forgotten wholesale past max_keys, so a key may warm again).
  std::unordered_map<graph_key, state, hash> keys_;
  std::list<std::pair<graph_key, void*>> lru_;  ///< most recent first
  std::unordered_map<graph_key, std::list<std::pair<graph_key, void*>>::iterator, hash> graphs_;
  graph_stats stats_;
  static constexpr size_t max_keys = 4096;
};

}  // namespace tandem::backend
