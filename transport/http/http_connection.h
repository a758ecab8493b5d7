#pragma once
/// One HTTP connection seen through a request_framer (http_framing.h) before kj-http parses it.
///
/// kj-http reads the connection through `framed_connection`: it gets each request head only once
/// the head is complete and sound, and end-of-stream where the framer found an error, a request
/// head that did not arrive within limits.http_header_timeout_ms (slowloris), a client over its
/// bound of head-reading connections, or the end of a `Connection: close` request. kj then ends
/// the connection cleanly and `finish()` writes the JSON error on the raw socket. An error
/// inside a body (a bad chunk size) surfaces in kj as an exception whose description starts
/// with `framing_exception_prefix`, which the server's error handler answers as 400.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <kj/async-io.h>
#include <kj/timer.h>

#include "transport/http/http_framing.h"

namespace tandem::transport {

/// Starts the description of the kj exception a body framing error surfaces as.
inline constexpr std::string_view framing_exception_prefix = "tandem-bad-http: ";

/// What a connection reports to its server (kj thread only).
struct framing_hooks {
  /// Shared by every connection of the server: the per-address head-reader bound.
  head_reader_bound* readers = nullptr;
  /// Called once per framing error with the client's address (counting, rate-limited logging).
  std::function<void(const framing_error&, const std::string&)> on_error;
  /// Renders (and counts) the JSON body of an error the connection answers itself.
  std::function<std::string(const framing_error&)> error_body;
};

class framed_connection final : public kj::AsyncIoStream {
 public:
  /// `peer`: the client's address (the key of the head-reader bound; "" = unknown).
  framed_connection(kj::Own<kj::AsyncIoStream> inner, kj::Timer& timer, size_t max_head_bytes,
                    int64_t header_timeout_ms, std::string peer, framing_hooks& hooks);
  ~framed_connection() noexcept(false);

  /// Whether the response to the next request kj hands the service must close the connection.
  bool next_request_closes();
  /// After kj has finished with the connection: writes the pending error, if any, and shuts the
  /// write side (the peer sees the end right after the response).
  kj::Promise<void> finish();

  kj::Promise<size_t> tryRead(void* buffer, size_t min_bytes, size_t max_bytes) override;
  kj::Promise<void> write(const void* buffer, size_t size) override { return inner_->write(buffer, size); }
  kj::Promise<void> write(kj::ArrayPtr<const kj::ArrayPtr<const kj::byte>> pieces) override {
    return inner_->write(pieces);
  }
  kj::Promise<void> whenWriteDisconnected() override { return inner_->whenWriteDisconnected(); }
  void shutdownWrite() override { inner_->shutdownWrite(); }
  void abortRead() override { inner_->abortRead(); }
  kj::Maybe<int> getFd() const override { return inner_->getFd(); }

 private:
  kj::Promise<size_t> read_loop(kj::byte* buffer, size_t min_bytes, size_t max_bytes, size_t got);
  /// Takes or gives back this connection's place in the head-reader bound as its state changes.
  void update_head_state();
  void set_error(framing_error e);

  kj::Own<kj::AsyncIoStream> inner_;
  kj::Timer& timer_;
  int64_t header_timeout_ms_;
  std::string peer_;
  framing_hooks& hooks_;
  request_framer framer_;
  std::string out_;  ///< bytes for kj, from out_pos_
  size_t out_pos_ = 0;
  bool eof_ = false;
  bool holds_reader_ = false;
  bool reported_ = false;   ///< the framer's error went to hooks_.on_error
  bool answered_ = false;   ///< the error was answered (through kj or finish())
  std::optional<framing_error> own_error_;  ///< 408 / 429: the connection's, not the framer's
  uint64_t heads_seen_ = 0;
  std::optional<kj::TimePoint> head_deadline_;
  kj::byte buf_[16384];
};

}  // namespace tandem::transport
