#pragma once
// Test support for the actor layer: a deterministic fake llama_model, a forward gate that
// pauses the worker at a chosen call, and an event collector to wait on.
#include <doctest/doctest.h>
#include <spdlog/sinks/null_sink.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "kernels/base/error.h"
#include "actors/runtime/actor_cluster.h"
#include "kernels/model/llama.h"

namespace tandem::test {

/// Set by a rig on the test scheduler for its lifetime (tests/actors/cluster_rig.h): how the waits
/// below run the actors when they have no pump of their own, and whether a worker's job waits
/// (held by a forward gate).
struct scheduler_hooks {
  std::function<bool(const std::function<bool()>&, const std::string&)> pump;
  std::function<bool()> worker_waiting;
};
inline scheduler_hooks& current_scheduler() {
  static scheduler_hooks h;
  return h;
}

/// Pauses the forward call number `pause_at` (0-based) until release(). On the test scheduler
/// nothing blocks: the rig holds the worker's jobs while holds() (its next forward pass would be
/// `pause_at`), and wait_paused() runs the actors until a worker job waits there.
struct forward_gate {
  std::mutex m;
  std::condition_variable cv;
  int pause_at = -1;
  bool paused = false;
  bool released = false;
  int calls = 0;

  forward_gate() { live().insert(this); }
  ~forward_gate() { live().erase(this); }
  forward_gate(const forward_gate&) = delete;
  forward_gate& operator=(const forward_gate&) = delete;
  /// Every gate in the process (a rig on the test scheduler asks them whether to hold the worker).
  static std::set<forward_gate*>& live() {
    static std::set<forward_gate*> gates;
    return gates;
  }
  bool holds() {
    std::lock_guard lk(m);
    return pause_at >= 0 && calls >= pause_at && !released;
  }

  void on_forward() {
    std::unique_lock lk(m);
    int c = calls++;
    if (c != pause_at) return;
    paused = true;
    cv.notify_all();
    cv.wait(lk, [&] { return released; });
  }
  bool wait_paused(std::chrono::milliseconds t = std::chrono::milliseconds(20000)) {
    if (auto& h = current_scheduler(); h.pump)
      return h.pump([&] { return holds() && h.worker_waiting(); },
                    "the worker held before forward pass " + std::to_string(pause_at));
    std::unique_lock lk(m);
    return cv.wait_for(lk, t, [&] { return paused; });
  }
  void release() {
    std::lock_guard lk(m);
    released = true;
    cv.notify_all();
  }
};

/// Deterministic model: K of each position stores (token, position); the next token is
/// (last token + 1 + sum of every stored token) % n_vocab, read back from the pages, so a
/// wrong page table, a bad handoff or a stale cached page changes (or fails) the output.
class fake_model : public llama_model {
 public:
  explicit fake_model(std::shared_ptr<forward_gate> gate = nullptr, int32_t n_vocab = 64, int32_t n_ctx = 512)
      : gate_(std::move(gate)) {
    cfg_.name = "fake";
    cfg_.n_vocab = n_vocab;
    cfg_.n_embd = 8;
    cfg_.n_layer = 1;
    cfg_.n_head = 1;
    cfg_.n_head_kv = 1;
    cfg_.head_dim = 4;
    cfg_.n_ctx = n_ctx;
  }
  const model_config& config() const override { return cfg_; }
  kv_layout layout(int32_t page_size) const override { return kv_layout{1, 1, 4, page_size}; }
  void forward(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>& logits) override {
    kv_pool& pool = pools[0];
    if (gate_) gate_->on_forward();
    const int32_t ps = pool.layout().page_size;
    const int32_t V = cfg_.n_vocab;
    logits.clear();
    for (const auto& s : batch) {
      for (size_t i = 0; i < s.tokens.size(); ++i) {
        const int32_t p = s.pos + static_cast<int32_t>(i);
        float* k = pool.k(s.pages[static_cast<size_t>(p / ps)], 0) + size_t(p % ps) * 4;
        k[0] = float(s.tokens[i]);
        k[1] = float(p);
        k[2] = 1.0f;
      }
      if (!s.want_logits) continue;
      const int32_t last_pos = s.pos + static_cast<int32_t>(s.tokens.size()) - 1;
      int64_t sum = 0;
      for (int32_t q = 0; q <= last_pos; ++q) {
        const float* k = pool.k(s.pages[static_cast<size_t>(q / ps)], 0) + size_t(q % ps) * 4;
        if (k[1] != float(q) || k[2] != 1.0f)
          throw tandem::error(error_kind::failed, "fake model: KV page content does not match its position");
        sum += int64_t(k[0]);
      }
      const int32_t h = static_cast<int32_t>((int64_t(s.tokens.back()) + 1 + sum) % V);
      for (int32_t j = 0; j < V; ++j) logits.push_back(j == h ? 8.0f : float((j * 7) % 13) / 4.0f);
    }
  }

 private:
  model_config cfg_;
  std::shared_ptr<forward_gate> gate_;
};

/// Greedy output of fake_model (its default 64-token vocabulary) for `prompt`, computed
/// directly from the same rule, so cluster tests compare against something independent.
inline std::vector<int32_t> expected_greedy(std::vector<int32_t> prompt, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    int64_t sum = 0;
    for (auto t : prompt) sum += t;
    int32_t h = static_cast<int32_t>((int64_t(prompt.back()) + 1 + sum) % 64);
    out.push_back(h);
    prompt.push_back(h);
  }
  return out;
}

/// Collects events per request; wait for finished ones with a generous timeout, or (on the
/// test scheduler) by running the actors until they are in.
struct collector {
  std::mutex m;
  std::condition_variable cv;
  std::map<std::string, std::vector<token_event>> events;
  int finished = 0;
  int duplicate_finishes = 0;
  std::function<void(const token_event&)> on_event;
  /// Set by a rig on the test scheduler (test_system::run_until): the waits below run the
  /// actors until their condition holds instead of blocking on `cv` (the timeouts then unused).
  std::function<bool(const std::function<bool()>&, const std::string&)> pump;

  event_callback cb() {
    return [this](token_event ev) {
      std::lock_guard lk(m);
      auto& v = events[ev.request_id];
      if (!v.empty() && v.back().finished) ++duplicate_finishes;
      if (ev.finished) ++finished;
      if (on_event) on_event(ev);
      v.push_back(std::move(ev));
      cv.notify_all();
    };
  }
  bool wait_finished(int n, std::chrono::milliseconds t = std::chrono::milliseconds(30000)) {
    auto ok = [&] { return finished >= n; };
    if (auto& p = pump ? pump : current_scheduler().pump) return p(locked(ok), std::to_string(n) + " finished requests");
    std::unique_lock lk(m);
    return cv.wait_for(lk, t, ok);
  }
  bool wait_tokens(const std::string& id, size_t n,
                   std::chrono::milliseconds t = std::chrono::milliseconds(30000)) {
    auto ok = [&] {
      size_t c = 0;
      for (auto& e : events[id]) c += e.tokens.size();
      return c >= n;
    };
    if (auto& p = pump ? pump : current_scheduler().pump) return p(locked(ok), std::to_string(n) + " tokens of " + id);
    std::unique_lock lk(m);
    return cv.wait_for(lk, t, ok);
  }
  /// `ok` evaluated with `m` held (as the condition-variable waits evaluate it).
  template <class F>
  std::function<bool()> locked(F ok) {
    return [this, ok] {
      std::lock_guard lk(m);
      return ok();
    };
  }
  std::vector<int32_t> tokens(const std::string& id) {
    std::lock_guard lk(m);
    std::vector<int32_t> out;
    for (auto& e : events[id]) out.insert(out.end(), e.tokens.begin(), e.tokens.end());
    return out;
  }
  token_event last(const std::string& id) {
    std::lock_guard lk(m);
    return events[id].back();
  }
};

inline std::shared_ptr<spdlog::sinks::sink> quiet_sink() {
  return std::make_shared<spdlog::sinks::null_sink_mt>();
}

inline limits small_limits() {
  limits l;
  l.page_size = 4;
  l.device_pages = 64;
  l.prefill_chunk_tokens = 16;
  l.scheduler_threads = 2;
  return l;
}

inline completion_request make_req(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens,
                                   float temperature = 0.0f, uint64_t seed = 0) {
  completion_request r;
  r.request_id = id;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  r.ignore_eos = true;
  return r;
}

/// Polls the cluster until `pred(stats)` holds (state changes land asynchronously after
/// the finished event); bounded, checks the condition each round.
template <class Pred>
bool wait_stats(const actor_cluster& c, Pred pred,
                std::chrono::milliseconds t = std::chrono::milliseconds(20000)) {
  auto until = std::chrono::steady_clock::now() + t;
  while (std::chrono::steady_clock::now() < until) {
    if (pred(c.stats())) return true;
    std::this_thread::yield();
  }
  return pred(c.stats());
}

}  // namespace tandem::test
