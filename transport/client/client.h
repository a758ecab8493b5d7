#pragma once
/// C++ client of a Tandem node over Cap'n Proto RPC (schemas/api.capnp). Synchronous: each
/// call runs the client's own kj event loop on the calling thread until it completes, so a
/// client must be used from one thread, and that thread must not already run a kj loop.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/base/error.h"

namespace tandem {

struct client_params {
  int32_t max_tokens = 16;
  float temperature = 1.0f;  ///< 0 = greedy
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  /// Log-probabilities of each generated token (client_result::logprobs) with this many
  /// alternatives (0 to 20); -1 = none.
  int32_t logprobs = -1;
};

/// A generated token's log-probability (natural log; -inf when it underflows) and the
/// request's number of most likely alternatives, most likely first.
struct client_token_logprobs {
  struct entry {
    int32_t token = -1;
    float logprob = 0.0f;
  };
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<entry> top;
};

struct client_result {
  std::string request_id;
  std::string text;             ///< the whole completion
  std::vector<int32_t> tokens;  ///< its token ids
  std::vector<client_token_logprobs> logprobs;  ///< one per token when client_params::logprobs >= 0
  std::string finish_reason;    ///< "stop", "length" or "abort"
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
};

struct client_health {
  bool ok = false;
  std::string status;
  int64_t uptime_ms = 0;
  std::string model_id;
  int32_t max_context = 0;
  bool ready = false;        ///< can serve (GET /health/ready); ok but not ready = degraded
  std::string ready_status;  ///< "ready" or why not
};

struct client_stats {
  int64_t requests_total = 0, requests_running = 0, requests_queued = 0, tokens_generated = 0;
  int64_t kv_pages_total = 0, kv_pages_free = 0, rejected_overloaded = 0;
};

/// Called with each new piece of text; return false to abort the request (generate() then
/// returns with finish_reason "abort").
using text_callback = std::function<bool(std::string_view text)>;

class client {
 public:
  /// Connects and authenticates with `api_key` (see client_api_key() in transport/auth/api_keys.h;
  /// "" when the node runs without keys). Throws tandem::error (disconnected) naming the address
  /// if it cannot connect, (failed) if the node refuses the key.
  static std::unique_ptr<client> connect(const std::string& host, uint16_t port, const std::string& api_key = "");
  ~client();

  /// Streams a completion of `prompt` (text, tokenized by the server). Throws tandem::error
  /// with the server's kind and message on failure (bad parameters: failed; busy: overloaded).
  client_result generate(const std::string& prompt, const client_params& p, const text_callback& on_text = {});
  /// Best effort abort of a request by id.
  void abort(const std::string& request_id);
  client_health health();
  client_stats stats();

  struct impl;

 private:
  explicit client(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace tandem
