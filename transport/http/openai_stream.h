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


/// One choice of a request (OpenAI's n; one unless n > 1): its text, finish reason and what
/// it carries beyond the text. Each has its own text assembler (stop strings) and tool-call parser.
struct choice_state {
  choice_state(const tokenizer& tok, std::vector<std::string> stop) : text(tok, std::move(stop)) {}
  int32_t index = 0;
  transport::text_assembler text;
  bool done = false;         ///< its response part is complete
  bool engine_done = false;  ///< the engine ended it (or was told to stop it)
  finish_reason reason = finish_reason::none;
  int32_t completion_tokens = 0;
  std::string full;
  bool first_chunk = true;
  /// Log-probabilities not written yet: the next chunk's, or the whole reply's.
  std::vector<token_logprobs> lps;
  int64_t text_offset = 0;  ///< completions logprobs: characters of the text written so far
  /// Chat with tools: the model's calls are parsed out of its text (null = no parsing).
  std::unique_ptr<tool_call_parser> tools;
  std::vector<parsed_tool_call> calls;  ///< every call parsed so far
  size_t calls_sent = 0;                ///< streaming: calls already sent as deltas

  /// The finish_reason to report ("tool_calls" when the reply ended with calls).
  std::string finish_name() const;
};

/// One generation request from submit to the last byte. Aborts the engine request if it is
/// destroyed before the engine finished it (client gone, stop string, server shutdown).
struct gen_state {
  gen_state(openai_server::impl& s, const tokenizer& tok, std::vector<std::string> stop, int32_t n = 1);
  ~gen_state();

  /// Consumes one event; returns its new content for its choice (`last`; tool calls go to its
  /// `calls`, log-probabilities to its `lps`). Sets `done` when the response is complete.
  std::string consume_one(token_event& ev);
  /// consume_one's text part: the event's tokens through the choice's text assembler.
  std::string consume_text(choice_state& c, token_event& ev);
  /// Consumes every event (whole responses only: the text goes to each choice's `full`).
  void consume(std::vector<token_event>& evs);

  /// Next events, or a synthetic timeout event once the deadline (plus a grace period in
  /// which the engine may report its own deadline error) has passed.
  kj::Promise<std::vector<token_event>> next();

  /// Sum of the choices' completion tokens.
  int32_t completion_tokens() const;

  openai_server::impl& srv;
  transport::event_channel ch;
  std::vector<std::unique_ptr<choice_state>> choices;
  choice_state* last = nullptr;  ///< the choice of the event consume_one took last
  std::string id, model, created;
  bool chat = false, include_usage = false;
  bool submitted = false, engine_done = false, done = false, timed_out = false;
  std::chrono::steady_clock::time_point deadline;
  std::optional<error> err;  ///< an error ends every choice
  std::string reject_reason;
  int64_t retry_after_ms = 0;
  int32_t prompt_tokens = 0, cached_tokens = 0;
  kj::Own<kj::AsyncOutputStream> out;

  /// Top log-probabilities per token (-1 = the request asked for none).
  int32_t logprobs = -1;
  /// Completions `echo`: the prompt's text, written before each choice's first generated text.
  std::string echo;
};

/// "usage": prompt, completion (summed over the choices) and total tokens (and cached ones when any).
void write_usage(json::writer& w, const gen_state& g);
/// id, object, created and model.
void write_head(json::writer& w, const gen_state& g, bool chunk);
/// One SSE chunk of choice `c` carrying `delta` (and its finish reason when `final`).
std::string chunk_json(gen_state& g, choice_state& c, const std::string& delta, bool final);
/// The whole (non-streamed) response once `g` is done without an error.
std::string response_json(gen_state& g);
/// `json` as one SSE data event.
std::string sse(const std::string& json);
/// Consumes events until the response is complete, appending each choice's text to its `full`.
kj::Promise<void> collect(gen_state& g);
/// The SSE events for one engine event's text (and the end of the stream once done). An event
/// that carried tokens gets its chunk even when their text is held back (the first bytes of a
/// UTF-8 sequence, a possible stop string), as vLLM does: the client sees each token when it
/// is generated, so its TTFT and inter-token gaps are the engine's, not the tokenizer's.
std::string render_events(gen_state& g, choice_state& c, const std::string& delta, bool had_tokens);
/// Writes one SSE chunk per engine event (events that arrived together go out in one
/// write), then waits for more.
kj::Promise<void> stream_step(gen_state& g, std::vector<token_event> evs);

/// Seconds since the epoch, as the "created" field.
std::string unix_now_s();

}  // namespace tandem::openai
