#pragma once
/// Pieces shared by the HTTP and RPC front ends: carrying token events from actor threads
/// to the kj event loop, turning tokens into text with stop strings, and validating the
/// user-facing request parameters.
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <kj/async.h>

#include "actors/common/limits.h"
#include "actors/runtime/serving_api.h"
#include "kernels/tokenizer/tokenizer.h"

namespace tandem::transport {

/// Delivers the token events of one request from any thread to the kj loop that created it.
/// The callback may outlive the channel: events after close() are dropped.
class event_channel {
 public:
  /// Must be called on the kj event-loop thread that will consume the events.
  event_channel();
  ~event_channel();
  event_channel(const event_channel&) = delete;
  event_channel& operator=(const event_channel&) = delete;

  /// The callback to hand to serving_api::submit; thread-safe and cheap.
  event_callback callback() const;
  /// Resolves with every event queued so far (at least one). kj thread only; one call at a time.
  kj::Promise<std::vector<token_event>> next();
  /// Resolves once more than `limit` tokens (an event without tokens counts as one) wait in the
  /// queue, i.e. the consumer fell behind by that much (kj thread; one call at a time; a later
  /// call replaces the earlier one).
  kj::Promise<void> overflow(size_t limit);
  /// Stops accepting events (kj thread).
  void close();

 private:
  struct shared;
  std::shared_ptr<shared> s_;
};

/// Turns token ids into UTF-8 text, cutting at the first stop string. Text that could be
/// the start of a stop string is held back until it is known not to be one.
class text_assembler {
 public:
  text_assembler(const tokenizer& tok, std::vector<std::string> stop);
  /// Control tokens (id, text) to render as their text, which the detokenizer leaves out:
  /// tool-call markers that are control tokens, for the tool-call parser (which keeps them
  /// out of the content).
  void render_control(std::vector<std::pair<int32_t, std::string>> tokens) { rendered_ = std::move(tokens); }
  /// Feeds new tokens; returns the text that can be emitted now. Tokens after a stop
  /// string matched are ignored.
  std::string push(std::span<const int32_t> ids);
  /// End of the stream: the text still held back (nothing once stopped).
  std::string finish();
  /// True once a stop string matched; the emitted text ends right before it.
  bool stopped() const { return stopped_; }
  /// Tokens consumed up to and including the one that completed the stop string.
  int32_t tokens_consumed() const { return consumed_; }

 private:
  stream_decoder dec_;
  std::vector<std::string> stop_;
  std::vector<std::pair<int32_t, std::string>> rendered_;
  std::string pending_;
  bool stopped_ = false;
  int32_t consumed_ = 0;
};

/// A request parameter that is out of range (HTTP 422).
struct param_error {
  std::string param;
  std::string message;
};

/// What both front ends accept, before tokenization.
struct generation_params {
  sampling_params sampling;
  int32_t max_tokens = 16;
  std::vector<std::string> stop;
  bool ignore_eos = false;
};

/// Maximum number of stop strings and their length: bounds on the matching work.
constexpr size_t max_stop_strings = 16;
constexpr size_t max_stop_bytes = 256;

/// Checks ranges against the limits and the cluster's context. Messages name the parameter,
/// its value and the allowed range.
std::optional<param_error> check_params(const generation_params& p, size_t prompt_tokens,
                                        int32_t max_context, const limits& lim);

/// Builds the engine request (stop tokens: EOS unless ignore_eos).
completion_request make_request(std::string id, std::vector<int32_t> prompt, const generation_params& p,
                                const tokenizer& tok, const limits& lim);

/// "stop", "length", "abort", "error" (OpenAI's names for the first two).
std::string finish_reason_name(finish_reason r);

/// Request ids like "cmpl-<16 hex>": a random salt per generator (so restarted servers and
/// several front ends in one process do not collide) plus a counter.
class request_ids {
 public:
  explicit request_ids(std::string prefix);
  std::string next();

 private:
  std::string prefix_;
  uint32_t salt_;
  uint64_t counter_ = 0;
};

}  // namespace tandem::transport
