#pragma once
/// kj::HttpServer behind framed_connection (http_connection.h): the connection and protocol
/// concerns of an HTTP front end, apart from its routes.
///
/// Accepts connections, reads each through a request_framer, answers framing errors, kj-http's
/// protocol errors and exceptions in the owner's JSON error shape (never kj's text with its
/// source file and stack), closes the connection after a `Connection: close` or HTTP/1.0
/// request's response, bounds head-reading connections per client address, counts all of it
/// and logs it at most once per 5 s.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <kj/async-io.h>
#include <kj/compat/http.h>
#include <kj/timer.h>

#include "actors/common/limits.h"
#include "transport/http/http_connection.h"

namespace tandem::transport {

/// A JSON error the owner renders: HTTP status, OpenAI-style type and code, message.
struct owner_error {
  unsigned status;
  std::string type;
  std::string code;
  std::string message;
  std::optional<int> retry_after_s;
};

/// How the owner answers and counts errors (kj thread only).
struct front_callbacks {
  /// Sends `e` on `response` as the owner's JSON error and counts the response.
  std::function<kj::Promise<void>(kj::HttpService::Response&, const owner_error&)> send_error;
  /// The JSON body of `e`, written on the raw connection (counts the response).
  std::function<std::string(const owner_error&)> error_body;
};

/// The peer's IP address (no port: one client may open many connections); "" if unknown.
std::string peer_address(kj::AsyncIoStream& conn);

class framed_http_server {
 public:
  /// The owner's service for one connection (its requests see the framed connection).
  using service_factory = std::function<kj::Own<kj::HttpService>(kj::AsyncIoStream&)>;

  /// `timer`, `table` must outlive the server; `lim` supplies http_header_timeout_ms,
  /// http_max_head_bytes and http_max_head_readers_per_client.
  framed_http_server(kj::Timer& timer, const kj::HttpHeaderTable& table, const limits& lim, service_factory factory,
                     front_callbacks callbacks);
  ~framed_http_server();
  framed_http_server(const framed_http_server&) = delete;
  framed_http_server& operator=(const framed_http_server&) = delete;

  /// Accepts and serves connections; never resolves normally (drop it to stop listening).
  kj::Promise<void> listen(kj::ConnectionReceiver& listener);
  /// Serves one accepted connection until it closes.
  kj::Promise<void> serve(kj::Own<kj::AsyncIoStream> raw);
  /// Resolves when running requests have finished (kj::HttpServer::drain).
  kj::Promise<void> drain();

  int64_t protocol_errors() const { return protocol_errors_; }
  int64_t header_timeouts() const { return header_timeouts_; }
  const head_reader_bound& head_readers() const { return head_readers_; }

 private:
  struct errors;
  struct closer;
  struct closing_response;
  struct framed_service;
  void refused(const framing_error& e, const std::string& peer);
  /// At most one line per 5 s: clients cause these at will (kj's own handler logged a stack
  /// per request).
  void log(const std::string& what);
  kj::Promise<void> accept_loop(kj::ConnectionReceiver& listener);

  kj::Timer& timer_;
  limits lim_;
  service_factory factory_;
  front_callbacks cb_;
  head_reader_bound head_readers_;
  framing_hooks hooks_;
  log_gate log_gate_{5000};
  int64_t protocol_errors_ = 0, header_timeouts_ = 0;
  bool close_this_response_ = false;  ///< set by closing_response while kj starts its response
  kj::Own<errors> errors_;
  kj::Own<closer> closer_;
  kj::Own<kj::HttpServer> server_;
  kj::Own<kj::TaskSet> connections_;  ///< last: its connections use everything above
};

}  // namespace tandem::transport
