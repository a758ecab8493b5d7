// Cap'n Proto RPC front end and the C++ client library against the fake serving_api.
#include <doctest/doctest.h>

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include "schemas/api.capnp.h"
#include "schemas/auth.capnp.h"
#include "tests/transport/fake_api.h"
#include "transport/client/client.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("rpc: generate streams text and returns usage") {
  server_fixture s;
  auto c = client::connect("127.0.0.1", s.rpc_port);
  client_params p;
  p.max_tokens = 50;
  p.temperature = 0;
  std::string streamed;
  int calls = 0;
  auto r = c->generate("abc", p, [&](std::string_view t) {
    streamed += t;
    ++calls;
    return true;
  });
  CHECK(r.text == "Hello world");
  CHECK(streamed == "Hello world");
  CHECK(calls >= 2);  // several events, not one blob
  CHECK(r.finish_reason == "stop");
  CHECK(r.prompt_tokens == 4);
  CHECK(r.completion_tokens == 12);
  CHECK(r.tokens.size() == 12);
  CHECK(r.request_id.rfind("rpc-", 0) == 0);
  auto sub = s.api.submitted();
  REQUIRE(sub.size() == 1);
  CHECK(sub[0].request_id == r.request_id);
  CHECK(sub[0].sampling.temperature == 0.0f);

  p.max_tokens = 4;
  p.stop = {"zz"};
  auto r2 = c->generate("abc", p);
  CHECK(r2.text == "Hell");
  CHECK(r2.finish_reason == "length");
  CHECK(r2.request_id != r.request_id);

  p.max_tokens = 50;
  p.stop = {"o w"};
  auto r3 = c->generate("abc", p);
  CHECK(r3.text == "Hell");
  CHECK(r3.finish_reason == "stop");
}

TEST_CASE("rpc: abort from the text callback ends the request with reason abort") {
  server_fixture s;
  fake_behavior b;
  b.hold = true;
  s.api.set(b);
  auto c = client::connect("127.0.0.1", s.rpc_port);
  client_params p;
  p.max_tokens = 50;
  auto r = c->generate("x", p, [](std::string_view) { return false; });
  CHECK(r.finish_reason == "abort");
  CHECK(r.text == "Hel");
  CHECK(s.api.wait_aborted(r.request_id));
  // The explicit call works too (unknown ids are ignored by the engine).
  c->abort("rpc-unknown");
  CHECK(s.api.wait_aborted("rpc-unknown"));
}

TEST_CASE("rpc: health and stats round trip") {
  server_fixture s;
  auto c = client::connect("127.0.0.1", s.rpc_port);
  auto h = c->health();
  CHECK(h.ok);
  CHECK(h.status == "ok");
  CHECK(h.uptime_ms == 1234);
  CHECK(h.model_id == "fake-model");
  CHECK(h.max_context == 128);
  CHECK(h.ready);
  CHECK(h.ready_status == "ready");
  s.api.set_ready(false, "no live decode target");
  auto d = c->health();
  CHECK(d.ok);  // alive, but cannot serve
  CHECK(!d.ready);
  CHECK(d.ready_status == "no live decode target");
  auto st = c->stats();
  CHECK(st.kv_pages_total == 64);
  CHECK(st.kv_pages_free == 60);
}

TEST_CASE("rpc: errors carry their kind and message") {
  server_fixture s;
  auto c = client::connect("127.0.0.1", s.rpc_port);
  client_params p;
  p.temperature = 7;
  try {
    c->generate("x", p);
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::failed);
    CHECK(std::string(e.what()).find("temperature = 7 is out of range") != std::string::npos);
  }
  fake_behavior b;
  b.fail = error(error_kind::overloaded, "queue full");
  s.api.set(b);
  try {
    c->generate("x", client_params{});
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::overloaded);
    CHECK(std::string(e.what()) == "queue full");
  }
  // The connection still works after errors.
  CHECK(c->health().ok);
}

TEST_CASE("rpc: client disconnect aborts the request, connecting to a closed port fails") {
  {
    server_fixture s;
    fake_behavior b;
    b.hold = true;
    s.api.set(b);
    {
      auto c = client::connect("127.0.0.1", s.rpc_port);
      client_params p;
      p.max_tokens = 50;
      // Returning false aborts; but here drop the client instead by throwing out of the callback.
      CHECK_THROWS(c->generate("x", p, [](std::string_view) -> bool { throw std::runtime_error("client gives up"); }));
    }
    REQUIRE(s.api.wait_submitted(1));
    CHECK(s.api.wait_aborted(s.api.submitted()[0].request_id));
  }
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  uint16_t port = ntohs(a.sin_port);
  ::close(fd);  // nothing listens there now
  try {
    client::connect("127.0.0.1", port);
    FAIL("expected an error");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::disconnected);
  }
}

namespace {
/// A TokenSink that takes the first tokens() call and then does not return from it until
/// `release` resolves: a client that stopped reading its stream.
class stuck_sink final : public api::TokenSink::Server {
 public:
  stuck_sink(kj::ForkedPromise<void>& release, kj::Own<kj::PromiseFulfiller<void>> done)
      : release_(release), done_(kj::mv(done)) {}
  int tokens_calls = 0;
  bool got_done = false;
  api::FinishReason reason = api::FinishReason::NONE;
  api::ErrorKind kind = api::ErrorKind::FAILED;
  std::string message;

 protected:
  kj::Promise<void> tokens(TokensContext) override {
    if (++tokens_calls == 1) return release_.addBranch();
    return kj::READY_NOW;
  }
  kj::Promise<void> done(DoneContext ctx) override {
    got_done = true;
    reason = ctx.getParams().getReason();
    if (ctx.getParams().hasError()) {
      kind = ctx.getParams().getError().getKind();
      message = ctx.getParams().getError().getMessage().cStr();
    }
    done_->fulfill();
    return kj::READY_NOW;
  }

 private:
  kj::ForkedPromise<void>& release_;
  kj::Own<kj::PromiseFulfiller<void>> done_;
};
}  // namespace

TEST_CASE("rpc: a sink that stops taking tokens is cut at limits.rpc_stream_backlog_tokens, aborted, and told why") {
  limits lim;
  lim.rpc_stream_backlog_tokens = 64;
  lim.rpc_socket_bytes = 4096;  // a small stream window: a few dozen tokens() calls in flight
  server_fixture s(lim);
  s.api.context_tokens = 8192;
  fake_behavior b;
  b.output = std::string(4000, 'x');  // 4000 tokens, 4 per event, one event every ms
  b.chunk = 4;
  b.interval_ms = 1;
  s.api.set(b);

  {  // The raw client's event loop must be gone before client::connect makes its own.
    auto io = kj::setupAsyncIo();
    auto addr = io.provider->getNetwork().parseAddress("127.0.0.1", s.rpc_port).wait(io.waitScope);
    auto stream = addr->connect().wait(io.waitScope);
    capnp::TwoPartyClient rpc(*stream);
    auto auth_req = rpc.bootstrap().castAs<auth::Gate>().authenticateRequest();
    auth_req.setKey("");
    api::Node::Client node = auth_req.send().wait(io.waitScope).getCap().castAs<api::Node>();

    auto release = kj::newPromiseAndFulfiller<void>();
    auto released = release.promise.fork();
    auto done = kj::newPromiseAndFulfiller<void>();
    auto sink_own = kj::heap<stuck_sink>(released, kj::mv(done.fulfiller));
    stuck_sink& sink = *sink_own;
    auto req = node.generateRequest();
    req.getRequest().getPrompt().setText("abc");
    req.getRequest().setMaxTokens(4000);
    req.getRequest().setIgnoreEos(true);
    req.setSink(kj::mv(sink_own));
    const std::string id = req.send().wait(io.waitScope).getRequestId().cStr();

    // The server gives up on the stuck stream: the engine request is aborted (its pages freed)
    // while the client still holds the first call (the client's loop runs meanwhile).
    auto& timer = io.provider->getTimer();
    for (int i = 0; i < 1000 && !s.api.wait_aborted(id, std::chrono::milliseconds(0)); ++i)
      timer.afterDelay(10 * kj::MILLISECONDS).wait(io.waitScope);
    CHECK(s.api.wait_aborted(id, std::chrono::milliseconds(0)));
    CHECK(sink.tokens_calls == 1);
    CHECK_FALSE(sink.got_done);
    // The client resumes: the one done() says why, with a kind that means "back off".
    release.fulfiller->fulfill();
    done.promise.wait(io.waitScope);
    CHECK(sink.reason == api::FinishReason::ERROR);
    CHECK(sink.kind == api::ErrorKind::OVERLOADED);
    CHECK(sink.message.find("limits.rpc_stream_backlog_tokens") != std::string::npos);
    auto m = get(s.http_port, "/metrics").body;
    CHECK(m.find("tandem_rpc_stream_backlog_aborts_total 1\n") != std::string::npos);
  }

  // A client that keeps up gets the whole long stream on the same server.
  auto c = client::connect("127.0.0.1", s.rpc_port);
  client_params p;
  p.max_tokens = 4000;
  p.ignore_eos = true;
  auto r = c->generate("abc", p);
  CHECK(r.finish_reason == "length");
  CHECK(r.text.size() == 4000);
}
