// Completions `suffix` (fill-in-the-middle) against the fake serving_api: the engine gets
// [BOS] FIM_PRE prompt FIM_SUF suffix FIM_MID; a model without FIM tokens is 422 naming suffix.
#include <doctest/doctest.h>

#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("http: suffix builds the FIM prompt where the model has FIM tokens, else 422 naming suffix") {
  {
    server_fixture s;
    auto r = post(s.http_port, "/v1/completions", R"({"prompt":"ab","suffix":"cd","max_tokens":3})");
    CHECK(r.status == 422);
    auto j = json::parse(r.body);
    CHECK(j.find("error")->find("param")->s == "suffix");
    CHECK(j.find("error")->find("message")->s.find("fill-in-the-middle tokens") != std::string::npos);
    CHECK(s.api.submitted().empty());
  }
  server_fixture s;
  s.api.set_fim(250, 251, 252);
  auto r = post(s.http_port, "/v1/completions", R"({"prompt":"ab","suffix":"cd","max_tokens":3})");
  REQUIRE(r.status == 200);
  auto sub = s.api.submitted();
  REQUIRE(sub.size() == 1);
  const int32_t a = 'a' + 3, b = 'b' + 3, c = 'c' + 3, d = 'd' + 3;
  CHECK(sub[0].prompt == std::vector<int32_t>{1, 250, a, b, 251, c, d, 252});
  // Token ids as the prompt; an empty suffix is a plain completion.
  auto r2 = post(s.http_port, "/v1/completions", R"({"prompt":[7,8],"suffix":"c","max_tokens":3})");
  REQUIRE(r2.status == 200);
  auto r3 = post(s.http_port, "/v1/completions", R"({"prompt":"ab","suffix":"","max_tokens":3})");
  REQUIRE(r3.status == 200);
  sub = s.api.submitted();
  REQUIRE(sub.size() == 3);
  CHECK(sub[1].prompt == std::vector<int32_t>{1, 250, 7, 8, 251, c, 252});
  CHECK(sub[2].prompt == std::vector<int32_t>{1, a, b});
  // With echo it is refused, naming suffix.
  auto r4 = post(s.http_port, "/v1/completions", R"({"prompt":"ab","suffix":"c","echo":true})");
  CHECK(r4.status == 422);
  CHECK(json::parse(r4.body).find("error")->find("param")->s == "suffix");
}
