#include "transport/http/openai_stream.h"

#include <algorithm>
#include <ctime>

#include <fmt/format.h>
#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include "transport/http/openai_choice.h"
#include "transport/http/openai_server_impl.h"

namespace tandem::openai {


gen_state::gen_state(openai_server::impl& s, const tokenizer& tok, std::vector<std::string> stop)
    : srv(s), text(tok, std::move(stop)) {
  ++srv.in_flight;
}

gen_state::~gen_state() {
  ch.close();
  if (submitted && !engine_done) {
    if (text.stopped())
      srv.api.stop_at_stop_string(id);  // finished as `stop`, not counted as an abort
    else
      srv.api.abort(id);
  }
  --srv.in_flight;
}

std::string gen_state::consume_one(token_event& ev) {
  if (done) return "";
  const int32_t before = text.tokens_consumed();
  std::string delta = consume_text(ev);
  // The log-probabilities of the tokens the text took (none past a stop string).
  if (logprobs >= 0 && ev.logprobs.size() == ev.tokens.size()) {
    const size_t n = std::min(ev.tokens.size(), static_cast<size_t>(std::max(0, text.tokens_consumed() - before)));
    lps.insert(lps.end(), ev.logprobs.begin(), ev.logprobs.begin() + static_cast<std::ptrdiff_t>(n));
  }
  if (tools) {
    auto r = tools->push(delta);
    if (done && !err) {
      auto f = tools->finish();
      r.content += f.content;
      for (auto& c : f.calls) r.calls.push_back(std::move(c));
    }
    srv.tool_calls += static_cast<int64_t>(r.calls.size());
    for (auto& c : r.calls) calls.push_back(std::move(c));
    delta = std::move(r.content);
  }
  return delta;
}

std::string gen_state::finish_name() const {
  if (!calls.empty() && reason == finish_reason::stop) return "tool_calls";
  return transport::finish_reason_name(reason);
}

std::string gen_state::consume_text(token_event& ev) {
  if (ev.prompt_tokens > 0) prompt_tokens = ev.prompt_tokens;
  cached_tokens = ev.cached_tokens;
  std::string delta = text.push(ev.tokens);
  if (text.stopped()) {
    done = true;
    reason = finish_reason::stop;
    completion_tokens = text.tokens_consumed();
    engine_done = engine_done || (ev.finished && !timed_out);
    return delta;
  }
  if (ev.finished) {
    engine_done = !timed_out;  // our own timeout event: the engine still runs it
    done = true;
    reason = ev.reason;
    err = ev.err;
    reject_reason = ev.reject_reason;
    retry_after_ms = ev.retry_after_ms;
    completion_tokens = ev.completion_tokens;
    if (!err) {
      delta += text.finish();
      if (text.stopped()) reason = finish_reason::stop;
    } else {
      reason = finish_reason::error;
    }
  }
  return delta;
}

std::string gen_state::consume(std::vector<token_event>& evs) {
  std::string delta;
  for (auto& ev : evs) delta += consume_one(ev);
  return delta;
}

kj::Promise<std::vector<token_event>> gen_state::next() {
  auto now = std::chrono::steady_clock::now();
  int64_t left = deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() : 0;
  auto timeout = srv.timer.afterDelay(left * kj::MILLISECONDS).then([this] {
    ++srv.timeouts;
    timed_out = true;
    token_event ev;
    ev.finished = true;
    ev.reason = finish_reason::error;
    ev.err = error(error_kind::overloaded,
                   fmt::format("request {} ran past its deadline of {} ms (limits.request_timeout_ms); "
                               "retry with fewer max_tokens or when the server is less busy",
                               id, srv.lim.request_timeout_ms));
    ev.prompt_tokens = prompt_tokens;
    ev.completion_tokens = text.tokens_consumed();
    std::vector<token_event> v;
    v.push_back(std::move(ev));
    return v;
  });
  return ch.next().exclusiveJoin(kj::mv(timeout));
}

void write_usage(json::writer& w, const gen_state& g) {
  w.key("usage").begin_object();
  w.key("prompt_tokens").num(g.prompt_tokens).key("completion_tokens").num(g.completion_tokens);
  w.key("total_tokens").num(g.prompt_tokens + g.completion_tokens);
  if (g.cached_tokens > 0) w.key("prompt_tokens_details").begin_object().key("cached_tokens").num(g.cached_tokens).end_object();
  w.end_object();
}

void write_head(json::writer& w, const gen_state& g, bool chunk) {
  w.key("id").str(g.id);
  w.key("object").str(g.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
  w.key("created").raw(g.created).key("model").str(g.model);
}

/// "logprobs": the tokens' not written yet (then forgotten), or null when not asked for.
void write_choice_logprobs(json::writer& w, gen_state& g) {
  w.key("logprobs");
  if (g.logprobs < 0) {
    w.null();
    return;
  }
  const tokenizer& tok = g.srv.api.tok();
  if (g.chat) write_chat_logprobs(w, tok, g.lps);
  else write_completion_logprobs(w, tok, g.lps, g.text_offset);
  g.lps.clear();
}

/// One SSE chunk carrying `delta` (and the finish reason when `final`).
std::string chunk_json(gen_state& g, const std::string& delta, bool final) {
  json::writer w;
  w.begin_object();
  write_head(w, g, true);
  w.key("choices").begin_array().begin_object().key("index").num(0);
  if (g.chat) {
    w.key("delta").begin_object();
    if (g.first_chunk) w.key("role").str("assistant");
    if (!final || !delta.empty() || g.first_chunk) w.key("content").str(delta);
    if (g.calls_sent < g.calls.size()) {
      w.key("tool_calls");
      write_tool_calls(w, g.id, std::span<const parsed_tool_call>(g.calls).subspan(g.calls_sent), g.calls_sent, true);
      g.calls_sent = g.calls.size();
    }
    w.end_object();
  } else {
    w.key("text").str(g.first_chunk ? g.echo + delta : delta);
  }
  g.first_chunk = false;
  write_choice_logprobs(w, g);
  w.key("finish_reason");
  if (final) w.str(g.finish_name());
  else w.null();
  w.end_object().end_array();
  if (g.include_usage) w.key("usage").null();
  w.end_object();
  return w.take();
}

std::string response_json(gen_state& g) {
  json::writer w;
  w.begin_object();
  write_head(w, g, false);
  w.key("choices").begin_array().begin_object().key("index").num(0);
  if (g.chat) {
    w.key("message").begin_object().key("role").str("assistant").key("content");
    // A reply that is only calls has null content (the whitespace between calls is dropped).
    if (!g.calls.empty() && g.full.find_first_not_of(" \t\r\n") == std::string::npos) w.null();
    else w.str(g.full);
    if (!g.calls.empty()) {
      w.key("tool_calls");
      write_tool_calls(w, g.id, g.calls, 0, false);
    }
    w.end_object();
  } else {
    w.key("text").str(g.echo + g.full);
  }
  write_choice_logprobs(w, g);
  w.key("finish_reason").str(g.finish_name());
  w.end_object().end_array();
  write_usage(w, g);
  w.end_object();
  return w.take();
}

std::string sse(const std::string& json) { return "data: " + json + "\n\n"; }

kj::Promise<void> collect(gen_state& g) {
  if (g.done) return kj::READY_NOW;
  return g.next().then([&g](std::vector<token_event> evs) {
    g.full += g.consume(evs);
    return collect(g);
  });
}

/// The SSE events for one engine event's text (and the end of the stream once done). An event
/// that carried tokens gets its chunk even when their text is held back (the first bytes of a
/// UTF-8 sequence, a possible stop string), as vLLM does: the client sees each token when it
/// is generated, so its TTFT and inter-token gaps are the engine's, not the tokenizer's.
std::string render_events(gen_state& g, const std::string& delta, bool had_tokens) {
  std::string data;
  if (!g.done) {
    if (!delta.empty() || had_tokens || (g.chat && g.first_chunk)) data = sse(chunk_json(g, delta, false));
  } else if (g.err) {
    if (!delta.empty()) data = sse(chunk_json(g, delta, false));
    // The status line went out with the first token: the error travels in-band, then [DONE].
    ++g.srv.stream_errors;
    data += sse(error_json(from_engine(*g.err, g.reject_reason, g.retry_after_ms))) + "data: [DONE]\n\n";
  } else {
    g.srv.completion_tokens += g.completion_tokens;
    data = sse(chunk_json(g, delta, true));
    if (g.include_usage) {
      json::writer w;
      w.begin_object();
      write_head(w, g, true);
      w.key("choices").begin_array().end_array();
      write_usage(w, g);
      w.end_object();
      data += sse(w.take());
    }
    data += "data: [DONE]\n\n";
  }
  if (!data.empty()) ++g.srv.stream_events;
  return data;
}

/// Writes one SSE chunk per engine event (events that arrived together go out in one
/// write), then waits for more.
kj::Promise<void> stream_step(gen_state& g, std::vector<token_event> evs) {
  std::string data;
  for (auto& ev : evs) {
    if (g.done) break;
    const bool had_tokens = !ev.tokens.empty();
    std::string d = g.consume_one(ev);
    data += render_events(g, d, had_tokens);
  }
  kj::Promise<void> wrote = kj::READY_NOW;
  if (!data.empty()) {
    auto s = kj::heapString(data.data(), data.size());
    auto p = g.out->write(s.begin(), s.size());
    wrote = p.attach(kj::mv(s));
    // A client that stops reading fills the socket and this write waits; the engine's events
    // queue up meanwhile. Beyond the bound, or past the deadline (at least 2 s per write, so
    // the deadline's own error still goes out), the request is aborted (gen_state's destructor
    // frees its pages) and the stream is closed: the error cannot reach a client that does not
    // read, so the missing [DONE] is the explicit end.
    auto now = std::chrono::steady_clock::now();
    const int64_t left = std::max<int64_t>(
        2000, g.deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(g.deadline - now).count() : 0);
    auto late = g.srv.timer.afterDelay(left * kj::MILLISECONDS).then([&g]() {
      ++g.srv.stream_backlog_aborts;
      spdlog::warn("http: request {}: the client did not read the stream before the request's deadline "
                   "(limits.request_timeout_ms = {}); aborting the request and closing the stream",
                   g.id, g.srv.lim.request_timeout_ms);
      kj::throwFatalException(KJ_EXCEPTION(OVERLOADED, "SSE client too slow: stream not read by the deadline"));
    });
    wrote = wrote.exclusiveJoin(kj::mv(late));
    if (!g.done) {
      const size_t bound = static_cast<size_t>(std::max(1, g.srv.lim.http_stream_backlog_tokens));
      auto over = g.ch.overflow(bound).then([&g, bound]() {
        ++g.srv.stream_backlog_aborts;
        spdlog::warn("http: request {}: the client stopped reading and more than {} tokens wait for it "
                     "(limits.http_stream_backlog_tokens); aborting the request and closing the stream",
                     g.id, bound);
        kj::throwFatalException(KJ_EXCEPTION(OVERLOADED, "SSE client too slow: stream backlog over its bound"));
      });
      wrote = wrote.exclusiveJoin(kj::mv(over));
    }
  }
  if (g.done) return wrote;
  return wrote.then([&g] { return g.next(); }).then([&g](std::vector<token_event> evs) { return stream_step(g, kj::mv(evs)); });
}

std::string unix_now_s() { return std::to_string(static_cast<int64_t>(std::time(nullptr))); }

}  // namespace tandem::openai
