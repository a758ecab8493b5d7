#pragma once
/// What the front ends (HTTP, RPC) see of a cluster: submit a tokenized request, get a
/// stream of events, abort, and read health/stats/metrics. Implemented by
/// `embedded_cluster` (all roles in one process) and later by a remote router client.
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "kernels/model/logprobs.h"
#include "kernels/model/sampler.h"

namespace tandem {

class tokenizer;

struct completion_request {
  std::string request_id;            ///< unique per request; set by the front end
  std::vector<int32_t> prompt;       ///< token ids (BOS included if wanted)
  sampling_params sampling;
  int32_t max_tokens = 16;
  std::vector<int32_t> stop_tokens;  ///< generation ends when one is produced (EOS by default)
  bool ignore_eos = false;
  /// Log-probabilities per generated token with this many top alternatives (0..max_top_logprobs);
  /// -1 = none (kernels/model/logprobs.h says which distribution).
  int32_t logprobs = -1;
  /// Choices (OpenAI's n): one prefill, then n sequences sharing the prompt's KV pages. Each
  /// choice streams its own events (token_event::choice) and ends with its own finished event.
  int32_t n = 1;
  /// Absolute deadline; the request ends with an `overloaded`/timeout error past it.
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

enum class finish_reason : uint8_t { none = 0, stop = 1, length = 2, abort = 3, error = 4 };

/// One event of a request's stream. Exactly one event per accepted request and choice has
/// `finished == true` (a completion or an error); no event of that choice follows it. An
/// error ends every choice: its event is the last of the request.
struct token_event {
  std::string request_id;
  int32_t choice = 0;  ///< which of the request's n choices (completion_request::n)
  std::vector<int32_t> tokens;  ///< new tokens since the previous event
  std::vector<token_logprobs> logprobs;  ///< parallel to tokens when the request asked for them
  bool finished = false;
  finish_reason reason = finish_reason::none;
  std::optional<tandem::error> err;  ///< set iff reason == error
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;     ///< total so far (of this choice)
  int32_t cached_tokens = 0;         ///< prompt tokens served from the prefix cache
  /// Set on a refusal: the bound or check that refused (e.g. "queue_wait", "queue_timeout");
  /// the HTTP front end picks the status from it (queue_timeout -> 504).
  std::string reject_reason;
  /// Set on an `overloaded` refusal: when the refused work could be placed (estimated drain
  /// time of the queue); HTTP sends it as Retry-After. 0 = unknown.
  int64_t retry_after_ms = 0;
};

/// Called on an actor thread: must be quick and thread-safe (post to your own loop).
using event_callback = std::function<void(token_event)>;

/// Liveness (`ok`: the process and its actors answer; GET /health) and readiness (`ready`: it
/// can serve, e.g. its router has a live target of every role; GET /health/ready).
struct health_info {
  bool ok = false;
  std::string status;  ///< "ok" or the reason it is not
  int64_t uptime_ms = 0;
  bool ready = true;
  std::string ready_status = "ready";  ///< "ready" or the reason it is not (actors/runtime/readiness.h)
  std::string drain;  ///< "" (serving), "draining" or "drained" (tandem inspect --drain); not ready unless ""
};

struct stats_info {
  int64_t requests_total = 0;
  int64_t requests_running = 0;
  int64_t requests_queued = 0;
  int64_t tokens_generated = 0;
  int64_t kv_pages_total = 0;
  int64_t kv_pages_free = 0;
  int64_t rejected_overloaded = 0;
};

/// One actor of a node, for `tandem inspect`.
struct actor_report {
  std::string name;            ///< the role: router, prefill, decode, worker, cache_tier
  std::string state;           ///< "running", "not answering", "escalated", or "remote" (a proxy of a role another node runs)
  int32_t mailbox_depth = 0;
  int32_t mailbox_bound = 0;
  int64_t messages_handled = 0;  ///< admitted to the mailbox and taken out of it
  int64_t mailbox_rejected = 0;
  int64_t restarts = 0;          ///< restarts of the node's actors after this one failed
  std::string last_error;        ///< cause of its last failure; empty if none
};

/// A request in the router's in-flight table.
struct request_report {
  std::string id;
  std::string state;  ///< queued, prefill, decode, ...
  int64_t age_ms = 0;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
};

/// A KV page pool.
struct pool_report {
  std::string name;  ///< "device"
  int64_t pages_total = 0, pages_free = 0, pages_cached = 0, pages_evictable = 0;
  int64_t bytes = 0;
};

struct node_report {
  std::string node;
  std::string model_id;
  bool healthy = false;
  std::string status;
  int64_t uptime_ms = 0;
  bool ready = false;        ///< can serve (health_info::ready); healthy but not ready = "degraded"
  std::string ready_status;  ///< "ready" or why not
  std::string drain;         ///< "" (serving), "draining" or "drained" (health_info::drain)
  std::vector<actor_report> actors;
  std::vector<request_report> requests;
  std::vector<pool_report> pools;
};

class serving_api {
 public:
  virtual ~serving_api() = default;
  /// Submits a request. Every call ends in exactly one finished event (possibly an
  /// immediate `overloaded` or `failed` error), delivered through `cb`.
  virtual void submit(completion_request req, event_callback cb) = 0;
  /// Best effort: a running or queued request ends with reason `abort`.
  virtual void abort(const std::string& request_id) = 0;
  /// The front end's text reached a stop string: the engine request ends like abort, but with
  /// reason `stop` (what the client was told, and what the finish metrics count).
  virtual void stop_at_stop_string(const std::string& request_id) { abort(request_id); }
  /// n > 1: the text of choice `choice` reached a stop string: that choice alone ends (as
  /// `stop`, with its finished event); the others go on. The default ends nothing early (the
  /// choice runs to its own end, which the front end no longer shows).
  virtual void stop_choice_at_stop_string(const std::string& request_id, int32_t choice) {
    (void)request_id, (void)choice;
  }
  virtual health_info health() const = 0;
  virtual stats_info stats() const = 0;
  /// Prometheus text exposition of every metric of this node.
  virtual std::string metrics_text() const = 0;
  virtual const tokenizer& tok() const = 0;
  /// Model id as shown in /v1/models.
  virtual std::string model_id() const = 0;
  /// Longest prompt + completion the cluster accepts.
  virtual int32_t max_context() const = 0;
  /// The node's actors, in-flight requests and KV pools (`tandem inspect`).
  virtual node_report inspect() const {
    throw tandem::error(error_kind::unimplemented, "this node does not implement inspect");
  }
  /// Drains the node (`on`: no new work routed here; it finishes what it holds, then reports
  /// "drained") or takes it back into service; the report after the change.
  virtual node_report drain(bool on) {
    (void)on;
    throw tandem::error(error_kind::unimplemented, "this node does not implement drain");
  }
};

}  // namespace tandem
