// API keys (HTTP bearer, the RPC and admin Gate), and what the listeners bind.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <capnp/ez-rpc.h>

#include "schemas/admin.capnp.h"
#include "schemas/auth.capnp.h"
#include "tests/transport/fake_api.h"
#include "transport/auth/api_keys.h"
#include "transport/client/client.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;

namespace {

const std::string key_a = "0123456789abcdef0123456789abcdef";
const std::string key_b = "fedcba9876543210fedcba9876543210";

/// A key file in a fresh temp directory, removed at the end of the test.
struct key_file {
  explicit key_file(const std::string& text, mode_t mode = 0600) {
    char tmpl[] = "/tmp/tandem-keys-XXXXXX";
    dir = ::mkdtemp(tmpl);
    path = dir + "/keys";
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
  }
  ~key_file() { std::filesystem::remove_all(dir); }
  std::string dir, path;
};

std::string load_error(const std::string& text, mode_t mode = 0600) {
  key_file f(text, mode);
  try {
    api_keys::load_file(f.path);
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

front_end_options with_keys(std::vector<std::string> allow = {"/health"}) {
  auto o = server_fixture::options();
  o.keys = std::make_shared<api_keys>(std::vector<std::string>{key_a, key_b});
  o.auth_allowlist = std::move(allow);
  o.admin_port = 0;
  return o;
}

std::string auth_header(const std::string& key) { return "Authorization: Bearer " + key + "\r\n"; }

void check_401(const http_response& r, const std::string& code) {
  CHECK(r.status == 401);
  CHECK(r.headers.at("www-authenticate") == "Bearer");
  CHECK(r.headers.at("content-type") == "application/json");
  auto j = json::parse(r.body);
  auto* e = j.find("error");
  REQUIRE(e);
  CHECK(e->find("code")->s == code);
  CHECK(e->find("message")->s.find("Authorization: Bearer") != std::string::npos);
}

}  // namespace

TEST_CASE("api keys: the key file must be private, non-empty, with long printable keys") {
  key_file ok("# comment\n\n  " + key_a + "  \n" + key_b + "\n");
  auto k = api_keys::load_file(ok.path);
  CHECK(k.size() == 2);
  CHECK(k.check(key_a));
  CHECK(k.check(key_b));
  CHECK_FALSE(k.check(""));
  CHECK_FALSE(k.check(key_a.substr(0, 31)));  // a prefix is not the key
  CHECK_FALSE(k.check(key_a + "0"));          // nor is an extension
  CHECK(load_error(key_a + "\n", 0644).find("run `chmod 600") != std::string::npos);
  CHECK(load_error(key_a + "\n", 0640).find("accessible by group or others (mode 640)") != std::string::npos);
  CHECK(load_error("# only a comment\n").find("holds no key") != std::string::npos);
  CHECK(load_error("short\n").find("use at least 16") != std::string::npos);
  CHECK(load_error("0123456789abcdef 0123\n").find("printable ASCII without spaces") != std::string::npos);
  try {
    api_keys::load_file("/nonexistent/keys");
    FAIL("a missing file must be refused");
  } catch (const error& e) {
    CHECK(std::string(e.what()).find("chmod 600") != std::string::npos);
  }
  // Without keys everything passes (auth off).
  CHECK(api_keys().check("anything"));
}

TEST_CASE("api keys: bearer header parsing") {
  CHECK(bearer_token("Bearer abc").value() == "abc");
  CHECK(bearer_token("bearer   abc ").value() == "abc");
  CHECK_FALSE(bearer_token("Basic abc"));
  CHECK_FALSE(bearer_token("Bearer "));
  CHECK_FALSE(bearer_token(""));
}

TEST_CASE("api keys: the client tool key comes from --api-key-file, else TANDEM_API_KEY") {
  key_file f(key_b + "\n" + key_a + "\n");
  CHECK(client_api_key(f.path) == key_b);
  ::setenv("TANDEM_API_KEY", key_a.c_str(), 1);
  CHECK(client_api_key("") == key_a);
  ::unsetenv("TANDEM_API_KEY");
  CHECK(client_api_key("") == "");
}

TEST_CASE("http auth: every route but the allowlist needs a valid bearer key") {
  server_fixture s(with_keys());
  CHECK(get(s.http_port, "/health").status == 200);  // allowlisted
  check_401(get(s.http_port, "/v1/models"), "missing_api_key");
  check_401(get(s.http_port, "/metrics"), "missing_api_key");  // not allowlisted by default
  check_401(get(s.http_port, "/no/such/route"), "missing_api_key");  // no route probing without a key
  check_401(http_exchange(s.http_port, request_text("GET", "/v1/models", "", auth_header("wrong-key-wrong-key"))),
            "invalid_api_key");
  check_401(http_exchange(s.http_port, request_text("GET", "/v1/models", "", "Authorization: Basic " + key_a + "\r\n")),
            "missing_api_key");
  check_401(http_exchange(s.http_port, request_text("POST", "/v1/completions", R"({"prompt":"abc","max_tokens":2})",
                                                    auth_header(key_a.substr(0, 20)))),
            "invalid_api_key");
  CHECK(s.api.submitted().empty());  // no engine work for refused requests

  CHECK(http_exchange(s.http_port, request_text("GET", "/v1/models", "", auth_header(key_a))).status == 200);
  CHECK(http_exchange(s.http_port, request_text("GET", "/v1/models", "", auth_header(key_b))).status == 200);
  auto r = http_exchange(s.http_port, request_text("POST", "/v1/completions", R"({"prompt":"abc","max_tokens":2})",
                                                   auth_header(key_a)));
  CHECK(r.status == 200);
  CHECK(s.api.submitted().size() == 1);
  auto m = http_exchange(s.http_port, request_text("GET", "/metrics", "", auth_header(key_b)));
  REQUIRE(m.status == 200);
  CHECK(m.body.find("tandem_http_auth_failures_total 6") != std::string::npos);
  CHECK(m.body.find("tandem_http_requests_total{route=\"other\",status=\"401\"} 6") != std::string::npos);
}

TEST_CASE("http auth: /metrics can be allowlisted for an unauthenticated scrape") {
  server_fixture s(with_keys({"/health", "/metrics"}));
  CHECK(get(s.http_port, "/metrics").status == 200);
  check_401(get(s.http_port, "/v1/models"), "missing_api_key");
}

TEST_CASE("http auth: off without keys") {
  server_fixture s;
  CHECK(get(s.http_port, "/v1/models").status == 200);
  CHECK(get(s.http_port, "/metrics").status == 200);
}

TEST_CASE("rpc auth: the Node API needs a key, and a wrong one fails naming the fix") {
  server_fixture s(with_keys());
  for (const std::string& bad : {std::string(), std::string("not-the-key-not-the-key")}) {
    try {
      client::connect("127.0.0.1", s.rpc_port, bad);
      FAIL("connect must refuse a missing or wrong key");
    } catch (const error& e) {
      CHECK(e.kind() == error_kind::failed);
      CHECK(std::string(e.what()).find("TANDEM_API_KEY") != std::string::npos);
      CHECK(std::string(e.what()).find(bad.empty() ? "an API key is required" : "the API key is not valid") != std::string::npos);
    }
  }
  CHECK(s.api.submitted().empty());
  auto c = client::connect("127.0.0.1", s.rpc_port, key_b);
  client_params p;
  p.max_tokens = 3;
  auto r = c->generate("abc", p);
  CHECK(r.completion_tokens == 3);
  CHECK(c->health().ok);
}

TEST_CASE("rpc auth: off without keys, any key (also none) is accepted") {
  server_fixture s;
  CHECK(client::connect("127.0.0.1", s.rpc_port)->health().ok);
  CHECK(client::connect("127.0.0.1", s.rpc_port, "whatever-whatever")->health().ok);
}

TEST_CASE("admin auth: the Admin interface needs a key too") {
  server_fixture s(with_keys());
  REQUIRE(s.admin_port != 0);
  capnp::EzRpcClient c("127.0.0.1", s.admin_port);
  auto& ws = c.getWaitScope();
  auto gate = c.getMain<auth::Gate>();
  {
    auto req = gate.authenticateRequest();
    req.setKey("wrong-wrong-wrong-wrong");
    auto admin = req.send().getCap().castAs<admin::Admin>();
    try {
      admin.inspectRequest().send().wait(ws);
      FAIL("inspect must fail without a valid key");
    } catch (const kj::Exception& e) {
      CHECK(e.getType() == kj::Exception::Type::FAILED);
      CHECK(std::string(e.getDescription().cStr()).find("admin: the API key is not valid") != std::string::npos);
    }
  }
  auto req = gate.authenticateRequest();
  req.setKey(key_a);
  auto admin = req.send().getCap().castAs<admin::Admin>();
  // With the key the call reaches the real Admin capability (the fake node has no report to give).
  try {
    admin.inspectRequest().send().wait(ws);
  } catch (const kj::Exception& e) {
    CHECK(std::string(e.getDescription().cStr()).find("does not implement inspect") != std::string::npos);
  }
}

TEST_CASE("binding: listeners bind 127.0.0.1 by default, and only it") {
  server_fixture s;
  CHECK(server_fixture::options().host == "127.0.0.1");
  CHECK(s.bound.at("http") == "127.0.0.1");
  CHECK(s.bound.at("rpc") == "127.0.0.1");
  // 127.0.0.2 is this machine too (all of 127/8 is loopback), but not the bound address: refused.
  for (uint16_t port : {s.http_port, s.rpc_port}) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    ::inet_pton(AF_INET, "127.0.0.2", &a.sin_addr);
    int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    int err = errno;
    ::close(fd);
    CHECK(rc != 0);
    CHECK(err == ECONNREFUSED);
  }
  CHECK(get(s.http_port, "/health").status == 200);  // ... while 127.0.0.1 answers
}
