#include "transport/http/http_connection.h"

#include <cstring>

#include <fmt/format.h>

namespace tandem::transport {

framed_connection::framed_connection(kj::Own<kj::AsyncIoStream> inner, kj::Timer& timer, size_t max_head_bytes,
                                     int64_t header_timeout_ms, std::string peer, framing_hooks& hooks)
    : inner_(kj::mv(inner)), timer_(timer), header_timeout_ms_(header_timeout_ms), peer_(std::move(peer)),
      hooks_(hooks), framer_(max_head_bytes) {
  update_head_state();  // a new connection is reading its first head
}

framed_connection::~framed_connection() noexcept(false) {
  if (holds_reader_ && hooks_.readers) hooks_.readers->release(peer_);
}

bool framed_connection::next_request_closes() {
  auto h = framer_.take_head();
  return h && !h->keep_alive;
}

void framed_connection::set_error(framing_error e) {
  if (own_error_ || framer_.error()) return;
  own_error_ = std::move(e);
  if (hooks_.on_error) hooks_.on_error(*own_error_, peer_);
  if (holds_reader_ && hooks_.readers) hooks_.readers->release(peer_);
  holds_reader_ = false;
  head_deadline_ = std::nullopt;
}

void framed_connection::update_head_state() {
  if (framer_.error() && !reported_) {
    reported_ = true;
    if (hooks_.on_error) hooks_.on_error(*framer_.error(), peer_);
  }
  if (framer_.heads() != heads_seen_) {  // a head went to kj: its clock and place end
    heads_seen_ = framer_.heads();
    head_deadline_ = std::nullopt;
    if (holds_reader_ && hooks_.readers) hooks_.readers->release(peer_);
    holds_reader_ = false;
  }
  // Reading a head: the first one from the connection's start, later ones from their first byte
  // (an idle keep-alive connection is kj's pipelineTimeout's business).
  const bool reading = !own_error_ && !framer_.error() && framer_.in_head() && !framer_.finished() &&
                       (framer_.head_started() || framer_.heads() == 0);
  if (!reading) {
    if (holds_reader_ && hooks_.readers) hooks_.readers->release(peer_);
    holds_reader_ = false;
    head_deadline_ = std::nullopt;
    return;
  }
  if (!holds_reader_) {
    if (hooks_.readers && !hooks_.readers->acquire(peer_)) {
      set_error({429, "too_many_connections",
                 fmt::format("this client already has {} connections sending a request head "
                             "(limits.http_max_head_readers_per_client); finish a request before opening more",
                             hooks_.readers->per_client())});
      return;
    }
    holds_reader_ = true;
  }
  if (!head_deadline_) head_deadline_ = timer_.now() + header_timeout_ms_ * kj::MILLISECONDS;
}

kj::Promise<size_t> framed_connection::tryRead(void* buffer, size_t min_bytes, size_t max_bytes) {
  return read_loop(static_cast<kj::byte*>(buffer), min_bytes, max_bytes, 0);
}

kj::Promise<size_t> framed_connection::read_loop(kj::byte* buffer, size_t min_bytes, size_t max_bytes, size_t got) {
  const size_t n = std::min(out_.size() - out_pos_, max_bytes - got);
  if (n > 0) {
    std::memcpy(buffer + got, out_.data() + out_pos_, n);
    out_pos_ += n;
    got += n;
  }
  if (out_pos_ == out_.size()) {
    out_.clear();
    out_pos_ = 0;
  }
  if (got >= min_bytes && got > 0) return got;
  if (framer_.error()) {
    if (framer_.error_in_body() && !answered_) {
      if (got > 0) return got;  // hand on what is sound first; the next read fails
      // kj is reading this request's body: fail the read, the server's error handler answers.
      answered_ = true;
      std::string d = std::string(framing_exception_prefix) + framer_.error()->message;
      return kj::Exception(kj::Exception::Type::FAILED, __FILE__, __LINE__, kj::heapString(d.data(), d.size()));
    }
    return got;  // end of stream for kj; finish() answers
  }
  if (own_error_ || framer_.finished() || eof_) return got;
  kj::Promise<size_t> more = inner_->tryRead(buf_, 1, sizeof buf_);
  if (head_deadline_) {
    more = more.exclusiveJoin(timer_.atTime(*head_deadline_).then([]() -> size_t { return SIZE_MAX; }));
  }
  return more.then([this, buffer, min_bytes, max_bytes, got](size_t r) -> kj::Promise<size_t> {
    if (r == SIZE_MAX) {
      set_error({408, "head_timeout",
                 fmt::format("the request head did not arrive within {} ms (limits.http_header_timeout_ms); "
                             "send the whole head at once",
                             header_timeout_ms_)});
    } else if (r == 0) {
      eof_ = true;
    } else {
      framer_.feed(std::string_view(reinterpret_cast<const char*>(buf_), r), out_);
      update_head_state();
    }
    return read_loop(buffer, min_bytes, max_bytes, got);
  });
}

kj::Promise<void> framed_connection::finish() {
  std::optional<framing_error> e = own_error_;
  if (!e && framer_.error() && !framer_.error_in_body()) e = framer_.error();
  kj::Promise<void> wrote = kj::READY_NOW;
  if (e && !answered_) {
    answered_ = true;
    std::string body = hooks_.error_body ? hooks_.error_body(*e) : std::string("{}");
    auto text = kj::heapString(raw_error_response(e->status, body));
    auto p = inner_->write(text.begin(), text.size());
    wrote = p.attach(kj::mv(text));
  }
  return wrote
      .then([this]() -> kj::Promise<void> {
        inner_->shutdownWrite();
        // Closing with unread input makes the kernel send a reset, which can destroy the response
        // before the client reads it: read and drop what the client still sends, for a while.
        auto drop = kj::heapArray<kj::byte>(4096);
        struct dropper {
          static kj::Promise<void> run(kj::AsyncIoStream& s, kj::ArrayPtr<kj::byte> b, size_t left) {
            if (left == 0) return kj::READY_NOW;
            return s.tryRead(b.begin(), 1, b.size()).then([&s, b, left](size_t n) -> kj::Promise<void> {
              if (n == 0) return kj::READY_NOW;
              return run(s, b, left > n ? left - n : 0);
            });
          }
        };
        auto ptr = drop.asPtr();
        return dropper::run(*inner_, ptr, 1 << 20)
            .exclusiveJoin(timer_.afterDelay(1 * kj::SECONDS))
            .attach(kj::mv(drop));
      })
      .catch_([](kj::Exception&&) {});  // the client is gone: nothing left to tell it
}

}  // namespace tandem::transport
