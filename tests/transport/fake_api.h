#pragma once
// Test doubles for the front ends: a byte-level tokenizer and a serving_api that produces a
// scripted token stream from its own thread (like the actors do), plus a server fixture
// running the front ends on a background thread and a blocking HTTP client.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "actors/runtime/serving_api.h"
#include "kernels/tokenizer/tokenizer.h"
#include "transport/rpc/front_end.h"

namespace tandem::test {

/// Token id = byte + 3; 0 unk, 1 BOS, 2 EOS.
class fake_tokenizer final : public tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool = false) const override {
    std::vector<int32_t> r;
    if (add_bos) r.push_back(1);
    for (unsigned char c : text) r.push_back(c + 3);
    return r;
  }
  std::string token_bytes(int32_t id) const override {
    if (id < 3 || id >= 259) return "";
    return std::string(1, static_cast<char>(id - 3));
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (auto id : ids) s += token_bytes(id);
    return s;
  }
  const std::string& piece(int32_t) const override { return empty_; }
  int32_t n_vocab() const override { return 259; }
  int32_t bos_id() const override { return 1; }
  int32_t eos_id() const override { return 2; }
  std::string_view model_name() const override { return "fake"; }
  /// Fill-in-the-middle token ids (none by default).
  void set_fim(int32_t pre, int32_t suf, int32_t mid) { fim_ = {pre, suf, mid}; }

  static std::vector<int32_t> ids(std::string_view s) {
    std::vector<int32_t> r;
    for (unsigned char c : s) r.push_back(c + 3);
    return r;
  }

 private:
  std::string empty_;
};

/// What the fake does with each request.
struct fake_behavior {
  std::string output = "Hello world";  ///< produced byte by byte (then EOS unless ignore_eos)
  size_t chunk = 3;                     ///< tokens per event
  std::optional<error> fail;            ///< error event...
  size_t fail_after = 0;                ///< ...after this many tokens (0 = immediately)
  bool hold = false;                    ///< after the first chunk, wait for abort()
  std::string reject_reason;            ///< with `fail`: the refusal's reason (e.g. "queue_timeout")
  int64_t retry_after_ms = 0;           ///< with `fail`: the router's Retry-After estimate
  int interval_ms = 0;                  ///< pause between events (an engine that decodes at a pace)
};

class fake_api final : public serving_api {
 public:
  fake_api() : worker_([this] { loop(); }) {}
  ~fake_api() override {
    {
      std::lock_guard<std::mutex> l(m_);
      quit_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  /// The tokenizer's FIM ids (set before the first request).
  void set_fim(int32_t pre, int32_t suf, int32_t mid) { tok_.set_fim(pre, suf, mid); }

  void set(fake_behavior b) {
    std::lock_guard<std::mutex> l(m_);
    beh_ = std::move(b);
  }

  void submit(completion_request req, event_callback cb) override {
    std::lock_guard<std::mutex> l(m_);
    submitted_.push_back(req);
    cv_.notify_all();
    jobs_.push_back({std::move(req), std::move(cb), beh_});
    cv_.notify_all();
  }
  void abort(const std::string& id) override {
    std::lock_guard<std::mutex> l(m_);
    aborted_.push_back(id);
    cv_.notify_all();
  }
  health_info health() const override {
    std::lock_guard<std::mutex> l(m_);
    health_info h{true, "ok", 1234};
    h.ready = ready_;
    h.ready_status = ready_status_;
    return h;
  }
  /// What health() says about readiness (alive either way).
  void set_ready(bool ready, std::string why) {
    std::lock_guard<std::mutex> l(m_);
    ready_ = ready;
    ready_status_ = std::move(why);
  }
  stats_info stats() const override {
    stats_info s;
    std::lock_guard<std::mutex> l(m_);
    s.requests_total = static_cast<int64_t>(submitted_.size());
    s.kv_pages_total = 64;
    s.kv_pages_free = 60;
    return s;
  }
  std::string metrics_text() const override { return "# TYPE tandem_fake_metric gauge\ntandem_fake_metric 7\n"; }
  const tokenizer& tok() const override { return tok_; }
  std::string model_id() const override { return "fake-model"; }
  int32_t max_context() const override { return context_tokens; }
  int32_t context_tokens = 128;  ///< max_context(); set before the first request

  std::vector<completion_request> submitted() const {
    std::lock_guard<std::mutex> l(m_);
    return submitted_;
  }
  std::vector<std::string> aborted() const {
    std::lock_guard<std::mutex> l(m_);
    return aborted_;
  }
  /// Blocks until `id` (or any request if empty) was aborted, up to `timeout`.
  bool wait_aborted(const std::string& id, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> l(m_);
    return cv_.wait_for(l, timeout, [&] { return has_abort(id); });
  }
  /// Blocks until `n` requests were submitted.
  bool wait_submitted(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> l(m_);
    return cv_.wait_for(l, timeout, [&] { return submitted_.size() >= n; });
  }
  /// Blocks until `n` jobs finished (their last event was delivered).
  bool wait_finished(size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> l(m_);
    return cv_.wait_for(l, timeout, [&] { return finished_ >= n; });
  }

 private:
  struct job {
    completion_request req;
    event_callback cb;
    fake_behavior beh;
  };

  bool has_abort(const std::string& id) const {
    for (auto& a : aborted_)
      if (id.empty() || a == id) return true;
    return false;
  }

  void loop() {
    std::unique_lock<std::mutex> l(m_);
    while (true) {
      cv_.wait(l, [&] { return quit_ || !jobs_.empty(); });
      if (quit_) return;
      job j = std::move(jobs_.front());
      jobs_.pop_front();
      l.unlock();
      run(j, l);
      l.lock();
      ++finished_;
      cv_.notify_all();
    }
  }

  /// Each of the request's n choices in turn (the same output; events carry the choice).
  void run(job& j, std::unique_lock<std::mutex>& l) {
    for (int32_t k = 0; k < std::max(1, j.req.n); ++k)
      if (!run_choice(j, l, k)) return;
  }

  /// False once the request ended (an error, or an abort while held).
  bool run_choice(job& j, std::unique_lock<std::mutex>& l, int32_t choice) {
    auto toks = fake_tokenizer::ids(j.beh.output);
    if (!j.req.ignore_eos) toks.push_back(2);
    int32_t n = 0;
    auto ev = [&](std::vector<int32_t> t) {
      token_event e;
      e.request_id = j.req.request_id;
      e.choice = choice;
      e.tokens = std::move(t);
      if (j.req.logprobs >= 0)  // token id k at -0.25, then k+1, k+2, ... one nat apart
        for (int32_t id : e.tokens) {
          token_logprobs lp{id, -0.25f, {}};
          for (int32_t k = 0; k < j.req.logprobs; ++k) lp.top.push_back({id + k, -0.25f - float(k)});
          e.logprobs.push_back(std::move(lp));
        }
      e.prompt_tokens = static_cast<int32_t>(j.req.prompt.size());
      e.completion_tokens = n;
      return e;
    };
    if (j.beh.fail) {
      std::vector<int32_t> t(toks.begin(), toks.begin() + static_cast<ptrdiff_t>(std::min(j.beh.fail_after, toks.size())));
      n = static_cast<int32_t>(t.size());
      if (!t.empty()) j.cb(ev(t));
      auto e = ev({});
      e.finished = true;
      e.reason = finish_reason::error;
      e.err = j.beh.fail;
      e.reject_reason = j.beh.reject_reason;
      e.retry_after_ms = j.beh.retry_after_ms;
      j.cb(e);
      return false;
    }
    size_t i = 0;
    bool first = true;
    while (true) {
      std::vector<int32_t> t;
      bool stop = false;
      while (t.size() < j.beh.chunk && i < toks.size() && n < j.req.max_tokens) {
        int32_t id = toks[i++];
        t.push_back(id);
        ++n;
        if (std::find(j.req.stop_tokens.begin(), j.req.stop_tokens.end(), id) != j.req.stop_tokens.end()) {
          stop = true;
          break;
        }
      }
      bool length = n >= j.req.max_tokens;
      bool end = stop || length || i >= toks.size();
      if (j.beh.hold && first) {
        j.cb(ev(t));
        l.lock();
        cv_.wait(l, [&] { return quit_ || has_abort(j.req.request_id); });
        l.unlock();
        auto e = ev({});
        e.finished = true;
        e.reason = finish_reason::abort;
        j.cb(e);
        return false;
      }
      if (!first && j.beh.interval_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(j.beh.interval_ms));
      first = false;
      auto e = ev(t);
      if (end) {
        e.finished = true;
        e.reason = length && !stop ? finish_reason::length : finish_reason::stop;
      }
      j.cb(e);
      if (end) return true;
    }
  }

  fake_tokenizer tok_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  fake_behavior beh_;
  std::deque<job> jobs_;
  std::vector<completion_request> submitted_;
  std::vector<std::string> aborted_;
  size_t finished_ = 0;
  bool quit_ = false;
  bool ready_ = true;
  std::string ready_status_ = "ready";
  std::thread worker_;
};

/// The front ends on a background thread, on free ports.
class server_fixture {
 public:
  explicit server_fixture(limits lim = {}) : server_fixture(options(lim)) {}
  /// Free ports for HTTP and RPC (and admin if o.admin_port is 0); keys etc. as given.
  explicit server_fixture(front_end_options o) {
    fe_ = std::make_unique<front_end>(api, o);
    std::promise<void> ready;
    auto fut = ready.get_future();
    thread_ = std::thread([this, &ready, &o] {
      try {
        fe_->run([&](const listener_info& l) {
          (l.what == "http" ? http_port : l.what == "rpc" ? rpc_port : admin_port) = l.port;
          bound[l.what] = l.host;
          if (http_port && rpc_port && (o.admin_port < 0 || admin_port)) ready.set_value();
        });
      } catch (...) {
        ready.set_exception(std::current_exception());
      }
    });
    fut.get();
  }
  ~server_fixture() {
    fe_->stop();
    thread_.join();
  }

  static front_end_options options(limits lim = {}) {
    front_end_options o;
    o.http_port = 0;
    o.rpc_port = 0;
    o.lim = lim;
    return o;
  }

  fake_api api;
  uint16_t http_port = 0, rpc_port = 0, admin_port = 0;
  std::map<std::string, std::string> bound;  ///< listener -> the address it bound

 private:
  std::unique_ptr<front_end> fe_;
  std::thread thread_;
};

struct http_response {
  int status = 0;
  std::map<std::string, std::string> headers;  ///< lower-case names
  std::string body;                             ///< de-chunked
};

/// A connected blocking socket with a receive timeout so a broken server fails the test.
inline int connect_to(uint16_t port, int recv_timeout_s = 10) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{recv_timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    // An interrupted connect goes on in the background: wait for its outcome.
    int err = errno;
    if (err == EINTR) {
      pollfd p{fd, POLLOUT, 0};
      while (::poll(&p, 1, 10000) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
    if (err != 0) {
      ::close(fd);
      errno = err;
      return -1;
    }
  }
  return fd;
}

/// recv(2) that retries EINTR. A socket with SO_RCVTIMEO fails a blocked recv with EINTR
/// whenever a signal is handled, even one whose handler has SA_RESTART (socket(7)); the
/// fault tests signal other processes while client threads read.
inline ssize_t recv_some(int fd, char* buf, size_t len, int flags = 0) {
  while (true) {
    ssize_t n = ::recv(fd, buf, len, flags);
    if (n >= 0 || errno != EINTR) return n;
  }
}

inline void send_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

inline std::string dechunk(const std::string& b) {
  std::string out;
  size_t p = 0;
  while (p < b.size()) {
    size_t e = b.find("\r\n", p);
    if (e == std::string::npos) break;
    size_t n = std::stoul(b.substr(p, e - p), nullptr, 16);
    if (n == 0) break;
    out += b.substr(e + 2, n);
    p = e + 2 + n + 2;
  }
  return out;
}

inline http_response parse_response(const std::string& raw) {
  http_response r;
  size_t he = raw.find("\r\n\r\n");
  if (raw.size() < 12 || he == std::string::npos) return r;
  r.status = std::stoi(raw.substr(9, 3));
  size_t p = raw.find("\r\n") + 2;
  while (p < he) {
    size_t e = raw.find("\r\n", p);
    auto line = raw.substr(p, e - p);
    auto c = line.find(':');
    std::string k = line.substr(0, c);
    for (auto& ch : k) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    std::string v = line.substr(c + 1);
    while (!v.empty() && v[0] == ' ') v.erase(0, 1);
    r.headers[k] = v;
    p = e + 2;
  }
  r.body = raw.substr(he + 4);
  if (r.headers["transfer-encoding"] == "chunked") r.body = dechunk(r.body);
  return r;
}

/// True once `raw` holds a whole response (Content-Length or final chunk seen).
inline bool response_complete(const std::string& raw) {
  size_t he = raw.find("\r\n\r\n");
  if (he == std::string::npos) return false;
  auto r = parse_response(raw.substr(0, he + 4));
  if (r.headers.count("content-length")) return raw.size() - he - 4 >= std::stoul(r.headers["content-length"]);
  if (r.headers["transfer-encoding"] == "chunked") return raw.size() >= 5 && raw.compare(raw.size() - 5, 5, "0\r\n\r\n") == 0;
  return false;
}

/// Sends raw request bytes and reads the response (or until the server closes).
/// `recv_timeout_s`: the longest silence before the exchange fails (a whole non-streamed
/// completion comes back at once, after all its tokens).
inline http_response http_exchange(uint16_t port, const std::string& raw_request, int recv_timeout_s = 10) {
  int fd = connect_to(port, recv_timeout_s);
  if (fd < 0) return {};
  send_all(fd, raw_request);
  std::string raw;
  char buf[65536];
  // kj-http keeps the connection open for pipelining, so stop at the end of the response.
  while (!response_complete(raw)) {
    ssize_t n = recv_some(fd, buf, sizeof buf);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return parse_response(raw);
}

inline std::string request_text(const std::string& method, const std::string& path, const std::string& body = "",
                                const std::string& extra_headers = "") {
  std::string r = method + " " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n" + extra_headers;
  if (method == "POST") r += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  return r + "\r\n" + body;
}

inline http_response post(uint16_t port, const std::string& path, const std::string& body, int recv_timeout_s = 10) {
  return http_exchange(port, request_text("POST", path, body), recv_timeout_s);
}
inline http_response get(uint16_t port, const std::string& path) { return http_exchange(port, request_text("GET", path)); }

/// The JSON payloads of an SSE body; checks framing (every event is "data: ...\n\n", the
/// last one is [DONE]) and sets `framing_ok`.
inline std::vector<std::string> sse_events(const std::string& body, bool& framing_ok) {
  std::vector<std::string> out;
  framing_ok = true;
  size_t p = 0;
  bool done = false;
  while (p < body.size()) {
    if (body.compare(p, 6, "data: ") != 0 || done) {
      framing_ok = false;
      break;
    }
    size_t e = body.find("\n\n", p);
    if (e == std::string::npos) {
      framing_ok = false;
      break;
    }
    std::string data = body.substr(p + 6, e - p - 6);
    if (data == "[DONE]") done = true;
    else out.push_back(data);
    p = e + 2;
  }
  if (!done) framing_ok = false;
  return out;
}

}  // namespace tandem::test
