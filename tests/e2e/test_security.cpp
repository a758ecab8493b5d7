// `tandem serve --api-key-file` end to end: HTTP bearer keys, `tandem generate` and
// `tandem inspect` with --api-key-file / TANDEM_API_KEY, and the key file's permission check.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::e2e;

namespace {

const std::string key = "e2e-key-0123456789abcdef0123456789";

std::string write_keys(const temp_dir& dir, mode_t mode) {
  auto p = (dir.path / "keys").string();
  std::ofstream(p) << "# test keys\n" << key << "\n";
  ::chmod(p.c_str(), mode);
  return p;
}

struct run_result {
  int code = -1;
  std::string out, err;
};

run_result run(const std::vector<std::string>& args, const temp_dir& dir, const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> argv = {TANDEM_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  auto err_path = (dir.path / "cmd.err").string();
  child p(argv, env, err_path);
  run_result r;
  r.out = p.read_all(std::chrono::seconds(60));
  r.code = p.wait(std::chrono::seconds(60));
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

}  // namespace

TEST_CASE("security e2e: serve --api-key-file guards HTTP, RPC and admin, and the tools pass the key") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::string keys = write_keys(dir, 0600);
  server srv(model, (dir.path / "serve.log").string(), {"--admin-port", "0", "--api-key-file", keys});

  CHECK(test::get(srv.http_port, "/health").status == 200);
  CHECK(test::get(srv.http_port, "/v1/models").status == 401);
  auto ok = test::http_exchange(srv.http_port, test::request_text("POST", "/v1/completions", R"({"prompt":"hi","max_tokens":2})",
                                                                  "Authorization: Bearer " + key + "\r\n"));
  CHECK(ok.status == 200);

  const std::string port = std::to_string(srv.rpc_port);
  auto no_key = run({"generate", "--port", port, "--prompt", "hi", "--max-tokens", "2"}, dir);
  CHECK(no_key.code != 0);
  CHECK(no_key.err.find("an API key is required") != std::string::npos);
  auto with_file = run({"generate", "--port", port, "--prompt", "hi", "--max-tokens", "2", "--api-key-file", keys}, dir);
  CHECK(with_file.code == 0);
  CHECK(with_file.err.find("completion_tokens=2") != std::string::npos);

  const std::string admin = "127.0.0.1:" + std::to_string(srv.admin_port);
  auto inspect_no_key = run({"inspect", admin, "--json"}, dir);
  CHECK(inspect_no_key.code != 0);
  CHECK(inspect_no_key.err.find("API key") != std::string::npos);
  auto inspect_env = run({"inspect", admin, "--json"}, dir, {{"TANDEM_API_KEY", key}});
  CHECK(inspect_env.code == 0);
  REQUIRE(inspect_env.code == 0);
  CHECK(json::parse(inspect_env.out).find("healthy")->b);
}

TEST_CASE("security e2e: serve refuses a key file others can read, naming chmod 600") {
  temp_dir dir;
  const std::string model = write_micro_model(dir.path);
  const std::string keys = write_keys(dir, 0644);
  auto r = run({"serve", "--model", model, "--port", "0", "--rpc-port", "0", "--api-key-file", keys}, dir);
  CHECK(r.code == 1);
  CHECK(r.err.find("run `chmod 600 " + keys + "`") != std::string::npos);
}
