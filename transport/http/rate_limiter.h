#pragma once
/// Per-client token buckets for the HTTP front end (limits.rate_limit_rps / _burst): a client
/// is its bearer token if it sends one, else its address. The table is bounded
/// (limits.rate_limit_max_clients): the least recently seen client is dropped first, which
/// only forgets its bucket (it starts full again). Time is passed in, so tests drive it.
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>

namespace tandem::transport {

class rate_limiter {
 public:
  /// rps 0 = off (every request allowed). burst 0 = rps (at least 1).
  rate_limiter(int32_t rps, int32_t burst, int32_t max_clients);

  struct verdict {
    bool allowed = true;
    int64_t retry_after_ms = 0;  ///< when refused: until the bucket holds one token again
  };
  /// Takes one token from `client`'s bucket at time `now_ms`.
  verdict take(const std::string& client, int64_t now_ms);

  bool enabled() const { return rps_ > 0; }
  size_t clients() const { return buckets_.size(); }
  int64_t refused() const { return refused_; }
  int64_t evicted() const { return evicted_; }

 private:
  struct bucket {
    double tokens = 0;
    int64_t last_ms = 0;
    std::list<std::string>::iterator lru;
  };
  double rps_;
  double burst_;
  size_t max_clients_;
  std::unordered_map<std::string, bucket> buckets_;
  std::list<std::string> lru_;  ///< front = most recently seen
  int64_t refused_ = 0, evicted_ = 0;
};

/// The rate-limit key of a request: "key:<hash of the bearer token>" if the Authorization
/// header is `Bearer <token>` (the token itself is not kept), else "addr:<peer address>".
std::string rate_limit_key(const std::string& authorization, const std::string& peer_address);

}  // namespace tandem::transport
