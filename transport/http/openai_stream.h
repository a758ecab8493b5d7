#pragma once
/// One generation request from submit to the last byte: its engine events turned into the
/// OpenAI response JSON, whole or as SSE chunks.
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <kj/async-io.h>

#include "kernels/model/logprobs.h"
#include "transport/chat/tool_call_parser.h"

#include "transport/http/generation.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

namespace tandem::openai {


/// One generation request from submit to the last byte. Aborts the engine request if it is
/// destroyed before the engine finished it (client gone, stop string, server shutdown).
struct gen_state {
  gen_state(openai_server::impl& s, const tokenizer& tok, std::vector<std::string> stop);
  ~gen_state();

  /// Consumes one event; returns its new content (tool calls go to `calls`, log-probabilities
  /// to `lps`). Sets `done` when the response is complete.
  std::string consume_one(token_event& ev);
  /// consume_one's text part: the event's tokens through the text assembler.
  std::string consume_text(token_event& ev);
  std::string consume(std::vector<token_event>& evs);

  /// Next events, or a synthetic timeout event once the deadline (plus a grace period in
  /// which the engine may report its own deadline error) has passed.
  kj::Promise<std::vector<token_event>> next();

  openai_server::impl& srv;
  transport::event_channel ch;
  transport::text_assembler text;
  std::string id, model, created;
  bool chat = false, include_usage = false;
  bool submitted = false, engine_done = false, done = false, timed_out = false;
  std::chrono::steady_clock::time_point deadline;
  finish_reason reason = finish_reason::none;
  std::optional<error> err;
  std::string reject_reason;
  int64_t retry_after_ms = 0;
  int32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  std::string full;
  bool first_chunk = true;
  kj::Own<kj::AsyncOutputStream> out;

  // ---- what the choice carries beyond its text
  /// Top log-probabilities per token (-1 = the request asked for none).
  int32_t logprobs = -1;
  /// Log-probabilities not written yet: the next chunk's, or the whole reply's.
  std::vector<token_logprobs> lps;
  int64_t text_offset = 0;  ///< completions logprobs: characters of the text written so far
  /// Completions `echo`: the prompt's text, written before the first generated text.
  std::string echo;
  /// Chat with tools: the model's calls are parsed out of its text (null = no parsing).
  std::unique_ptr<tool_call_parser> tools;
  std::vector<parsed_tool_call> calls;  ///< every call parsed so far
  size_t calls_sent = 0;                ///< streaming: calls already sent as deltas

  /// The finish_reason to report ("tool_calls" when the reply ended with calls).
  std::string finish_name() const;
};

/// "usage": prompt, completion and total tokens (and cached ones when any).
void write_usage(json::writer& w, const gen_state& g);
/// id, object, created and model.
void write_head(json::writer& w, const gen_state& g, bool chunk);
/// One SSE chunk carrying `delta` (and the finish reason when `final`).
std::string chunk_json(gen_state& g, const std::string& delta, bool final);
/// The whole (non-streamed) response once `g` is done without an error.
std::string response_json(gen_state& g);
/// `json` as one SSE data event.
std::string sse(const std::string& json);
/// Consumes events until the response is complete, appending the text to `g.full`.
kj::Promise<void> collect(gen_state& g);
/// The SSE events for one engine event's text (and the end of the stream once done). An event
/// that carried tokens gets its chunk even when their text is held back (the first bytes of a
/// UTF-8 sequence, a possible stop string), as vLLM does: the client sees each token when it
/// is generated, so its TTFT and inter-token gaps are the engine's, not the tokenizer's.
std::string render_events(gen_state& g, const std::string& delta, bool had_tokens);
/// Writes one SSE chunk per engine event (events that arrived together go out in one
/// write), then waits for more.
kj::Promise<void> stream_step(gen_state& g, std::vector<token_event> evs);

/// Seconds since the epoch, as the "created" field.
std::string unix_now_s();

}  // namespace tandem::openai
