// Log-probabilities over the Cap'n Proto RPC API (GenerateRequest.logprobs / topLogprobs ->
// TokenSink.tokens' logprobs) and the C++ client library, against the fake serving_api (whose
// events carry the chosen token at -0.25 and alternatives id+1, id+2, ... one nat apart).
#include <doctest/doctest.h>

#include <capnp/rpc-twoparty.h>
#include <fmt/format.h>
#include <kj/async-io.h>

#include "schemas/api.capnp.h"
#include "schemas/auth.capnp.h"
#include "tests/transport/fake_api.h"
#include "transport/client/client.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("rpc logprobs: one entry per token with its top alternatives, none unless asked") {
  server_fixture s;
  s.api.set({.output = "Hello", .chunk = 2});
  auto c = client::connect("127.0.0.1", s.rpc_port);
  client_params p;
  p.max_tokens = 50;
  p.temperature = 0;
  p.logprobs = 2;
  auto r = c->generate("abc", p);
  CHECK(r.text == "Hello");
  REQUIRE(s.api.submitted().size() == 1);
  CHECK(s.api.submitted()[0].logprobs == 2);
  // Paired with the ids the stream carried, whatever the events' grouping.
  REQUIRE(r.logprobs.size() == r.tokens.size());
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    CHECK(r.logprobs[i].token == r.tokens[i]);
    CHECK(r.logprobs[i].logprob == doctest::Approx(-0.25));
    REQUIRE(r.logprobs[i].top.size() == 2);
    CHECK(r.logprobs[i].top[0].token == r.tokens[i]);
    CHECK(r.logprobs[i].top[1].token == r.tokens[i] + 1);
    CHECK(r.logprobs[i].top[1].logprob == doctest::Approx(-1.25));
  }
  // logprobs 0: the chosen token's only.
  p.logprobs = 0;
  auto r0 = c->generate("abc", p);
  REQUIRE(r0.logprobs.size() == r0.tokens.size());
  CHECK(r0.logprobs[0].top.empty());
  CHECK(s.api.submitted()[1].logprobs == 0);
  // Not asked: the engine is not asked either, and nothing comes back.
  p.logprobs = -1;
  auto none = c->generate("abc", p);
  CHECK(none.logprobs.empty());
  CHECK(s.api.submitted()[2].logprobs == -1);
  // A stop string: the log-probabilities of the tokens up to the one that completed it.
  p.logprobs = 1;
  p.stop = {"ll"};
  auto cut = c->generate("abc", p);
  CHECK(cut.text == "He");
  CHECK(cut.finish_reason == "stop");
  CHECK(cut.logprobs.size() == cut.tokens.size());
  CHECK(cut.tokens.size() == 4);  // H e l l: the second l completed the stop string
}

TEST_CASE("rpc logprobs: a count out of range or topLogprobs without logprobs is an error naming the field") {
  server_fixture s;
  {
    auto c = client::connect("127.0.0.1", s.rpc_port);
    client_params p;
    p.logprobs = 21;
    try {
      c->generate("x", p);
      FAIL("expected an error");
    } catch (const tandem::error& e) {
      CHECK(e.kind() == error_kind::failed);
      CHECK(std::string(e.what()).find("topLogprobs = 21 is out of range; use 0 to 20") != std::string::npos);
    }
    CHECK(s.api.submitted().empty());
  }
  // The raw API can send topLogprobs without logprobs.
  auto io = kj::setupAsyncIo();
  auto addr = io.provider->getNetwork().parseAddress("127.0.0.1", s.rpc_port).wait(io.waitScope);
  auto stream = addr->connect().wait(io.waitScope);
  capnp::TwoPartyClient rpc(*stream);
  auto auth_req = rpc.bootstrap().castAs<auth::Gate>().authenticateRequest();
  auth_req.setKey("");
  api::Node::Client node = auth_req.send().wait(io.waitScope).getCap().castAs<api::Node>();
  for (int32_t top : {3, -1}) {
    auto req = node.generateRequest();
    req.getRequest().getPrompt().setText("abc");
    req.getRequest().setTopLogprobs(top);
    req.getRequest().setLogprobs(top < 0);
    try {
      req.send().wait(io.waitScope);
      FAIL("expected an error");
    } catch (const kj::Exception& e) {
      const std::string what = e.getDescription().cStr();
      CHECK(e.getType() == kj::Exception::Type::FAILED);
      CHECK(what.find(fmt::format("topLogprobs = {}", top)) != std::string::npos);
      if (top > 0) CHECK(what.find("needs logprobs = true") != std::string::npos);
    }
  }
  CHECK(s.api.submitted().empty());
}
