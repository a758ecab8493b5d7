#include "actors/router/router_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tandem {

std::optional<route_policy_kind> parse_route_policy(std::string_view name) {
  if (name == "round_robin") return route_policy_kind::round_robin;
  if (name == "power_of_two") return route_policy_kind::power_of_two;
  if (name == "cache_aware") return route_policy_kind::cache_aware;
  return std::nullopt;
}

std::string_view to_string(route_policy_kind k) {
  switch (k) {
    case route_policy_kind::round_robin: return "round_robin";
    case route_policy_kind::power_of_two: return "power_of_two";
    case route_policy_kind::cache_aware: return "cache_aware";
  }
  return "round_robin";
}

// ---- prefix_index

prefix_index::prefix_index(int32_t block_tokens, int32_t max_nodes)
    : block_(std::max(1, block_tokens)), max_nodes_(static_cast<size_t>(std::max(1, max_nodes))) {}

std::vector<uint64_t> prefix_index::chain(std::span<const int32_t> prompt) const {
  std::vector<uint64_t> out;
  const size_t blocks = prompt.size() / static_cast<size_t>(block_);
  out.reserve(blocks);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t b = 0; b < blocks; ++b) {
    for (int32_t i = 0; i < block_; ++i) {
      // FNV-1a over the token bytes, chained: the hash names the whole prefix, not the block.
      uint32_t t = static_cast<uint32_t>(prompt[b * static_cast<size_t>(block_) + static_cast<size_t>(i)]);
      for (int k = 0; k < 4; ++k) {
        h ^= (t >> (8 * k)) & 0xffu;
        h *= 0x100000001b3ull;
      }
    }
    out.push_back(h ^ (h >> 29));
  }
  return out;
}

int32_t prefix_index::match(std::span<const int32_t> prompt, int target) const {
  if (target < 0 || target >= 64) return 0;
  const uint64_t bit = uint64_t(1) << target;
  int32_t n = 0;
  for (uint64_t h : chain(prompt)) {
    auto it = nodes_.find(h);
    if (it == nodes_.end() || !(it->second.targets & bit)) break;
    n += block_;
  }
  return n;
}

std::vector<int32_t> prefix_index::match_all(std::span<const int32_t> prompt, int n_targets) const {
  std::vector<int32_t> out(static_cast<size_t>(std::max(0, n_targets)), 0);
  uint64_t alive = n_targets >= 64 ? ~uint64_t(0) : (uint64_t(1) << std::max(0, n_targets)) - 1;
  int32_t depth = 0;
  for (uint64_t h : chain(prompt)) {
    auto it = nodes_.find(h);
    if (it == nodes_.end()) break;
    alive &= it->second.targets;
    if (!alive) break;
    depth += block_;
    for (int t = 0; t < n_targets && t < 64; ++t)
      if (alive & (uint64_t(1) << t)) out[static_cast<size_t>(t)] = depth;
  }
  return out;
}

void prefix_index::insert(std::span<const int32_t> prompt, int target) {
  if (target < 0 || target >= 64) return;
  const uint64_t bit = uint64_t(1) << target;
  for (uint64_t h : chain(prompt)) {
    auto it = nodes_.find(h);
    if (it != nodes_.end()) {
      it->second.targets |= bit;
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      continue;
    }
    while (nodes_.size() >= max_nodes_ && !lru_.empty()) {
      nodes_.erase(lru_.back());
      lru_.pop_back();
      ++evictions_;
    }
    lru_.push_front(h);
    nodes_.emplace(h, node{bit, lru_.begin()});
  }
}

void prefix_index::forget(int target) {
  if (target < 0 || target >= 64) return;
  const uint64_t bit = uint64_t(1) << target;
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    it->second.targets &= ~bit;
    if (it->second.targets == 0) {
      lru_.erase(it->second.lru);
      it = nodes_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- route_policy

route_policy::route_policy(route_policy_options opt, uint64_t seed)
    : opt_(opt), rng_(seed), index_(opt.block_tokens, opt.max_index_nodes) {}

int route_policy::least_loaded(const std::vector<target_load>& loads, const std::vector<bool>& eligible) const {
  int best = -1;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (i < eligible.size() && !eligible[i]) continue;
    if (best < 0 || loads[i].queued_tokens < loads[static_cast<size_t>(best)].queued_tokens) best = int(i);
  }
  return best;
}

int route_policy::choose_prefill(std::span<const int32_t> prompt, const std::vector<target_load>& loads,
                                 const std::vector<bool>& eligible, int32_t* cached_tokens) {
  if (cached_tokens) *cached_tokens = 0;
  std::vector<int> ok;
  for (size_t i = 0; i < loads.size(); ++i)
    if (i >= eligible.size() || eligible[i]) ok.push_back(int(i));
  if (ok.empty()) return -1;
  if (ok.size() == 1) {
    if (cached_tokens && opt_.kind == route_policy_kind::cache_aware) *cached_tokens = index_.match(prompt, ok[0]);
    return ok[0];
  }
  switch (opt_.kind) {
    case route_policy_kind::round_robin: {
      // Next eligible target after the previous choice.
      for (size_t k = 0; k < loads.size(); ++k) {
        size_t i = (rr_prefill_ + k) % loads.size();
        if (i >= eligible.size() || eligible[i]) {
          rr_prefill_ = i + 1;
          return int(i);
        }
      }
      return -1;
    }
    case route_policy_kind::power_of_two: {
      std::uniform_int_distribution<size_t> d(0, ok.size() - 1);
      const size_t a = d(rng_);
      size_t b = d(rng_);
      if (b == a) b = (a + 1 + d(rng_) % (ok.size() - 1)) % ok.size();
      const int ta = ok[a], tb = ok[b];
      return loads[size_t(tb)].queued_tokens < loads[size_t(ta)].queued_tokens ? tb : ta;
    }
    case route_policy_kind::cache_aware: {
      auto matched = index_.match_all(prompt, int(loads.size()));
      const int low = least_loaded(loads, eligible);
      int best = -1;
      for (int t : ok) {
        if (best < 0 || matched[size_t(t)] > matched[size_t(best)] ||
            (matched[size_t(t)] == matched[size_t(best)] &&
             loads[size_t(t)].queued_tokens < loads[size_t(best)].queued_tokens))
          best = t;
      }
      if (matched[size_t(best)] == 0) best = low;  // nothing cached anywhere: balance
      const int64_t lb = loads[size_t(best)].queued_tokens, ll = loads[size_t(low)].queued_tokens;
      const bool over_abs = lb - ll > opt_.balance_abs_tokens;
      const bool over_rel = double(lb) > opt_.balance_rel * double(std::max<int64_t>(ll, 1));
      if (best != low && over_abs && over_rel) {
        ++balance_fallbacks_;
        best = low;
      }
      if (cached_tokens) *cached_tokens = matched[size_t(best)];
      return best;
    }
  }
  return -1;
}

int route_policy::choose_decode(const std::vector<target_load>& loads, const std::vector<bool>& eligible) {
  if (opt_.kind == route_policy_kind::round_robin) {
    for (size_t k = 0; k < loads.size(); ++k) {
      size_t i = (rr_decode_ + k) % loads.size();
      if (i >= eligible.size() || eligible[i]) {
        rr_decode_ = i + 1;
        return int(i);
      }
    }
    return -1;
  }
  int best = -1;
  for (size_t i = 0; i < loads.size(); ++i) {
    if (i < eligible.size() && !eligible[i]) continue;
    if (best < 0) {
      best = int(i);
      continue;
    }
    const auto& a = loads[i];
    const auto& b = loads[size_t(best)];
    const int32_t la = a.running_seqs + a.waiting_seqs, lb = b.running_seqs + b.waiting_seqs;
    if (la < lb || (la == lb && a.free_pages > b.free_pages)) best = int(i);
  }
  return best;
}

void route_policy::on_routed(std::span<const int32_t> prompt, int t) {
  if (opt_.kind == route_policy_kind::cache_aware) index_.insert(prompt, t);
}

// ---- conditional disaggregation

int64_t estimate_queue_wait_ms(int64_t queued_tokens, double tokens_per_s) {
  if (tokens_per_s <= 0) return -1;
  if (queued_tokens <= 0) return 0;
  return static_cast<int64_t>(std::ceil(double(queued_tokens) * 1000.0 / tokens_per_s));
}

bool prefill_locally(const local_prefill_rule& rule, int32_t prompt_tokens, int32_t cached_tokens,
                     int64_t shortest_queue_wait_ms, const target_load& decode) {
  if (rule.max_uncached_tokens <= 0) return false;
  const int32_t uncached = std::max(0, prompt_tokens - cached_tokens);
  if (uncached > rule.max_uncached_tokens) return false;
  if (shortest_queue_wait_ms < rule.min_queue_wait_ms) return false;  // also -1: unknown = not long
  const int32_t slots = decode.max_running_seqs - decode.running_seqs - decode.waiting_seqs;
  return slots >= rule.min_free_batch_slots;
}

bool fits_next_batch(const limits& lim, int64_t queued_requests, int64_t backlog_tokens, int64_t prompt_tokens) {
  if (queued_requests <= 0 && backlog_tokens <= 0) return true;
  return queued_requests + 1 <= std::max(lim.max_prefill_batch_seqs, 1) &&
         backlog_tokens + prompt_tokens <= std::max(lim.prefill_chunk_tokens, 1);
}

// ---- backoff

int64_t backoff_policy::delay_ms(int32_t attempt, std::mt19937_64& rng) const {
  const int32_t a = std::clamp(attempt, 1, 30);
  const int64_t d = std::min<int64_t>(int64_t(max_ms), int64_t(base_ms) << (a - 1));
  if (d <= 1) return std::max<int64_t>(d, 0);
  std::uniform_int_distribution<int64_t> j(d / 2, d);
  return j(rng);
}

// ---- circuit_breaker

circuit_breaker::state circuit_breaker::current(int64_t now_ms) const {
  if (st_ == state::open && now_ms - opened_ms_ >= cooldown_ms_) return state::half_open;
  return st_;
}

bool circuit_breaker::would_allow(int64_t now_ms) const {
  switch (current(now_ms)) {
    case state::closed: return true;
    case state::open: return false;
    case state::half_open: return !(st_ == state::half_open && probe_out_);
  }
  return true;
}

bool circuit_breaker::allow(int64_t now_ms) {
  const state s = current(now_ms);
  if (s == state::closed) return true;
  if (s == state::open) return false;
  if (st_ != state::half_open) {
    st_ = state::half_open;
    probe_out_ = false;
  }
  if (probe_out_) return false;
  probe_out_ = true;
  return true;
}

void circuit_breaker::on_success() {
  st_ = state::closed;
  failures_ = 0;
  probe_out_ = false;
}

void circuit_breaker::on_failure(int64_t now_ms) {
  if (st_ == state::half_open) {  // the probe failed
    st_ = state::open;
    opened_ms_ = now_ms;
    probe_out_ = false;
    ++opens_;
    return;
  }
  if (st_ == state::open) return;
  if (++failures_ >= threshold_) {
    st_ = state::open;
    opened_ms_ = now_ms;
    ++opens_;
  }
}

std::string_view to_string(circuit_breaker::state s) {
  switch (s) {
    case circuit_breaker::state::closed: return "closed";
    case circuit_breaker::state::open: return "open";
    case circuit_breaker::state::half_open: return "half_open";
  }
  return "closed";
}

}  // namespace tandem
