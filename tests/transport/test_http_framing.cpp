// HTTP framing at the front end: the pure request_framer (transport/http/http_framing.h) and, over
// raw sockets, what a hostile or broken client gets: a JSON 4xx/5xx naming the fix, nothing of
// kj's internals, the connection closed where it must be, a metric, and /health still serving.
#include <doctest/doctest.h>

#include <poll.h>

#include <chrono>

#include "tests/transport/fake_api.h"
#include "transport/http/http_framing.h"
#include "transport/http/json.h"

using namespace tandem;
using namespace tandem::test;
using tandem::transport::check_request_head;
using tandem::transport::framing_error;
using tandem::transport::head_info;
using tandem::transport::request_framer;

namespace {

framing_error head_error(std::string_view head) {
  auto r = check_request_head(head);
  REQUIRE(std::holds_alternative<framing_error>(r));
  return std::get<framing_error>(r);
}

head_info head_ok(std::string_view head) {
  auto r = check_request_head(head);
  if (auto* e = std::get_if<framing_error>(&r)) FAIL("unexpected error: " << e->message);
  return std::get<head_info>(r);
}

/// Feeds `in` one byte at a time (the worst split) and returns what was handed on.
std::string feed_bytewise(request_framer& f, const std::string& in) {
  std::string out;
  for (char c : in) f.feed(std::string_view(&c, 1), out);
  return out;
}

}  // namespace

TEST_CASE("http framing: request heads") {
  auto h = head_ok("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(h.keep_alive);
  CHECK(h.body == head_info::body_kind::none);
  h = head_ok("POST /v1/completions HTTP/1.1\r\nContent-Length: 12\r\n\r\n");
  CHECK(h.body == head_info::body_kind::length);
  CHECK(h.length == 12);
  h = head_ok("POST / HTTP/1.1\nTransfer-Encoding:  Chunked \n\n");
  CHECK(h.body == head_info::body_kind::chunked);
  CHECK(!head_ok("GET / HTTP/1.0\r\n\r\n").keep_alive);
  CHECK(!head_ok("GET / HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n").keep_alive);
  CHECK(head_ok("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n").length == UINT64_MAX);

  CHECK(head_error("GET / HTTP/9.9\r\n\r\n").status == 505);
  CHECK(head_error("GET / HTTP/2.0\r\n\r\n").code == "http_version_not_supported");
  for (const char* bad : {
           "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length:\r\n\r\n",
           "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
           "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: x\r\n Transfer-Encoding: chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nContent-Length : 5\r\n\r\n",
           "GET / HTTP/1.1\r\nHost x\r\n\r\n",
           "HELLO THERE\r\n\r\n",
           "GET  / HTTP/1.1\r\n\r\n",
           "GET / http/1.1\r\n\r\n",
       }) {
    CAPTURE(bad);
    auto e = head_error(bad);
    CHECK(e.status == 400);
    CHECK(e.code == "bad_http");
    CHECK(!e.message.empty());
  }
}

TEST_CASE("http framing: the framer hands on sound requests whatever the split") {
  const std::string a = "POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello";
  const std::string b = "POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n";
  const std::string c = "GET /c HTTP/1.1\r\nConnection: close\r\n\r\n";
  request_framer f(1024);
  std::string out = feed_bytewise(f, "\r\n" + a + b + c + "GET /ignored HTTP/1.1\r\n\r\n");
  CHECK(out == a + b + c);  // the leading empty line is dropped, nothing after the closing request
  CHECK(!f.error());
  CHECK(f.finished());
  CHECK(f.heads() == 3);
  CHECK(f.take_head()->keep_alive);
  CHECK(f.take_head()->keep_alive);
  CHECK(!f.take_head()->keep_alive);
  CHECK(!f.take_head());

  request_framer whole(1024);
  std::string out2;
  whole.feed(a + b, out2);
  CHECK(out2 == a + b);
  CHECK(whole.in_head());
  CHECK(!whole.head_started());
  whole.feed("GET /", out2);
  CHECK(whole.head_started());
  CHECK(out2 == a + b);  // a head is held back until complete
}

TEST_CASE("http framing: the framer stops at the first framing error") {
  struct row {
    std::string in;
    unsigned status;
    bool in_body;
  };
  const std::string chunked = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (const auto& r : std::vector<row>{
           {chunked + "ZZZ\r\nabc\r\n0\r\n\r\n", 400, true},
           {chunked + "-1\r\nabc\r\n0\r\n\r\n", 400, true},
           {chunked + "\r\n", 400, true},
           {chunked + "10000000000000000\r\n", 400, true},
           {chunked + "3\r\nabcdef\r\n0\r\n\r\n", 400, true},
           {chunked + std::string(2000, '1'), 400, true},
           {"GET / HTTP/1.1\r\nX: " + std::string(2000, 'a') + "\r\n\r\n", 431, false},
           {"GET / HTTP/1.1\r\nX: " + std::string(5000, 'a'), 431, false},
           {"GET / HTTP/1.1\r\n\r\nGET / HTTP/7.0\r\n\r\n", 505, false},
       }) {
    CAPTURE(r.in.substr(0, 80));
    request_framer f(1024);
    std::string out = feed_bytewise(f, r.in);
    REQUIRE(f.error());
    CHECK(f.error()->status == r.status);
    CHECK(f.error_in_body() == r.in_body);
  }
}

TEST_CASE("http framing: the head-reader bound and the log gate") {
  transport::head_reader_bound b(2);
  CHECK(b.acquire("a"));
  CHECK(b.acquire("a"));
  CHECK(!b.acquire("a"));
  CHECK(b.acquire("b"));
  CHECK(b.refused() == 1);
  CHECK(b.readers() == 3);
  b.release("a");
  CHECK(b.acquire("a"));
  b.release("a");
  b.release("a");
  b.release("b");
  CHECK(b.readers() == 0);

  transport::log_gate g(1000);
  CHECK(g.allow(0) == 0);
  CHECK(!g.allow(10));
  CHECK(!g.allow(999));
  CHECK(g.allow(1000) == 2);
}

// ---- over raw sockets

namespace {

limits framing_limits() {
  limits l;
  l.max_body_bytes = 4096;
  l.max_new_tokens = 64;
  l.http_header_timeout_ms = 300;
  l.http_body_timeout_ms = 2000;
  l.http_max_head_bytes = 65536;
  return l;
}

struct exchange {
  http_response r;
  std::string raw;
  bool closed = false;  ///< the server closed the connection after the response
  int64_t close_ms = 0; ///< from the end of the response to the close
};

/// Sends `raw`, reads one response, then waits (at most 3 s) to see whether the server closes.
exchange talk(uint16_t port, const std::string& raw) {
  exchange x;
  int fd = connect_to(port);
  REQUIRE(fd >= 0);
  send_all(fd, raw);
  char buf[65536];
  while (!response_complete(x.raw)) {
    ssize_t n = recv_some(fd, buf, sizeof buf);
    if (n <= 0) break;
    x.raw.append(buf, static_cast<size_t>(n));
  }
  x.r = parse_response(x.raw);
  timeval tv{3, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    ssize_t n = recv_some(fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) {
      x.closed = true;
      break;
    }
    if (n < 0) break;
  }
  x.close_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  ::close(fd);
  return x;
}

int64_t metric(uint16_t port, const std::string& name) {
  auto body = get(port, "/metrics").body;
  auto p = body.find("\n" + name + " ");
  if (p == std::string::npos) return -1;
  return std::stoll(body.substr(p + name.size() + 2));
}

void check_json_error(const exchange& x, const std::string& code) {
  INFO("response: " << x.raw);
  CHECK(x.r.headers.count("content-type"));
  if (x.r.headers.count("content-type")) CHECK(x.r.headers.at("content-type") == "application/json");
  CHECK(x.raw.find("kj/") == std::string::npos);
  CHECK(x.raw.find(".c++") == std::string::npos);
  CHECK(x.raw.find("stack") == std::string::npos);
  json::value j;
  REQUIRE_NOTHROW(j = json::parse(x.r.body));
  auto* e = j.find("error");
  REQUIRE(e);
  CHECK(e->find("code")->s == code);
  CHECK(!e->find("message")->s.empty());
}

std::string post_head(const std::string& extra) {
  return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra + "\r\n";
}

}  // namespace

TEST_CASE("http framing: each malformed request gets a JSON error, is counted and closes the connection") {
  server_fixture s(framing_limits());
  struct row {
    const char* what;
    std::string raw;
    int status;
    std::string code;
    int protocol_errors;  ///< added to tandem_http_protocol_errors_total
  };
  const std::string big(130 * 1024, 'a');
  const std::vector<row> rows = {
      {"duplicate Content-Length", post_head("Content-Length: 2\r\nContent-Length: 2\r\n") + "{}", 400, "bad_http", 1},
      {"Content-Length list", post_head("Content-Length: 2, 2\r\n") + "{}", 400, "bad_http", 1},
      {"negative Content-Length", post_head("Content-Length: -5\r\n") + "{}", 400, "bad_http", 1},
      {"Transfer-Encoding gzip", post_head("Transfer-Encoding: gzip\r\n") + "{}", 400, "bad_http", 1},
      {"chunk size ZZZ", post_head("Transfer-Encoding: chunked\r\n") + "ZZZ\r\n{}\r\n0\r\n\r\n", 400, "bad_http", 1},
      {"chunk size -1", post_head("Transfer-Encoding: chunked\r\n") + "-1\r\n{}\r\n0\r\n\r\n", 400, "bad_http", 1},
      {"chunk longer than its size", post_head("Transfer-Encoding: chunked\r\n") + "1\r\n{}\r\n0\r\n\r\n", 400, "bad_http", 1},
      {"Content-Length and Transfer-Encoding",
       post_head("Content-Length: 6\r\nTransfer-Encoding: chunked\r\n") + "2\r\n{}\r\n0\r\n\r\n", 400, "bad_http", 1},
      {"HTTP/9.9", "GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 505, "http_version_not_supported", 1},
      {"head of 130 KiB", "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + big + "\r\n\r\n", 431, "head_too_large", 1},
      {"head just over the limit", "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(65536, 'b') + "\r\n\r\n",
       431, "head_too_large", 1},
      {"not HTTP", "HELLO THERE\r\n\r\n", 400, "bad_http", 1},
      {"bad header line", "GET /health HTTP/1.1\r\nHost x\r\n\r\n", 400, "bad_http", 1},
      {"folded header", "GET /health HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400, "bad_http", 1},
  };
  for (const auto& c : rows) {
    const std::string what = c.what;
    CAPTURE(what);
    const int64_t before = metric(s.http_port, "tandem_http_protocol_errors_total");
    auto x = talk(s.http_port, c.raw);
    CHECK(x.r.status == c.status);
    if (x.r.status != 0) check_json_error(x, c.code);
    CHECK(x.closed);
    if (x.r.headers.count("connection")) CHECK(x.r.headers.at("connection") == "close");
    CHECK(metric(s.http_port, "tandem_http_protocol_errors_total") == before + c.protocol_errors);
    CHECK(get(s.http_port, "/health").status == 200);
  }
  CHECK(s.api.submitted().empty());
  // The requests counter has them under route "other".
  auto m = get(s.http_port, "/metrics").body;
  CHECK(m.find("tandem_http_requests_total{route=\"other\",status=\"505\"} 1") != std::string::npos);
  CHECK(m.find("tandem_http_requests_total{route=\"other\",status=\"431\"} 2") != std::string::npos);
}

TEST_CASE("http framing: Connection close and HTTP/1.0 close the connection right after the response") {
  server_fixture s(framing_limits());
  for (const std::string& raw : {std::string("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
                                std::string("GET /health HTTP/1.0\r\n\r\n"),
                                std::string("GET /health HTTP/1.1\r\nConnection: close\r\n\r\nGET /health HTTP/1.1\r\n\r\n")}) {
    CAPTURE(raw);
    auto x = talk(s.http_port, raw);
    CHECK(x.r.status == 200);
    CHECK(x.r.headers["connection"] == "close");
    CHECK(x.closed);
    CHECK(x.close_ms < 1000);  // not kj's 5 s keep-alive wait
    CHECK(x.raw.find("HTTP/1.1", 10) == std::string::npos);  // nothing after the closing request
  }
  // Keep-alive still works: two pipelined requests, two answers on one connection.
  int fd = connect_to(s.http_port);
  REQUIRE(fd >= 0);
  send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  std::string raw;
  char buf[8192];
  for (;;) {
    ssize_t n = recv_some(fd, buf, sizeof buf);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  CHECK(raw.find("HTTP/1.1 200") == 0);
  CHECK(raw.find("HTTP/1.1 200", 10) != std::string::npos);
  CHECK(raw.find("\"object\":\"list\"") != std::string::npos);
}

TEST_CASE("http framing: a head not complete in time gets 408 JSON and the connection closes") {
  server_fixture s(framing_limits());
  auto t0 = std::chrono::steady_clock::now();
  auto x = talk(s.http_port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty");
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  CHECK(x.r.status == 408);
  check_json_error(x, "head_timeout");
  CHECK(x.closed);
  CHECK(ms < 3000);
  // A connection that sends nothing at all is answered the same way.
  auto idle = talk(s.http_port, "");
  CHECK(idle.r.status == 408);
  CHECK(metric(s.http_port, "tandem_http_header_timeouts_total") == 2);
  CHECK(get(s.http_port, "/health").status == 200);
  CHECK(s.api.submitted().empty());
}

TEST_CASE("http framing: a client's head-reading connections are bounded") {
  limits l = framing_limits();
  l.http_header_timeout_ms = 20000;
  l.http_max_head_readers_per_client = 3;
  server_fixture s(l);
  std::vector<int> slow;
  for (int i = 0; i < 3; ++i) {
    int fd = connect_to(s.http_port);
    REQUIRE(fd >= 0);
    send_all(fd, "GET /health HTTP/1.1\r\nHost: x\r\n");  // and never the rest
    slow.push_back(fd);
  }
  // The server takes its connections in turn: wait until it holds all three.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  exchange x;
  for (;;) {
    x = talk(s.http_port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    if (x.r.status == 429 || std::chrono::steady_clock::now() > deadline) break;
  }
  CHECK(x.r.status == 429);
  check_json_error(x, "too_many_connections");
  CHECK(x.closed);
  for (int fd : slow) ::close(fd);
  // Once the slow connections are gone the client is served again.
  deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int status = 0;
  while (status != 200 && std::chrono::steady_clock::now() < deadline) status = get(s.http_port, "/health").status;
  CHECK(status == 200);
  CHECK(metric(s.http_port, "tandem_http_head_readers_refused_total") >= 1);
}
