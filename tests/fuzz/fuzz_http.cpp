// libFuzzer target: the OpenAI HTTP front end from raw bytes to response (kj-http request
// parsing, routing, auth, body limits, JSON parsing, completion request validation), over an
// in-memory pipe against a serving_api that answers at once. Input modes (first byte):
//   'J' / 'C': the rest is the JSON body of POST /v1/completions / /v1/chat/completions
//   'F': the rest goes to the request framer alone (transport/http/http_framing.h), whole and
//        split into pieces: the result must not depend on the split
//   otherwise: the whole input is the raw HTTP request stream (through the framer and kj-http).
// Also checks JSON invariants on the body: quote() of valid UTF-8 parses back to itself.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <kj/async-io.h>
#include <spdlog/spdlog.h>

#include "tests/transport/fake_api.h"
#include "transport/http/http_framing.h"
#include "transport/http/json.h"
#include "transport/http/openai_server.h"

namespace {

using namespace tandem;

/// Finishes every request at once with a few tokens, each of its n choices (the engine's
/// contract: every choice ends): the engine is not what is fuzzed here.
class instant_api final : public serving_api {
 public:
  void submit(completion_request req, event_callback cb) override {
    ++submitted;
    for (int32_t k = 0; k < std::max(1, req.n); ++k) {
      token_event ev;
      ev.request_id = req.request_id;
      ev.choice = k;
      ev.tokens = {'o', 'k'};
      ev.finished = true;
      ev.reason = finish_reason::length;
      ev.prompt_tokens = static_cast<int32_t>(req.prompt.size());
      ev.completion_tokens = 2;
      cb(std::move(ev));
    }
  }
  void abort(const std::string&) override {}
  health_info health() const override { return {true, "ok", 1}; }
  stats_info stats() const override { return {}; }
  std::string metrics_text() const override { return ""; }
  const tokenizer& tok() const override { return tok_; }
  std::string model_id() const override { return "fuzz-model"; }
  int32_t max_context() const override { return 256; }
  int64_t submitted = 0;

 private:
  test::fake_tokenizer tok_;
};

struct env {
  env() {
    spdlog::set_level(spdlog::level::off);
    lim.max_body_bytes = 1 << 16;
    lim.max_new_tokens = 64;
    lim.http_header_timeout_ms = 2000;
    lim.http_body_timeout_ms = 2000;
    server = std::make_unique<openai_server>(api, lim, io.provider->getTimer());
    // Auth on, so the key check is fuzzed too; this key opens everything.
    server->set_auth(std::make_shared<api_keys>(std::vector<std::string>{"fuzz-key-0123456789"}), {"/health"});
  }
  kj::AsyncIoContext io = kj::setupAsyncIo();
  instant_api api;
  limits lim;
  std::unique_ptr<openai_server> server;
};

std::string request(const std::string& path, const std::string& body) {
  return "POST " + path + " HTTP/1.1\r\nHost: f\r\nAuthorization: Bearer fuzz-key-0123456789\r\n"
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

void check_json_invariants(const std::string& body) {
  if (!json::valid_utf8(body)) return;
  auto back = json::parse(json::quote(body));
  if (back.k != json::kind::string || back.s != body) std::abort();  // quote/parse must round-trip
}

/// The framer's verdict on `in` fed in pieces of `piece` bytes (0 = whole).
struct framed {
  std::string out;
  std::optional<unsigned> status;
  bool in_body = false, finished = false;
  uint64_t heads = 0;
  bool operator==(const framed&) const = default;
};
framed frame(std::string_view in, size_t piece) {
  transport::request_framer f(1024);
  framed r;
  if (piece == 0) piece = in.size() + 1;
  for (size_t i = 0; i < in.size(); i += piece) f.feed(in.substr(i, piece), r.out);
  if (f.error()) r.status = f.error()->status, r.in_body = f.error_in_body();
  r.finished = f.finished();
  r.heads = f.heads();
  return r;
}

void check_framer(std::string_view in) {
  const framed whole = frame(in, 0);
  if (whole.out.size() > in.size()) std::abort();  // it only ever hands on input bytes
  for (size_t piece : {1, 3, 7, 64})
    if (!(frame(in, piece) == whole)) std::abort();  // the split must not matter
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static env* e = new env();  // one event loop per process
  std::string in(reinterpret_cast<const char*>(data), size);
  if (!in.empty() && in[0] == 'F') {
    check_framer(std::string_view(in).substr(1));
    return 0;
  }
  if (!in.empty() && (in[0] == 'J' || in[0] == 'C')) {
    std::string body = in.substr(1);
    check_json_invariants(body);
    try {
      json::parse(body);
    } catch (const json::parse_error&) {
    }
    in = request(in[0] == 'J' ? "/v1/completions" : "/v1/chat/completions", body);
  }
  auto pipe = kj::newTwoWayPipe();
  auto served = e->server->serve_connection(kj::mv(pipe.ends[0])).catch_([](kj::Exception&&) {});
  auto& client = *pipe.ends[1];
  auto bytes = kj::heapString(in.data(), in.size());
  auto wrote = client.write(bytes.begin(), bytes.size())
                   .then([&client] { client.shutdownWrite(); })
                   .catch_([](kj::Exception&&) {})
                   .eagerlyEvaluate(nullptr);
  // The server must finish every input on its own: a hang is a bug (libFuzzer's -timeout).
  auto response = client.readAllText(1 << 20).catch_([](kj::Exception&&) { return kj::String(); });
  auto text = response.wait(e->io.waitScope);
  // The server must close the connection on its own; the rest of a write it stopped reading is
  // dropped (a socket would buffer it; the in-memory pipe blocks).
  served.wait(e->io.waitScope);
  (void)text;
  return 0;
}
