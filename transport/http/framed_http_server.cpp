#include "transport/http/framed_http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace tandem::transport {

std::string peer_address(kj::AsyncIoStream& conn) {
  KJ_IF_MAYBE(fd, conn.getFd()) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    if (::getpeername(*fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {0};
      if (ss.ss_family == AF_INET)
        ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
      else if (ss.ss_family == AF_INET6)
        ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
      return buf;
    }
  }
  return "";
}

/// kj's protocol errors and the exceptions it would answer with its source file and stack,
/// answered in the owner's JSON shape instead.
struct framed_http_server::errors final : kj::HttpServerErrorHandler, kj::TaskSet::ErrorHandler {
  explicit errors(framed_http_server& s) : srv(s) {}
  kj::Promise<void> handleClientProtocolError(kj::HttpHeaders::ProtocolError e, kj::HttpService::Response& response) override {
    ++srv.protocol_errors_;
    const unsigned status = e.statusCode >= 400 && e.statusCode < 500 ? e.statusCode : 400;
    srv.log(fmt::format("refused a malformed request: {} {}", status, e.description.cStr()));
    return srv.cb_.send_error(response, {status, "invalid_request_error", "bad_http",
                                         fmt::format("malformed HTTP request: {}; send an HTTP/1.1 request",
                                                     e.description.cStr()),
                                         std::nullopt});
  }
  kj::Promise<void> handleApplicationError(kj::Exception e, kj::Maybe<kj::HttpService::Response&> response) override {
    if (e.getType() == kj::Exception::Type::DISCONNECTED) return kj::READY_NOW;  // the client is gone
    std::string_view d(e.getDescription().cStr());
    const bool framing = d.substr(0, framing_exception_prefix.size()) == framing_exception_prefix;
    // kj-http's own complaints about a request it parsed (a body it cannot decode).
    const bool kj_http = !framing && std::string_view(e.getFile()).find("compat/http") != std::string_view::npos;
    if (!framing) srv.log(fmt::format("a request failed: {}", d));  // the description only, no stack
    KJ_IF_MAYBE(r, response) {
      if (framing)  // counted when the connection found it
        return srv.cb_.send_error(
            *r, {400, "invalid_request_error", "bad_http", std::string(d.substr(framing_exception_prefix.size())), std::nullopt});
      if (kj_http) {
        ++srv.protocol_errors_;
        return srv.cb_.send_error(*r, {400, "invalid_request_error", "bad_http",
                                       "malformed HTTP request body; send a Content-Length body or a valid chunked one",
                                       std::nullopt});
      }
      if (e.getType() == kj::Exception::Type::OVERLOADED)
        return srv.cb_.send_error(*r, {503, "overloaded_error", "overloaded", "the server is overloaded; retry later", 1});
      return srv.cb_.send_error(
          *r, {500, "server_error", "failed", "internal error; the server log has the details", std::nullopt});
    }
    return kj::READY_NOW;
  }
  kj::Promise<void> handleNoResponse(kj::HttpService::Response& response) override {
    return srv.cb_.send_error(response, {500, "server_error", "failed",
                                         "the request ended without a response; the server log has the details",
                                         std::nullopt});
  }
  void taskFailed(kj::Exception&& e) override { srv.log(fmt::format("a connection failed: {}", e.getDescription().cStr())); }
  framed_http_server& srv;
};

/// Closes the connection after the response being started when its request asked for that
/// (`Connection: close`, HTTP/1.0): kj asks when a response starts.
struct framed_http_server::closer final : kj::HttpServerCallbacks {
  explicit closer(framed_http_server& s) : srv(s) {}
  bool shouldClose() override { return srv.close_this_response_; }
  framed_http_server& srv;
};

/// The service's Response for a closing request: marks its response for `closer`.
struct framed_http_server::closing_response final : kj::HttpService::Response {
  closing_response(framed_http_server& s, kj::HttpService::Response& r) : srv(s), inner(r) {}
  kj::Own<kj::AsyncOutputStream> send(uint status, kj::StringPtr text, const kj::HttpHeaders& headers,
                                      kj::Maybe<uint64_t> size) override {
    srv.close_this_response_ = true;
    KJ_DEFER(srv.close_this_response_ = false);
    return inner.send(status, text, headers, size);
  }
  kj::Own<kj::WebSocket> acceptWebSocket(const kj::HttpHeaders& headers) override { return inner.acceptWebSocket(headers); }
  framed_http_server& srv;
  kj::HttpService::Response& inner;
};

/// The owner's service for one connection, with closing requests' responses marked.
struct framed_http_server::framed_service final : kj::HttpService {
  framed_service(framed_http_server& s, framed_connection& c, kj::Own<kj::HttpService> o)
      : srv(s), conn(c), owner(kj::mv(o)) {}
  kj::Promise<void> request(kj::HttpMethod method, kj::StringPtr url, const kj::HttpHeaders& headers,
                            kj::AsyncInputStream& body, Response& response) override {
    if (!conn.next_request_closes()) return owner->request(method, url, headers, body, response);
    auto wrapped = kj::heap<closing_response>(srv, response);
    auto& w = *wrapped;
    return owner->request(method, url, headers, body, w).attach(kj::mv(wrapped));
  }
  framed_http_server& srv;
  framed_connection& conn;
  kj::Own<kj::HttpService> owner;
};

framed_http_server::framed_http_server(kj::Timer& timer, const kj::HttpHeaderTable& table, const limits& lim,
                                       service_factory factory, front_callbacks callbacks)
    : timer_(timer), lim_(lim), factory_(std::move(factory)), cb_(std::move(callbacks)),
      head_readers_(lim.http_max_head_readers_per_client), errors_(kj::heap<errors>(*this)),
      closer_(kj::heap<closer>(*this)) {
  hooks_.readers = &head_readers_;
  hooks_.on_error = [this](const framing_error& e, const std::string& peer) { refused(e, peer); };
  hooks_.error_body = [this](const framing_error& e) {
    return cb_.error_body({e.status, "invalid_request_error", e.code, e.message, std::nullopt});
  };
  kj::HttpServerSettings settings;
  // Slowloris: framed_connection answers a head not complete within http_header_timeout_ms with
  // 408; kj's own clock (which would close silently) only backs it up.
  settings.headerTimeout = (2 * static_cast<int64_t>(lim_.http_header_timeout_ms) + 1000) * kj::MILLISECONDS;
  settings.errorHandler = *errors_;
  settings.callbacks = *closer_;
  server_ = kj::heap<kj::HttpServer>(
      timer_, table,
      [this](kj::AsyncIoStream& conn) -> kj::Own<kj::HttpService> {
        // Every connection comes through serve(): it is a framed_connection.
        return kj::heap<framed_service>(*this, static_cast<framed_connection&>(conn), factory_(conn));
      },
      settings);
  connections_ = kj::heap<kj::TaskSet>(*errors_);
}

framed_http_server::~framed_http_server() = default;

void framed_http_server::refused(const framing_error& e, const std::string& peer) {
  if (e.status == 408) ++header_timeouts_;
  else if (e.status != 429) ++protocol_errors_;  // 429: counted by head_readers_
  log(fmt::format("refused a request from {}: {} {}: {}", peer.empty() ? "?" : peer, e.status, e.code, e.message));
}

void framed_http_server::log(const std::string& what) {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (auto suppressed = log_gate_.allow(now))
    spdlog::warn("http: {} ({} more such lines suppressed in the last 5 s)", what, *suppressed);
}

kj::Promise<void> framed_http_server::serve(kj::Own<kj::AsyncIoStream> raw) {
  std::string peer = peer_address(*raw);
  auto conn = kj::heap<framed_connection>(kj::mv(raw), timer_, static_cast<size_t>(lim_.http_max_head_bytes),
                                          lim_.http_header_timeout_ms, std::move(peer), hooks_);
  auto& c = *conn;
  // kj ends the connection at the framer's end of stream; then the pending error is answered.
  return server_->listenHttpCleanDrain(c)
      .then([](bool) {}, [this](kj::Exception&& e) { errors_->taskFailed(kj::mv(e)); })
      .then([&c] { return c.finish(); })
      .attach(kj::mv(conn));
}

kj::Promise<void> framed_http_server::accept_loop(kj::ConnectionReceiver& listener) {
  return listener.accept().then([this, &listener](kj::Own<kj::AsyncIoStream> c) {
    connections_->add(serve(kj::mv(c)));
    return accept_loop(listener);
  });
}

kj::Promise<void> framed_http_server::listen(kj::ConnectionReceiver& listener) { return accept_loop(listener); }

kj::Promise<void> framed_http_server::drain() { return server_->drain(); }

}  // namespace tandem::transport
