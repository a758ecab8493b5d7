// End to end: log-probabilities over the Cap'n Proto RPC API (the C++ client library) equal the
// HTTP API's for the same greedy request on the real `tandem serve` (same worker computation,
// two front ends).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/client/client.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

TEST_CASE("rpc logprobs e2e: the same greedy request gives the same log-probabilities over RPC as over HTTP") {
  temp_dir dir;
  server srv(write_micro_model(dir.path), (dir.path / "serve.log").string());
  auto http = test::post(srv.http_port, "/v1/completions",
                         R"({"prompt":"Once upon a time","max_tokens":8,"temperature":0,"ignore_eos":true,"logprobs":3})");
  REQUIRE_MESSAGE(http.status == 200, http.body);
  const auto v = json::parse(http.body);
  const auto& ch = v.find("choices")->arr.at(0);
  const auto& lp = *ch.find("logprobs");
  const auto& token_logprobs = lp.find("token_logprobs")->arr;
  const auto& tops = lp.find("top_logprobs")->arr;
  REQUIRE(token_logprobs.size() == 8);

  auto c = client::connect("127.0.0.1", srv.rpc_port);
  client_params p;
  p.max_tokens = 8;
  p.temperature = 0;
  p.ignore_eos = true;
  p.logprobs = 3;
  const auto r = c->generate("Once upon a time", p);
  CHECK(r.text == ch.find("text")->s);
  REQUIRE(r.logprobs.size() == 8);
  for (size_t i = 0; i < 8; ++i) {
    INFO("token ", i);
    CHECK(r.logprobs[i].token == r.tokens[i]);
    CHECK(double(r.logprobs[i].logprob) == doctest::Approx(token_logprobs[i].num).epsilon(1e-5));
    // Greedy: the chosen token is the most likely one.
    REQUIRE(r.logprobs[i].top.size() == 3);
    CHECK(r.logprobs[i].top[0].token == r.tokens[i]);
    // HTTP's top map (by token text) holds the same values, unless two ids share a text.
    std::vector<double> want, got;
    for (const auto& m : tops[i].obj) want.push_back(m.second.num);
    for (const auto& e : r.logprobs[i].top) got.push_back(double(e.logprob));
    if (want.size() < got.size()) continue;
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    for (size_t k = 0; k < got.size(); ++k) CHECK(got[k] == doctest::Approx(want[k]).epsilon(1e-5));
  }
}
