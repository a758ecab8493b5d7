#include "transport/rpc/rpc_server.h"

#include <capnp/rpc-twoparty.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <optional>

#include "kernels/model/logprobs.h"
#include "kernels/tokenizer/tokenizer.h"
#include "schemas/api.capnp.h"
#include "transport/http/generation.h"
#include "transport/rpc/rpc_listener.h"

namespace tandem {

namespace {

kj::Exception to_kj(error_kind k, const std::string& msg) {
  kj::Exception::Type t = kj::Exception::Type::FAILED;
  if (k == error_kind::overloaded) t = kj::Exception::Type::OVERLOADED;
  if (k == error_kind::disconnected) t = kj::Exception::Type::DISCONNECTED;
  if (k == error_kind::unimplemented) t = kj::Exception::Type::UNIMPLEMENTED;
  return kj::Exception(t, __FILE__, __LINE__, kj::heapString(msg.data(), msg.size()));
}

api::ErrorKind to_api(error_kind k) {
  switch (k) {
    case error_kind::overloaded: return api::ErrorKind::OVERLOADED;
    case error_kind::disconnected: return api::ErrorKind::DISCONNECTED;
    case error_kind::unimplemented: return api::ErrorKind::UNIMPLEMENTED;
    case error_kind::failed: break;
  }
  return api::ErrorKind::FAILED;
}

api::FinishReason to_api(finish_reason r) {
  switch (r) {
    case finish_reason::stop: return api::FinishReason::STOP;
    case finish_reason::length: return api::FinishReason::LENGTH;
    case finish_reason::abort: return api::FinishReason::ABORT;
    case finish_reason::error: return api::FinishReason::ERROR;
    case finish_reason::none: break;
  }
  return api::FinishReason::NONE;
}

}  // namespace

struct rpc_server::impl {
  impl(serving_api& a, const limits& l, kj::Timer& t) : api(a), lim(l), timer(t), ids("rpc"), tasks(error_handler) {}

  /// One streaming request: engine events -> TokenSink calls. Destroying it before the
  /// engine finished aborts the engine request (sink gone, server shutting down).
  struct stream_state {
    stream_state(impl& s, api::TokenSink::Client k, std::vector<std::string> stop)
        : srv(s), sink(kj::mv(k)), text(s.api.tok(), std::move(stop)) {}
    ~stream_state() {
      ch.close();
      if (!engine_done) {
        if (text.stopped())
          srv.api.stop_at_stop_string(id);  // finished as `stop`, not counted as an abort
        else
          srv.api.abort(id);
      }
    }
    impl& srv;
    api::TokenSink::Client sink;
    transport::event_channel ch;
    transport::text_assembler text;
    std::string id;
    std::chrono::steady_clock::time_point deadline;
    bool engine_done = false, done = false, timed_out = false;
    finish_reason reason = finish_reason::none;
    std::optional<error> err;
    int32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
    int32_t logprobs = -1;  ///< top alternatives per token sent with tokens(); -1 = none
  };

  kj::Promise<void> pump(stream_state& st) {
    auto now = std::chrono::steady_clock::now();
    int64_t left = st.deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(st.deadline - now).count() : 0;
    auto timeout = timer.afterDelay(left * kj::MILLISECONDS).then([this, &st] {
      st.timed_out = true;
      token_event ev;
      ev.finished = true;
      ev.reason = finish_reason::error;
      ev.err = error(error_kind::overloaded, fmt::format("request {} ran past its deadline of {} ms (limits.request_timeout_ms)",
                                                         st.id, lim.request_timeout_ms));
      ev.prompt_tokens = st.prompt_tokens;
      ev.completion_tokens = st.text.tokens_consumed();
      std::vector<token_event> v;
      v.push_back(std::move(ev));
      return v;
    });
    return st.ch.next().exclusiveJoin(kj::mv(timeout)).then([this, &st](std::vector<token_event> evs) -> kj::Promise<void> {
      // One tokens() call per engine event that produced tokens or text.
      kj::Vector<kj::Promise<void>> sends;
      for (auto& ev : evs) {
        if (st.done) break;
        if (ev.prompt_tokens > 0) st.prompt_tokens = ev.prompt_tokens;
        st.cached_tokens = ev.cached_tokens;
        size_t before = static_cast<size_t>(st.text.tokens_consumed());
        std::string delta = st.text.push(ev.tokens);
        size_t used = static_cast<size_t>(st.text.tokens_consumed()) - before;
        if (st.text.stopped()) {
          st.done = true;
          st.reason = finish_reason::stop;
          st.completion_tokens = st.text.tokens_consumed();
          st.engine_done = st.engine_done || (ev.finished && !st.timed_out);
        } else if (ev.finished) {
          st.engine_done = !st.timed_out;
          st.done = true;
          st.reason = ev.err ? finish_reason::error : ev.reason;
          st.err = ev.err;
          st.completion_tokens = ev.completion_tokens;
          if (!ev.err) {
            delta += st.text.finish();
            if (st.text.stopped()) st.reason = finish_reason::stop;
          }
        }
        if (used == 0 && delta.empty()) continue;
        auto req = st.sink.tokensRequest();
        auto l = req.initIds(static_cast<unsigned>(used));
        for (size_t i = 0; i < used; ++i) l.set(static_cast<unsigned>(i), ev.tokens[i]);
        req.setText(delta);
        if (st.logprobs >= 0 && ev.logprobs.size() == ev.tokens.size()) {
          // The log-probabilities of the tokens the text took (none past a stop string).
          auto lps = req.initLogprobs(static_cast<unsigned>(used));
          for (size_t i = 0; i < used; ++i) {
            const token_logprobs& t = ev.logprobs[i];
            auto o = lps[static_cast<unsigned>(i)];
            o.setToken(t.token);
            o.setLogprob(t.logprob);
            auto top = o.initTop(static_cast<unsigned>(t.top.size()));
            for (size_t k = 0; k < t.top.size(); ++k) {
              top[static_cast<unsigned>(k)].setToken(t.top[k].token);
              top[static_cast<unsigned>(k)].setLogprob(t.top[k].logprob);
            }
          }
        }
        sends.add(req.send());
      }
      kj::Promise<void> sent = kj::joinPromises(sends.releaseAsArray());
      if (!st.done) {
        // A sink that stops taking tokens fills the stream's flow-control window and `sent`
        // waits; the engine's events queue up in `ch` meanwhile. Beyond the bound, or past the
        // deadline, the request ends here (aborted, pages freed) instead of buffering on.
        const size_t bound = static_cast<size_t>(std::max(1, lim.rpc_stream_backlog_tokens));
        auto over = st.ch.overflow(bound).then([this, &st, bound] {
          cut(st, fmt::format("request {}: the client's TokenSink did not take its tokens and more than {} wait "
                              "(limits.rpc_stream_backlog_tokens); the request was aborted: read the stream "
                              "faster or return from tokens() sooner",
                              st.id, bound));
        });
        auto late = timer.afterDelay(left_ms(st) * kj::MILLISECONDS).then([this, &st] {
          cut(st, fmt::format("request {}: the client's TokenSink did not take its tokens before the request's "
                              "deadline (limits.request_timeout_ms = {}); the request was aborted",
                              st.id, lim.request_timeout_ms));
        });
        return sent.exclusiveJoin(kj::mv(over)).exclusiveJoin(kj::mv(late)).then([this, &st]() -> kj::Promise<void> {
          if (st.done) return send_done(st);
          return pump(st);
        });
      }
      // Finished: the last batch is all there is, but a sink that never takes it must not
      // hold the stream past the deadline either.
      auto late = timer.afterDelay(left_ms(st) * kj::MILLISECONDS).then([this, &st] {
        cut(st, fmt::format("request {}: the client's TokenSink did not take its last tokens before the request's "
                            "deadline (limits.request_timeout_ms = {})",
                            st.id, lim.request_timeout_ms));
      });
      return sent.exclusiveJoin(kj::mv(late)).then([this, &st] { return send_done(st); });
    });
  }

  /// Milliseconds to the stream's deadline, at least 2 s (so an error still has time to go out).
  static int64_t left_ms(const stream_state& st) {
    auto now = std::chrono::steady_clock::now();
    return std::max<int64_t>(
        2000, st.deadline > now ? std::chrono::duration_cast<std::chrono::milliseconds>(st.deadline - now).count() : 0);
  }

  /// Ends a stream whose client fell behind: the engine request is aborted now and the sink
  /// gets done(error, overloaded) once it takes calls again.
  void cut(stream_state& st, std::string why) {
    ++stream_backlog_aborts;
    spdlog::warn("rpc: {}", why);
    st.ch.close();
    if (!st.engine_done) api.abort(st.id);
    st.engine_done = true;
    st.done = true;
    st.reason = finish_reason::error;
    st.err = error(error_kind::overloaded, std::move(why));
    st.completion_tokens = st.text.tokens_consumed();
  }

  /// The one done() call of a stream; a sink that does not take it within the deadline (at
  /// least 2 s) is given up on, so a stuck client holds nothing past that.
  kj::Promise<void> send_done(stream_state& st) {
    auto req = st.sink.doneRequest();
    req.setReason(to_api(st.reason));
    auto u = req.initUsage();
    u.setPromptTokens(st.prompt_tokens);
    u.setCompletionTokens(st.completion_tokens);
    u.setCachedTokens(st.cached_tokens);
    if (st.err) {
      auto e = req.initError();
      e.setKind(to_api(st.err->kind()));
      e.setMessage(st.err->what());
    }
    return req.send().ignoreResult().exclusiveJoin(timer.afterDelay(left_ms(st) * kj::MILLISECONDS).then([&st] {
      spdlog::warn("rpc: request {}: the client did not take done() before the deadline; the stream is dropped", st.id);
    }));
  }

  class node_impl final : public api::Node::Server {
   public:
    explicit node_impl(impl& s) : srv_(s) {}

    kj::Promise<void> generate(GenerateContext ctx) override {
      auto p = ctx.getParams();
      auto r = p.getRequest();
      const tokenizer& tok = srv_.api.tok();
      std::vector<int32_t> prompt;
      if (r.getPrompt().isText()) {
        auto t = r.getPrompt().getText();
        prompt = tok.encode(std::string_view(t.cStr(), t.size()), true);
      } else {
        for (int32_t id : r.getPrompt().getTokens()) {
          if (id < 0 || id >= tok.n_vocab())
            throw to_kj(error_kind::failed, fmt::format("prompt token id {} is out of range; ids are 0 to {}", id, tok.n_vocab() - 1));
          prompt.push_back(id);
        }
      }
      transport::generation_params g;
      auto s = r.getSampling();
      g.sampling.temperature = s.getTemperature();
      g.sampling.top_k = s.getTopK();
      g.sampling.top_p = s.getTopP();
      g.sampling.seed = s.getSeed();
      g.max_tokens = r.getMaxTokens();
      g.ignore_eos = r.getIgnoreEos();
      if (r.getStop().size() > transport::max_stop_strings)
        throw to_kj(error_kind::failed, fmt::format("stop has {} strings; at most {} are allowed", r.getStop().size(),
                                                    transport::max_stop_strings));
      for (auto st : r.getStop()) g.stop.emplace_back(st.cStr(), st.size());
      // Log-probabilities: the HTTP chat API's bounds and rule (top needs logprobs).
      const int32_t top = r.getTopLogprobs();
      if (top < 0 || top > max_top_logprobs)
        throw to_kj(error_kind::failed,
                    fmt::format("topLogprobs = {} is out of range; use 0 to {}", top, max_top_logprobs));
      if (top > 0 && !r.getLogprobs())
        throw to_kj(error_kind::failed, fmt::format("topLogprobs = {} needs logprobs = true; set both", top));
      if (auto pe = transport::check_params(g, prompt.size(), srv_.api.max_context(), srv_.lim))
        throw to_kj(error_kind::failed, pe->message);

      auto st = kj::heap<stream_state>(srv_, p.getSink(), g.stop);
      st->id = srv_.ids.next();
      st->prompt_tokens = static_cast<int32_t>(prompt.size());
      st->logprobs = r.getLogprobs() ? top : -1;
      auto req = transport::make_request(st->id, std::move(prompt), g, tok, srv_.lim);
      req.logprobs = st->logprobs;
      st->deadline = req.deadline + std::chrono::milliseconds(std::min(2000, srv_.lim.request_timeout_ms));
      srv_.api.submit(std::move(req), st->ch.callback());
      ctx.getResults().setRequestId(st->id);
      auto& ref = *st;
      srv_.tasks.add(srv_.pump(ref).attach(kj::mv(st)));
      return kj::READY_NOW;
    }

    kj::Promise<void> abort(AbortContext ctx) override {
      auto id = ctx.getParams().getRequestId();
      srv_.api.abort(std::string(id.cStr(), id.size()));
      return kj::READY_NOW;
    }

    kj::Promise<void> health(HealthContext ctx) override {
      auto h = srv_.api.health();
      auto o = ctx.getResults().initHealth();
      o.setOk(h.ok);
      o.setStatus(h.status);
      o.setUptimeMs(h.uptime_ms);
      o.setModelId(srv_.api.model_id());
      o.setMaxContext(srv_.api.max_context());
      o.setReady(h.ok && h.ready);
      o.setReadyStatus(h.ready_status);
      return kj::READY_NOW;
    }

    kj::Promise<void> stats(StatsContext ctx) override {
      auto s = srv_.api.stats();
      auto o = ctx.getResults().initStats();
      o.setRequestsTotal(s.requests_total);
      o.setRequestsRunning(s.requests_running);
      o.setRequestsQueued(s.requests_queued);
      o.setTokensGenerated(s.tokens_generated);
      o.setKvPagesTotal(s.kv_pages_total);
      o.setKvPagesFree(s.kv_pages_free);
      o.setRejectedOverloaded(s.rejected_overloaded);
      return kj::READY_NOW;
    }

   private:
    impl& srv_;
  };

  struct log_errors final : kj::TaskSet::ErrorHandler {
    void taskFailed(kj::Exception&& e) override {
      // A sink that went away is routine (client closed); the request was aborted.
      if (e.getType() == kj::Exception::Type::DISCONNECTED) spdlog::debug("rpc: {}", e.getDescription().cStr());
      else spdlog::warn("rpc: {}", e.getDescription().cStr());
    }
  };

  serving_api& api;
  limits lim;
  kj::Timer& timer;
  transport::request_ids ids;
  int64_t stream_backlog_aborts = 0;  ///< streams cut because their client fell behind
  log_errors error_handler;
  rpc_listener listener{"rpc", lim};
  kj::TaskSet tasks;  // last: its tasks reference the members above
};

rpc_server::rpc_server(serving_api& api, const limits& lim, kj::Timer& timer) : impl_(std::make_unique<impl>(api, lim, timer)) {
  impl_->listener.set_bootstrap(kj::heap<impl::node_impl>(*impl_));
}

rpc_server::~rpc_server() = default;

kj::Promise<void> rpc_server::listen(kj::ConnectionReceiver& listener) { return impl_->listener.listen(listener); }

void rpc_server::set_api_keys(std::shared_ptr<const api_keys> keys) { impl_->listener.set_api_keys(std::move(keys)); }

int rpc_server::connections() const { return impl_->listener.open(); }

std::string rpc_server::metrics_text() const {
  return fmt::format(
      "# HELP tandem_rpc_connections Open Cap'n Proto RPC connections (bound: limits.max_rpc_connections).\n"
      "# TYPE tandem_rpc_connections gauge\ntandem_rpc_connections {}\n"
      "# HELP tandem_rpc_stream_backlog_aborts_total RPC streams aborted because their client's TokenSink fell "
      "behind (limits.rpc_stream_backlog_tokens, or the deadline).\n"
      "# TYPE tandem_rpc_stream_backlog_aborts_total counter\ntandem_rpc_stream_backlog_aborts_total {}\n",
      impl_->listener.open(), impl_->stream_backlog_aborts);
}

}  // namespace tandem
