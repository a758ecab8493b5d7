#include "transport/http/rate_limiter.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>

namespace tandem::transport {

rate_limiter::rate_limiter(int32_t rps, int32_t burst, int32_t max_clients)
    : rps_(std::max(0, rps)),
      burst_(burst > 0 ? burst : std::max(1, rps)),
      max_clients_(static_cast<size_t>(std::max(1, max_clients))) {}

rate_limiter::verdict rate_limiter::take(const std::string& client, int64_t now_ms) {
  if (rps_ <= 0) return {};
  auto it = buckets_.find(client);
  if (it == buckets_.end()) {
    while (buckets_.size() >= max_clients_ && !lru_.empty()) {
      buckets_.erase(lru_.back());
      lru_.pop_back();
      ++evicted_;
    }
    lru_.push_front(client);
    it = buckets_.emplace(client, bucket{burst_, now_ms, lru_.begin()}).first;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  auto& b = it->second;
  const int64_t dt = std::max<int64_t>(0, now_ms - b.last_ms);
  b.tokens = std::min(burst_, b.tokens + double(dt) * rps_ / 1000.0);
  b.last_ms = std::max(b.last_ms, now_ms);
  if (b.tokens >= 1.0) {
    b.tokens -= 1.0;
    return {};
  }
  ++refused_;
  return {false, static_cast<int64_t>(std::ceil((1.0 - b.tokens) * 1000.0 / rps_))};
}

std::string rate_limit_key(const std::string& authorization, const std::string& peer_address) {
  constexpr std::string_view bearer = "Bearer ";
  if (authorization.size() > bearer.size() && authorization.compare(0, bearer.size(), bearer) == 0)
    return fmt::format("key:{:016x}", std::hash<std::string>{}(authorization.substr(bearer.size())));
  return "addr:" + peer_address;
}

}  // namespace tandem::transport
