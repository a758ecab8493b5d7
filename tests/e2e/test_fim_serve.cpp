// End to end: `tandem serve` with a model whose GGUF names fill-in-the-middle tokens (written by
// `tandem make-model --fim-tokens`) honours completions `suffix`: the prompt the model sees is
// [BOS] FIM_PRE prompt FIM_SUF suffix FIM_MID; without the tokens, suffix is 422 naming it.
#include <doctest/doctest.h>

#include <filesystem>

#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

std::string make_model(const std::filesystem::path& dir, const std::string& name, std::vector<std::string> extra) {
  const std::string path = (dir / name).string();
  std::vector<std::string> args = {TANDEM_BINARY, "make-model", "--preset", "micro", "--seed", "7", "--out", path};
  args.insert(args.end(), extra.begin(), extra.end());
  child c(args, {}, (dir / (name + ".err")).string());
  c.read_all(std::chrono::seconds(60));
  REQUIRE(c.wait(std::chrono::seconds(10)) == 0);
  return path;
}

int64_t prompt_tokens(uint16_t port, const std::string& body, int* status) {
  auto r = test::post(port, "/v1/completions", body);
  *status = r.status;
  if (r.status != 200) return -1;
  return json::parse(r.body).find("usage")->find("prompt_tokens")->i;
}

}  // namespace

TEST_CASE("serve: completions suffix with a model's FIM tokens, 422 without them") {
  temp_dir dir;
  const std::string fim = make_model(dir.path, "fim.gguf", {"--fim-tokens", "3,4,5"});
  const std::string plain = make_model(dir.path, "plain.gguf", {});
  {
    server srv(fim, (dir.path / "fim.log").string());
    int st = 0;
    const int64_t alone = prompt_tokens(srv.http_port, R"({"prompt":[10,11,12],"max_tokens":2})", &st);
    REQUIRE(st == 200);
    const int64_t filled = prompt_tokens(srv.http_port, R"({"prompt":[10,11,12],"suffix":"x","max_tokens":2})", &st);
    REQUIRE(st == 200);
    // BOS, PRE, the 3 ids, SUF, the suffix's token(s), MID: at least 4 + 3 + 1 more than the ids.
    CHECK(filled >= alone + 5);
  }
  server srv(plain, (dir.path / "plain.log").string());
  auto r = test::post(srv.http_port, "/v1/completions", R"({"prompt":"a","suffix":"b","max_tokens":2})");
  CHECK(r.status == 422);
  CHECK(json::parse(r.body).find("error")->find("param")->s == "suffix");
}
