#pragma once
/// HTTP/1.1 request framing checked before kj-http sees it (pure logic, no kj).
///
/// kj-http 0.9.2 answers a bad Content-Length or Transfer-Encoding, or a bad chunk size, with
/// a 500 carrying its source file and stack, accepts both Content-Length and Transfer-Encoding
/// on one request (request smuggling, RFC 9112 §6.1), any HTTP version, ignores
/// `Connection: close` and resets a connection whose head outgrows its buffer. The
/// `request_framer` follows one connection's inbound bytes, hands on only requests whose
/// framing is sound, and names the error (status, code, message) of the first one that is
/// not; the server (http_connection.h) answers it in JSON and closes the connection.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

namespace tandem::transport {

/// A request the server refuses before routing it; the connection closes after the answer.
struct framing_error {
  unsigned status = 400;  ///< 400, 408, 429, 431 or 505
  std::string code;       ///< the JSON error's code: bad_http, head_too_large, head_timeout, ...
  std::string message;    ///< what was wrong and how to send it instead
};

/// What a sound request head says about the body that follows it.
struct head_info {
  enum class body_kind { none, length, chunked };
  body_kind body = body_kind::none;
  uint64_t length = 0;    ///< body_kind::length (saturated: the server answers 413 above its bound)
  bool keep_alive = true; ///< false: HTTP/1.0 or `Connection: close`; the connection ends after it
};

/// Checks one complete request head (request line through the empty line) for what the framer
/// and the server rely on: METHOD SP target SP HTTP/1.x, `name: value` header lines (no line
/// folding), at most one Content-Length of digits only, Transfer-Encoding exactly `chunked`,
/// never both.
std::variant<head_info, framing_error> check_request_head(std::string_view head);

/// Follows the framing of one connection's inbound bytes (heads, then bodies by
/// Content-Length or chunked encoding) and hands on what is sound.
class request_framer {
 public:
  /// `max_head_bytes`: a head (or a chunked body's trailer section) longer than this is 431.
  explicit request_framer(size_t max_head_bytes);

  /// Consumes `in`; appends to `out` the bytes to hand to the HTTP parser (a head only once it
  /// is complete and sound). After an error or the end of a `Connection: close` request,
  /// further input is ignored.
  void feed(std::string_view in, std::string& out);

  /// The first error met; no bytes after it are handed on.
  const std::optional<framing_error>& error() const { return error_; }
  /// Whether the error was met inside a body (the HTTP parser already has its request) rather
  /// than in a head it never saw.
  bool error_in_body() const { return error_in_body_; }
  /// The last request handed on asked to close the connection and its body is complete.
  bool finished() const { return finished_; }
  /// Waiting for (the rest of) a request head with at least one byte of it received.
  bool head_started() const { return state_ == state::head && !head_.empty(); }
  /// Between requests or inside a head (not inside a body).
  bool in_head() const { return state_ == state::head; }
  /// Heads handed on so far.
  uint64_t heads() const { return heads_; }
  /// The head_info of handed-on requests not yet taken, oldest first.
  std::optional<head_info> take_head();

 private:
  enum class state { head, length_body, chunk_size, chunk_data, chunk_data_end, trailers, done };
  void fail(unsigned status, std::string code, std::string message);
  void on_head_complete(size_t end, std::string& out);
  void end_of_body();
  /// Collects one line of a chunked body's framing into `line_` (handed on only once checked);
  /// true when it holds a whole line.
  bool take_line(std::string_view in, size_t& i, size_t max);

  size_t max_head_bytes_;
  state state_ = state::head;
  std::string head_;  ///< the head in progress (held back until complete)
  std::string line_;  ///< a chunk-size, chunk-end or trailer line in progress
  uint64_t left_ = 0; ///< body bytes (length body) or chunk bytes still to come
  size_t trailer_bytes_ = 0;
  bool keep_alive_ = true;
  bool finished_ = false;
  bool error_in_body_ = false;
  uint64_t heads_ = 0;
  std::optional<framing_error> error_;
  std::deque<head_info> pending_;
};

/// Bounds the connections of one client address that are reading a request head at once, so a
/// slowloris client cannot hold every connection the process can open.
class head_reader_bound {
 public:
  /// `per_client`: at most this many head-reading connections per address.
  explicit head_reader_bound(int per_client) : per_client_(per_client) {}
  /// False (and counted) when `client` already has `per_client` of them.
  bool acquire(const std::string& client);
  void release(const std::string& client);
  int64_t refused() const { return refused_; }
  /// Connections reading a head now, all clients.
  int64_t readers() const { return readers_; }
  int per_client() const { return per_client_; }

 private:
  int per_client_;
  std::map<std::string, int> by_client_;
  int64_t refused_ = 0, readers_ = 0;
};

/// At most one log line per `interval_ms` for a kind of event a client can cause at will.
class log_gate {
 public:
  explicit log_gate(int64_t interval_ms) : interval_ms_(interval_ms) {}
  /// The number of events suppressed since the last line if one may be logged now, else nullopt.
  std::optional<int64_t> allow(int64_t now_ms);

 private:
  int64_t interval_ms_;
  int64_t last_ms_ = INT64_MIN;
  int64_t suppressed_ = 0;
};

/// The whole response for a framing error written on the raw connection: HTTP/1.1 status
/// line, `Connection: close`, JSON body `json`.
std::string raw_error_response(unsigned status, std::string_view json);

/// The reason phrase of the statuses this server sends ("Error" for others).
std::string_view status_reason(unsigned status);

}  // namespace tandem::transport
