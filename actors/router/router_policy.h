#pragma once
/// Routing logic of the router, kept free of actors so it can be tested with a seeded RNG and
/// a manual clock: which prefill target and which decode target a request goes to
/// (round_robin, power_of_two, cache_aware), whether a short uncached prompt should be
/// prefilled locally on its decode node (conditional disaggregation), how fresh each target's
/// credits are (health), how long to back off before a retry, and a per-target circuit
/// breaker. Every table here is bounded.
#include <cstdint>
#include <list>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "actors/common/limits.h"

namespace tandem {

/// What a target last reported in its credits (queue of a prefill target, batch and pages of
/// a decode target), plus what the router sent it since (in transit).
struct target_load {
  int64_t queued_requests = 0;
  int64_t queued_tokens = 0;       ///< prompt tokens waiting (incl. in transit)
  double prefill_tokens_per_s = 0; ///< measured drain rate; 0 = not measured yet
  int64_t free_pages = -1;         ///< decode: KV pages free at the last allocation; -1 = unknown
  int32_t running_seqs = 0;        ///< decode: sequences in the batch
  int32_t waiting_seqs = 0;        ///< decode: handed off, waiting for a batch slot
  int32_t max_running_seqs = 0;    ///< decode: limits.max_running_seqs of the target
};

enum class route_policy_kind : uint8_t { round_robin, power_of_two, cache_aware };

/// "round_robin" | "power_of_two" | "cache_aware"; nullopt for anything else.
std::optional<route_policy_kind> parse_route_policy(std::string_view name);
std::string_view to_string(route_policy_kind k);

struct route_policy_options {
  route_policy_kind kind = route_policy_kind::round_robin;
  /// cache_aware: a target with the longest cached prefix is taken only if its queued tokens
  /// exceed the least loaded target's by at most balance_abs_tokens OR at most balance_rel
  /// times; beyond both, the least loaded target gets the request (a hot prefix must not
  /// overload one worker).
  int64_t balance_abs_tokens = 2048;
  double balance_rel = 1.5;
  int32_t block_tokens = 16;         ///< prefix granularity of the index (one KV page)
  int32_t max_index_nodes = 65536;   ///< bound of the prefix index (LRU beyond)
};

/// Approximate radix tree of the token prefixes each target has seen: one node per block of
/// `block_tokens` tokens, keyed by the chain hash of the prefix ending with that block, with
/// the set of targets (bit per target, up to 64) that have it. Bounded: the least recently
/// used node goes first. "Approximate": a hash collision or an evicted inner node only makes
/// a match shorter or longer than the truth; it costs a cache miss, never correctness.
class prefix_index {
 public:
  prefix_index(int32_t block_tokens, int32_t max_nodes);
  /// Longest prefix (tokens, multiple of block_tokens) of `prompt` that `target` has seen.
  int32_t match(std::span<const int32_t> prompt, int target) const;
  /// For each of `n_targets`, the matched prefix length.
  std::vector<int32_t> match_all(std::span<const int32_t> prompt, int n_targets) const;
  /// Records that `target` has (or will have) the prefixes of `prompt` cached.
  void insert(std::span<const int32_t> prompt, int target);
  /// Forgets a target (it restarted: its cache is empty).
  void forget(int target);
  size_t size() const { return nodes_.size(); }
  int64_t evictions() const { return evictions_; }

 private:
  struct node {
    uint64_t targets = 0;
    std::list<uint64_t>::iterator lru;
  };
  std::vector<uint64_t> chain(std::span<const int32_t> prompt) const;
  int32_t block_;
  size_t max_nodes_;
  std::unordered_map<uint64_t, node> nodes_;
  std::list<uint64_t> lru_;  ///< front = most recent
  int64_t evictions_ = 0;
};

/// Chooses targets. `eligible[i]` false = skip target i (unhealthy, breaker open, tried).
class route_policy {
 public:
  route_policy(route_policy_options opt, uint64_t seed);
  /// A prefill target for `prompt`, or -1 if none is eligible. `cached_tokens` (if set)
  /// receives the prefix length the index expects the chosen target to have.
  int choose_prefill(std::span<const int32_t> prompt, const std::vector<target_load>& loads,
                     const std::vector<bool>& eligible, int32_t* cached_tokens = nullptr);
  /// A decode target (fewest running + waiting sequences, ties by most free pages; round
  /// robin under round_robin), or -1.
  int choose_decode(const std::vector<target_load>& loads, const std::vector<bool>& eligible);
  /// The request went to prefill target `t`: remember its prefix (cache_aware).
  void on_routed(std::span<const int32_t> prompt, int t);
  /// Target `t` lost its cache (restart).
  void forget(int t) { index_.forget(t); }
  const route_policy_options& options() const { return opt_; }
  const prefix_index& index() const { return index_; }
  /// Cache-aware choices overridden by the balance thresholds.
  int64_t balance_fallbacks() const { return balance_fallbacks_; }

 private:
  int least_loaded(const std::vector<target_load>& loads, const std::vector<bool>& eligible) const;
  route_policy_options opt_;
  std::mt19937_64 rng_;
  prefix_index index_;
  size_t rr_prefill_ = 0, rr_decode_ = 0;
  int64_t balance_fallbacks_ = 0;
};

/// Conditional disaggregation: a short prompt with little cached is prefilled on its decode
/// node (no KV transfer) when the prefill queues are long, since its transfer and queueing
/// cost more than computing it next to the decode batch.
struct local_prefill_rule {
  int32_t max_uncached_tokens = 256;  ///< prompts with more uncached tokens go to prefill; 0 = never local
  int64_t min_queue_wait_ms = 200;    ///< ... unless the shortest prefill queue waits at least this long (-1: always)
  int32_t min_free_batch_slots = 1;   ///< the decode target must have this many free batch slots
};

/// True if the request should be prefilled on its decode target.
/// `shortest_queue_wait_ms`: estimated wait of the least loaded prefill target (-1 unknown).
bool prefill_locally(const local_prefill_rule& rule, int32_t prompt_tokens, int32_t cached_tokens,
                     int64_t shortest_queue_wait_ms, const target_load& decode);

/// Estimated queue wait (ms) of a prefill target with `queued_tokens` waiting, at the
/// measured rate; -1 if the rate is not measured yet.
int64_t estimate_queue_wait_ms(int64_t queued_tokens, double tokens_per_s);

/// Admission by queue wait refuses only beyond a short queue: true while the request would
/// go into the target's next prefill batch anyway (at most `prefill_chunk_tokens` tokens and
/// fewer than `max_prefill_batch_seqs` requests ahead, itself included), where waiting longer
/// cannot be the queue's fault and the estimate's noise (a drain rate measured on few
/// batches) would otherwise refuse at normal load. An empty queue always admits, so a prompt
/// that alone takes longer than the bound is still servable.
bool fits_next_batch(const limits& lim, int64_t queued_requests, int64_t backlog_tokens, int64_t prompt_tokens);

/// Retry delays: exponential from base_ms, capped at max_ms, with full jitter in
/// [delay/2, delay] from the injected RNG (retries of a burst must not arrive in lockstep).
struct backoff_policy {
  int32_t max_retries = 2;
  int32_t base_ms = 5;
  int32_t max_ms = 200;
  /// Delay before retry number `attempt` (1-based).
  int64_t delay_ms(int32_t attempt, std::mt19937_64& rng) const;
};

/// Per-target circuit breaker on the injected clock: closed; open after `failure_threshold`
/// consecutive failures (no traffic); half-open once `cooldown_ms` passed (one probe
/// request); the probe's success closes it, its failure opens it again.
class circuit_breaker {
 public:
  enum class state : uint8_t { closed, open, half_open };
  circuit_breaker(int32_t failure_threshold = 5, int64_t cooldown_ms = 1000)
      : threshold_(failure_threshold), cooldown_ms_(cooldown_ms) {}
  /// May a request go to the target now? In half-open, true once (the probe) until it ends.
  bool allow(int64_t now_ms);
  /// Like allow() but without taking the probe slot (for eligibility scans).
  bool would_allow(int64_t now_ms) const;
  void on_success();
  void on_failure(int64_t now_ms);
  state current(int64_t now_ms) const;
  int64_t opens() const { return opens_; }

 private:
  int32_t threshold_;
  int64_t cooldown_ms_;
  state st_ = state::closed;
  int32_t failures_ = 0;
  int64_t opened_ms_ = 0;
  bool probe_out_ = false;
  int64_t opens_ = 0;
};

std::string_view to_string(circuit_breaker::state s);

/// Credit freshness of a target: healthy while its last credit (or heartbeat answer) is at
/// most `stale_ms` old.
class target_health {
 public:
  explicit target_health(int64_t stale_ms = 3000) : stale_ms_(stale_ms) {}
  void on_credit(int64_t now_ms) { last_ms_ = now_ms; seen_ = true; }
  /// A target never heard from counts as healthy (it was just wired) until stale_ms after `since_ms`.
  bool healthy(int64_t now_ms, int64_t since_ms) const {
    return now_ms - (seen_ ? last_ms_ : since_ms) <= stale_ms_;
  }
  int64_t age_ms(int64_t now_ms, int64_t since_ms) const { return now_ms - (seen_ ? last_ms_ : since_ms); }

 private:
  int64_t stale_ms_;
  int64_t last_ms_ = 0;
  bool seen_ = false;
};

}  // namespace tandem
