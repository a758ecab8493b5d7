#include "transport/http/openai_stream.h"

#include <algorithm>
#include <ctime>

#include <fmt/format.h>
#include <kj/debug.h>
#include <spdlog/spdlog.h>

#include "transport/http/openai_choice.h"
#include "transport/http/openai_server_impl.h"

namespace tandem::openai {


gen_state::gen_state(openai_server::impl& s, const tokenizer& tok, std::vector<std::string> stop, int32_t n)
    : srv(s) {
  for (int32_t k = 0; k < std::max(1, n); ++k) {
    choices.push_back(std::make_unique<choice_state>(tok, stop));
    choices.back()->index = k;
  }
  last = choices.front().get();
  ++srv.in_flight;
}

gen_state::~gen_state() {
  ch.close();
  if (submitted && !engine_done) {
    // Every choice the engine still runs stopped at a stop string: a normal finish (counted as
    // `stop`, not as an abort). Otherwise the client went away (or the server stops): abort.
    bool all_stopped = true;
    for (const auto& c : choices) all_stopped = all_stopped && (c->engine_done || c->text.stopped());
    if (all_stopped && choices.size() == 1)
      srv.api.stop_at_stop_string(id);
    else if (all_stopped)
      for (const auto& c : choices) {
        if (!c->engine_done) srv.api.stop_choice_at_stop_string(id, c->index);
      }
    else
      srv.api.abort(id);
  }
  --srv.in_flight;
}

int32_t gen_state::completion_tokens() const {
  int32_t t = 0;
  for (const auto& c : choices) t += c->completion_tokens;
  return t;
}

std::string gen_state::consume_one(token_event& ev) {
  if (done) return "";
  if (ev.choice < 0 || size_t(ev.choice) >= choices.size()) return "";  // not a choice of this request
  choice_state& c = *choices[size_t(ev.choice)];
  last = &c;
  if (c.done && !(ev.finished && ev.err)) {
    // A choice whose stop string matched: the engine's own end of it comes later.
    if (ev.finished) c.engine_done = true;
    bool all = true;
    for (const auto& x : choices) all = all && x->engine_done;
    engine_done = engine_done || all;
    return "";
  }
  const int32_t before = c.text.tokens_consumed();
  std::string delta = consume_text(c, ev);
  // The log-probabilities of the tokens the text took (none past a stop string).
  if (logprobs >= 0 && ev.logprobs.size() == ev.tokens.size()) {
    const size_t n = std::min(ev.tokens.size(), static_cast<size_t>(std::max(0, c.text.tokens_consumed() - before)));
    c.lps.insert(c.lps.end(), ev.logprobs.begin(), ev.logprobs.begin() + static_cast<std::ptrdiff_t>(n));
  }
  if (c.tools) {
    auto r = c.tools->push(delta);
    if (c.done && !err) {
      auto f = c.tools->finish();
      r.content += f.content;
      for (auto& x : f.calls) r.calls.push_back(std::move(x));
    }
    srv.tool_calls += static_cast<int64_t>(r.calls.size());
    for (auto& x : r.calls) c.calls.push_back(std::move(x));
    delta = std::move(r.content);
  }
  bool all_done = true, all_engine = true;
  for (const auto& x : choices) all_done = all_done && x->done, all_engine = all_engine && x->engine_done;
  done = done || all_done;
  engine_done = engine_done || all_engine;
  return delta;
}

std::string choice_state::finish_name() const {
  if (!calls.empty() && reason == finish_reason::stop) return "tool_calls";
  return transport::finish_reason_name(reason);
}

std::string gen_state::consume_text(choice_state& c, token_event& ev) {
  if (ev.prompt_tokens > 0) prompt_tokens = ev.prompt_tokens;
  cached_tokens = ev.cached_tokens;
  std::string delta = c.text.push(ev.tokens);
  if (ev.finished && ev.err) {
    // An error ends every choice (and the request).
    engine_done = !timed_out;  // our own timeout event: the engine still runs it
    done = true;
    err = ev.err;
    reject_reason = ev.reject_reason;
    retry_after_ms = ev.retry_after_ms;
    for (auto& x : choices) {
      x->done = true;
      x->engine_done = engine_done;
      if (x->reason == finish_reason::none) x->reason = finish_reason::error;
    }
    c.completion_tokens = ev.completion_tokens;
    return delta;
  }
  if (c.text.stopped()) {
    c.done = true;
    c.reason = finish_reason::stop;
    c.completion_tokens = c.text.tokens_consumed();
    c.engine_done = c.engine_done || (ev.finished && !timed_out);
    if (!c.engine_done && choices.size() > 1) {
      // n > 1: only this choice stops; the others go on.
      srv.api.stop_choice_at_stop_string(id, c.index);
      c.engine_done = true;
    }
    return delta;
  }
  if (ev.finished) {
    c.engine_done = !timed_out;
    c.done = true;
    c.reason = ev.reason;
    c.completion_tokens = ev.completion_tokens;
    delta += c.text.finish();
    if (c.text.stopped()) c.reason = finish_reason::stop;
  }
  return delta;
}

void gen_state::consume(std::vector<token_event>& evs) {
  for (auto& ev : evs) {
    std::string d = consume_one(ev);
    last->full += d;
  }
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
    ev.completion_tokens = choices.front()->text.tokens_consumed();
    std::vector<token_event> v;
    v.push_back(std::move(ev));
    return v;
  });
  return ch.next().exclusiveJoin(kj::mv(timeout));
}

void write_usage(json::writer& w, const gen_state& g) {
  w.key("usage").begin_object();
  // As OpenAI: the prompt once, the completion tokens of every choice.
  const int32_t completion = g.completion_tokens();
  w.key("prompt_tokens").num(g.prompt_tokens).key("completion_tokens").num(completion);
  w.key("total_tokens").num(g.prompt_tokens + completion);
  if (g.cached_tokens > 0) w.key("prompt_tokens_details").begin_object().key("cached_tokens").num(g.cached_tokens).end_object();
  w.end_object();
}

void write_head(json::writer& w, const gen_state& g, bool chunk) {
  w.key("id").str(g.id);
  w.key("object").str(g.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion");
  w.key("created").raw(g.created).key("model").str(g.model);
}

/// "logprobs": the tokens' not written yet (then forgotten), or null when not asked for.
void write_choice_logprobs(json::writer& w, gen_state& g, choice_state& c) {
  w.key("logprobs");
  if (g.logprobs < 0) {
    w.null();
    return;
  }
  const tokenizer& tok = g.srv.api.tok();
  if (g.chat) write_chat_logprobs(w, tok, c.lps);
  else write_completion_logprobs(w, tok, c.lps, c.text_offset);
  c.lps.clear();
}

/// One SSE chunk of choice `c` carrying `delta` (and its finish reason when `final`).
std::string chunk_json(gen_state& g, choice_state& c, const std::string& delta, bool final) {
  json::writer w;
  w.begin_object();
  write_head(w, g, true);
  w.key("choices").begin_array().begin_object().key("index").num(c.index);
  if (g.chat) {
    w.key("delta").begin_object();
    if (c.first_chunk) w.key("role").str("assistant");
    if (!final || !delta.empty() || c.first_chunk) w.key("content").str(delta);
    if (c.calls_sent < c.calls.size()) {
      w.key("tool_calls");
      write_tool_calls(w, g.id, std::span<const parsed_tool_call>(c.calls).subspan(c.calls_sent), c.calls_sent, true);
      c.calls_sent = c.calls.size();
    }
    w.end_object();
  } else {
    w.key("text").str(c.first_chunk ? g.echo + delta : delta);
  }
  c.first_chunk = false;
  write_choice_logprobs(w, g, c);
  w.key("finish_reason");
  if (final) w.str(c.finish_name());
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
  w.key("choices").begin_array();
  for (auto& cp : g.choices) {
    choice_state& c = *cp;
    w.begin_object().key("index").num(c.index);
    if (g.chat) {
      w.key("message").begin_object().key("role").str("assistant").key("content");
      // A reply that is only calls has null content (the whitespace between calls is dropped).
      if (!c.calls.empty() && c.full.find_first_not_of(" \t\r\n") == std::string::npos) w.null();
      else w.str(c.full);
      if (!c.calls.empty()) {
        w.key("tool_calls");
        write_tool_calls(w, g.id, c.calls, 0, false);
      }
      w.end_object();
    } else {
      w.key("text").str(g.echo + c.full);
    }
    write_choice_logprobs(w, g, c);
    w.key("finish_reason").str(c.finish_name());
    w.end_object();
  }
  w.end_array();
  write_usage(w, g);
  w.end_object();
  return w.take();
}

std::string sse(const std::string& json) { return "data: " + json + "\n\n"; }

kj::Promise<void> collect(gen_state& g) {
  if (g.done) return kj::READY_NOW;
  return g.next().then([&g](std::vector<token_event> evs) {
    g.consume(evs);
    return collect(g);
  });
}

/// The SSE events for one engine event's text (and the end of the stream once done). An event
/// that carried tokens gets its chunk even when their text is held back (the first bytes of a
/// UTF-8 sequence, a possible stop string), as vLLM does: the client sees each token when it
/// is generated, so its TTFT and inter-token gaps are the engine's, not the tokenizer's.
std::string render_events(gen_state& g, choice_state& c, const std::string& delta, bool had_tokens) {
  std::string data;
  if (g.err) {
    if (!delta.empty()) data = sse(chunk_json(g, c, delta, false));
    // The status line went out with the first token: the error travels in-band, then [DONE].
    ++g.srv.stream_errors;
    data += sse(error_json(from_engine(*g.err, g.reject_reason, g.retry_after_ms))) + "data: [DONE]\n\n";
  } else if (!c.done) {
    if (!delta.empty() || had_tokens || (g.chat && c.first_chunk)) data = sse(chunk_json(g, c, delta, false));
  } else {
    // This choice ended (each gets one chunk with its finish_reason); the request with the last.
    data = sse(chunk_json(g, c, delta, true));
    if (g.done) {
      g.srv.completion_tokens += g.completion_tokens();
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
    if (ev.choice < 0 || size_t(ev.choice) >= g.choices.size()) continue;
    choice_state& c = *g.choices[size_t(ev.choice)];
    const bool was_done = c.done;
    std::string d = g.consume_one(ev);
    if (was_done && !g.err) continue;  // a stopped choice's late events
    data += render_events(g, c, d, had_tokens);
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
