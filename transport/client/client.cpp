#include "transport/client/client.h"

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <exception>
#include <optional>

#include "schemas/api.capnp.h"
#include "schemas/auth.capnp.h"

namespace tandem {

namespace {

error_kind from_api(api::ErrorKind k) {
  switch (k) {
    case api::ErrorKind::OVERLOADED: return error_kind::overloaded;
    case api::ErrorKind::DISCONNECTED: return error_kind::disconnected;
    case api::ErrorKind::UNIMPLEMENTED: return error_kind::unimplemented;
    case api::ErrorKind::FAILED: break;
  }
  return error_kind::failed;
}

/// A kj exception (local or remote) as a tandem::error with the matching kind.
error from_kj(const kj::Exception& e) {
  error_kind k = error_kind::failed;
  switch (e.getType()) {
    case kj::Exception::Type::OVERLOADED: k = error_kind::overloaded; break;
    case kj::Exception::Type::DISCONNECTED: k = error_kind::disconnected; break;
    case kj::Exception::Type::UNIMPLEMENTED: k = error_kind::unimplemented; break;
    default: break;
  }
  std::string msg = e.getDescription().cStr();
  constexpr std::string_view remote = "remote exception: ";
  if (msg.rfind(remote, 0) == 0) msg.erase(0, remote.size());
  return error(k, msg);
}

std::string reason_name(api::FinishReason r) {
  switch (r) {
    case api::FinishReason::STOP: return "stop";
    case api::FinishReason::LENGTH: return "length";
    case api::FinishReason::ABORT: return "abort";
    case api::FinishReason::ERROR: return "error";
    case api::FinishReason::NONE: break;
  }
  return "none";
}

/// Receives the node's callbacks for one request.
class sink_impl final : public api::TokenSink::Server {
 public:
  sink_impl(client_result& r, const text_callback& cb, kj::Own<kj::PromiseFulfiller<void>> done, std::function<void()> on_abort)
      : r_(r), cb_(cb), done_(kj::mv(done)), on_abort_(std::move(on_abort)) {}
  ~sink_impl() {
    if (done_->isWaiting())
      done_->reject(KJ_EXCEPTION(DISCONNECTED, "the node dropped the request without finishing it"));
  }

  kj::Promise<void> tokens(TokensContext ctx) override {
    auto p = ctx.getParams();
    for (int32_t id : p.getIds()) r_.tokens.push_back(id);
    for (auto lp : p.getLogprobs()) {
      client_token_logprobs t;
      t.token = lp.getToken();
      t.logprob = lp.getLogprob();
      for (auto e : lp.getTop()) t.top.push_back({e.getToken(), e.getLogprob()});
      r_.logprobs.push_back(std::move(t));
    }
    auto t = p.getText();
    std::string_view text(t.cStr(), t.size());
    r_.text += text;
    if (!text.empty() && cb_ && !aborted_) {
      bool go_on = true;
      try {
        go_on = cb_(text);
      } catch (...) {
        // The caller gives up: abort on the node and hand the exception to generate().
        thrown_ = std::current_exception();
        go_on = false;
      }
      if (!go_on) {
        aborted_ = true;
        on_abort_();
        if (thrown_ && done_->isWaiting()) done_->fulfill();
      }
    }
    return kj::READY_NOW;
  }

  kj::Promise<void> done(DoneContext ctx) override {
    auto p = ctx.getParams();
    auto u = p.getUsage();
    r_.prompt_tokens = u.getPromptTokens();
    r_.completion_tokens = u.getCompletionTokens();
    r_.cached_tokens = u.getCachedTokens();
    r_.finish_reason = reason_name(p.getReason());
    if (p.hasError() && p.getReason() == api::FinishReason::ERROR) {
      auto e = p.getError();
      err_ = error(from_api(e.getKind()), e.getMessage().cStr());
    }
    if (done_->isWaiting()) done_->fulfill();
    return kj::READY_NOW;
  }

  std::optional<error> err_;
  std::exception_ptr thrown_;

 private:
  client_result& r_;
  const text_callback& cb_;
  kj::Own<kj::PromiseFulfiller<void>> done_;
  std::function<void()> on_abort_;
  bool aborted_ = false;
};

}  // namespace

struct client::impl {
  kj::AsyncIoContext io = kj::setupAsyncIo();
  kj::Own<kj::AsyncIoStream> stream;
  kj::Own<capnp::TwoPartyClient> rpc;
  api::Node::Client node = nullptr;
  kj::ForkedPromise<void> disconnected = kj::Promise<void>(kj::NEVER_DONE).fork();
  kj::Maybe<kj::Promise<void>> pending_abort;  ///< abort sent from a text callback

  /// Waits for `p`, failing with `disconnected` if the connection drops first.
  template <typename T>
  T wait(kj::Promise<T> p) {
    try {
      auto gone = disconnected.addBranch().then([]() -> T {
        throw error(error_kind::disconnected, "the connection to the node was lost; check that the server is running");
      });
      return p.exclusiveJoin(kj::mv(gone)).wait(io.waitScope);
    } catch (const kj::Exception& e) {
      throw from_kj(e);
    }
  }
};

client::client(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
client::~client() = default;

std::unique_ptr<client> client::connect(const std::string& host, uint16_t port, const std::string& api_key) {
  auto p = std::make_unique<impl>();
  try {
    auto addr = p->io.provider->getNetwork().parseAddress(host, port).wait(p->io.waitScope);
    p->stream = addr->connect().wait(p->io.waitScope);
  } catch (const kj::Exception& e) {
    throw error(error_kind::disconnected, "cannot connect to " + host + ":" + std::to_string(port) + ": " +
                                              e.getDescription().cStr() + "; check that `tandem serve` runs there");
  }
  p->rpc = kj::heap<capnp::TwoPartyClient>(*p->stream);
  p->disconnected = p->rpc->onDisconnect().fork();
  // The bootstrap is a Gate (schemas/auth.capnp): trade the key for the Node capability now,
  // so a wrong key fails here rather than at the first call.
  auto req = p->rpc->bootstrap().castAs<auth::Gate>().authenticateRequest();
  req.setKey(api_key);
  p->node = p->wait(req.send().then([](capnp::Response<auth::Gate::AuthenticateResults>&& r) {
    return r.getCap().castAs<api::Node>();
  }));
  return std::unique_ptr<client>(new client(std::move(p)));
}

client_result client::generate(const std::string& prompt, const client_params& p, const text_callback& on_text) {
  client_result r;
  auto paf = kj::newPromiseAndFulfiller<void>();
  auto* raw = impl_.get();
  // Tokens may arrive before generate() returns the id: then the abort waits for the id.
  bool abort_wanted = false;
  auto send_abort = [raw, &r] {
    auto req = raw->node.abortRequest();
    req.setRequestId(r.request_id);
    // Fire and forget; the node answers with done(abort).
    raw->pending_abort = req.send().ignoreResult().eagerlyEvaluate([](kj::Exception&&) {});
  };
  auto sink = kj::heap<sink_impl>(r, on_text, kj::mv(paf.fulfiller), [&r, &abort_wanted, send_abort] {
    if (r.request_id.empty()) abort_wanted = true;
    else send_abort();
  });
  auto& sref = *sink;
  api::TokenSink::Client sink_cap = kj::mv(sink);
  auto req = impl_->node.generateRequest();
  auto g = req.initRequest();
  g.initPrompt().setText(prompt);
  auto s = g.initSampling();
  s.setTemperature(p.temperature);
  s.setTopP(p.top_p);
  s.setTopK(p.top_k);
  s.setSeed(p.seed);
  g.setMaxTokens(p.max_tokens);
  g.setIgnoreEos(p.ignore_eos);
  // Out-of-range counts go to the node as they are: its error names the field.
  g.setLogprobs(p.logprobs >= 0);
  g.setTopLogprobs(p.logprobs < 0 ? 0 : p.logprobs);
  auto stops = g.initStop(static_cast<unsigned>(p.stop.size()));
  for (size_t i = 0; i < p.stop.size(); ++i) stops.set(static_cast<unsigned>(i), p.stop[i]);
  req.setSink(kj::mv(sink_cap));
  auto resp = impl_->wait(req.send().then([](capnp::Response<api::Node::GenerateResults> res) {
    return std::string(res.getRequestId().cStr());
  }));
  r.request_id = resp;
  if (abort_wanted) send_abort();
  impl_->wait(kj::mv(paf.promise));
  if (sref.thrown_) {
    // Let the abort reach the node before the caller possibly drops the connection.
    KJ_IF_MAYBE(pa, impl_->pending_abort) {
      try {
        impl_->wait(kj::mv(*pa));
      } catch (const error&) {
      }
    }
    impl_->pending_abort = nullptr;
    std::rethrow_exception(sref.thrown_);
  }
  impl_->pending_abort = nullptr;
  if (sref.err_) throw *sref.err_;
  return r;
}

void client::abort(const std::string& request_id) {
  auto req = impl_->node.abortRequest();
  req.setRequestId(request_id);
  impl_->wait(req.send().ignoreResult());
}

client_health client::health() {
  auto res = impl_->wait(impl_->node.healthRequest().send().then([](capnp::Response<api::Node::HealthResults> r) {
    auto h = r.getHealth();
    return client_health{h.getOk(),           h.getStatus().cStr(),  h.getUptimeMs(), h.getModelId().cStr(),
                         h.getMaxContext(), h.getReady(), h.getReadyStatus().cStr()};
  }));
  return res;
}

client_stats client::stats() {
  return impl_->wait(impl_->node.statsRequest().send().then([](capnp::Response<api::Node::StatsResults> r) {
    auto s = r.getStats();
    client_stats o;
    o.requests_total = s.getRequestsTotal();
    o.requests_running = s.getRequestsRunning();
    o.requests_queued = s.getRequestsQueued();
    o.tokens_generated = s.getTokensGenerated();
    o.kv_pages_total = s.getKvPagesTotal();
    o.kv_pages_free = s.getKvPagesFree();
    o.rejected_overloaded = s.getRejectedOverloaded();
    return o;
  }));
}

}  // namespace tandem
