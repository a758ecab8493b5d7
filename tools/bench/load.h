#pragma once
// The HTTP load generator of `tandem bench serve`, shared with `tandem bench burst`: streams
// /v1/completions (SSE) so TTFT and inter-token latency are measured per request; arrivals
// are open loop (Poisson or bursts: the client never waits for the server, so overload shows
// up as rejections and queueing) or closed loop (N streams).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/base/error.h"
#include "tools/bench/modes.h"
#include "transport/http/json.h"

namespace tandem::cli::load {

using clock_type = std::chrono::steady_clock;

inline double since_s(clock_type::time_point t0, clock_type::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

/// How one request ended; every request has exactly one.
enum class outcome { completed, server_error, sse_error, timeout, client_error, client_dropped };

inline const char* outcome_name(outcome o) {
  switch (o) {
    case outcome::completed: return "completed";
    case outcome::server_error: return "server_error";
    case outcome::sse_error: return "sse_error";
    case outcome::timeout: return "timeout";
    case outcome::client_error: return "client_error";
    case outcome::client_dropped: return "client_dropped";
  }
  return "?";
}
inline constexpr outcome all_outcomes[] = {outcome::completed,    outcome::server_error, outcome::sse_error,
                                    outcome::timeout,      outcome::client_error, outcome::client_dropped};

/// One request as the client saw it; times in seconds since the start of the run.
struct record {
  int64_t index = 0;
  double arrival_s = 0;   ///< when it was due (open loop) or sent (closed loop)
  double sent_s = 0;      ///< when the connection was opened
  /// First token: the first chunk that carries a choice, from sent_s; -1 = none. Its text may
  /// be empty (a byte token that starts a UTF-8 sequence, text held for a stop string), as in
  /// vLLM's benchmark_serving, whose TTFT is the first chunk "even if text is empty".
  double ttft_s = -1;
  double first_text_s = -1;  ///< first chunk with visible text, from sent_s; -1 = none
  double e2e_s = -1;      ///< end of the response, from sent_s
  int status = 0;         ///< HTTP status; 0 = no response
  outcome out = outcome::client_error;
  int64_t words = 0;                ///< prompt length the client built, in words
  int64_t prompt_tokens = -1;       ///< the server's usage.prompt_tokens; -1 = not reported
  int64_t completion_tokens = -1;   ///< the server's usage.completion_tokens
  int64_t chunks = 0;               ///< SSE chunks with a choice (one per token event)
  std::vector<double> itl_s;        ///< gaps between those chunks
  std::string error;                ///< why it did not complete
  double tpot_s() const {
    return completion_tokens > 1 && ttft_s >= 0 ? (e2e_s - ttft_s) / double(completion_tokens - 1) : -1;
  }
};

/// A record's time in seconds (-1 = none) as milliseconds for the JSON output (-1 kept).
inline double ms_or_none(double s) { return s >= 0 ? s * 1e3 : -1; }

struct options {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  double rate = 0;
  int64_t burst = 0;
  double burst_every_s = 1;
  int64_t concurrency = 0;
  int64_t requests = 0;
  double duration_s = 0;
  int64_t prompt_min = 128, prompt_max = 128;
  int64_t max_tokens = 64;
  int64_t shared_prefix = 0, prefix_groups = 1;
  int64_t max_inflight = 256;
  double timeout_s = 60;
  uint32_t seed = 1;
  /// Where finished records go instead of run_load's result (a long run keeps constant client
  /// memory this way: `tandem bench soak`). Called from the client threads, one at a time.
  std::function<void(record&&)> sink;
};

// Common short English words: with a word-level or BPE tokenizer each is about one token
// after a space, so a prompt of N words is roughly N tokens (the server's count is reported).
inline constexpr const char* word_list[] = {
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as", "his",
    "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not", "but", "what", "all",
    "were", "when", "we", "there", "can", "an", "your", "which", "their", "said", "if", "do", "will",
    "each", "about", "how", "up", "out", "them", "then", "she", "many", "some", "so", "these", "would",
    "other", "into", "has", "more", "her", "two", "like", "him", "see", "time", "could", "no", "make",
    "than", "first", "been", "its", "who", "now", "people", "my", "made", "over", "did", "down", "only",
    "way", "find", "use", "may", "water", "long", "little", "very", "after", "words", "called", "just"};
inline constexpr size_t n_words = sizeof(word_list) / sizeof(word_list[0]);

inline std::string words(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<size_t> w(0, n_words - 1);
  std::string s;
  for (int64_t i = 0; i < n; ++i) {
    if (i) s += ' ';
    s += word_list[w(rng)];
  }
  return s;
}

/// A socket connected to host:port, or -1 with `err` set.
inline int connect_tcp(const std::string& host, uint16_t port, double timeout_s, std::string& err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0) {
    err = fmt::format("cannot resolve {}: {}", host, ::gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // Linux bounds a blocking connect by the send timeout: the request's timeout covers it.
    timeval tv{time_t(timeout_s), suseconds_t((timeout_s - double(time_t(timeout_s))) * 1e6)};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  if (fd < 0) {
    err = fmt::format("cannot connect to {}:{}: {}; is the server running (tandem serve, or use --embedded)?", host,
                      port, std::strerror(errno));
    return -1;
  }
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

/// Reads an HTTP/1.1 response incrementally: status and headers, then the body (chunked,
/// Content-Length or until EOF), handing body bytes to the caller as they arrive.
class response_reader {
 public:
  response_reader(int fd, clock_type::time_point deadline) : fd_(fd), deadline_(deadline) {}

  /// Reads more bytes; false on EOF, error or timeout (see timed_out()).
  bool fill() {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - clock_type::now()).count();
    if (left <= 0) return timed_out_ = true, false;
    pollfd p{fd_, POLLIN, 0};
    int r = ::poll(&p, 1, int(std::min<int64_t>(left, 1 << 30)));
    if (r == 0) return timed_out_ = true, false;
    if (r < 0) return false;
    char b[16384];
    ssize_t n = ::recv(fd_, b, sizeof b, 0);
    if (n <= 0) return false;
    raw_.append(b, size_t(n));
    return true;
  }
  /// Reads the status line and headers. False if the connection ended first.
  bool read_head() {
    size_t he;
    while ((he = raw_.find("\r\n\r\n")) == std::string::npos)
      if (!fill()) return false;
    std::string head = raw_.substr(0, he);
    raw_.erase(0, he + 4);
    if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0) return false;
    status_ = std::atoi(head.c_str() + 9);
    for (char& c : head) c = char(std::tolower(static_cast<unsigned char>(c)));
    chunked_ = head.find("\ntransfer-encoding: chunked") != std::string::npos;
    if (auto p = head.find("\ncontent-length:"); p != std::string::npos)
      remaining_ = std::strtoll(head.c_str() + p + 16, nullptr, 10);
    return true;
  }
  /// Next piece of the body into `out`; false at its end (done()) or on failure.
  bool next(std::string& out) {
    out.clear();
    if (done_) return false;
    if (!chunked_) {
      if (raw_.empty() && remaining_ != 0 && !fill()) {
        done_ = remaining_ < 0;  // no length: EOF ends the body
        return false;
      }
      size_t n = remaining_ < 0 ? raw_.size() : std::min(raw_.size(), size_t(remaining_));
      out = raw_.substr(0, n);
      raw_.erase(0, n);
      if (remaining_ >= 0) remaining_ -= int64_t(n);
      if (remaining_ == 0) done_ = true;
      return !out.empty() || done_;
    }
    while (true) {
      size_t e = raw_.find("\r\n");
      if (e != std::string::npos) {
        const uint64_t size = std::strtoull(raw_.c_str(), nullptr, 16);
        if (size == 0) return done_ = true, false;
        if (raw_.size() >= e + 2 + size + 2) {
          out = raw_.substr(e + 2, size);
          raw_.erase(0, e + 2 + size + 2);
          return true;
        }
      }
      if (!fill()) return false;
    }
  }
  int status() const { return status_; }
  bool done() const { return done_; }
  bool timed_out() const { return timed_out_; }

 private:
  int fd_;
  clock_type::time_point deadline_;
  std::string raw_;
  int status_ = 0;
  bool chunked_ = false, done_ = false, timed_out_ = false;
  int64_t remaining_ = -1;
};

/// Sends one streaming completion and fills `r` (status, outcome, latencies, usage).
inline void run_request(const options& o, const std::string& prompt, clock_type::time_point t0, record& r) {
  const auto sent = clock_type::now();
  r.sent_s = since_s(t0, sent);
  const auto deadline = sent + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.timeout_s));
  auto finish = [&](outcome out, std::string why = {}) {
    r.e2e_s = since_s(sent, clock_type::now());
    r.out = out;
    r.error = std::move(why);
  };
  std::string err;
  int fd = connect_tcp(o.host, o.port, o.timeout_s, err);
  if (fd < 0) return finish(outcome::client_error, err);
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_fd{fd};
  json::writer w;
  w.begin_object().key("prompt").str(prompt).key("max_tokens").num(o.max_tokens).key("stream").boolean(true);
  w.key("ignore_eos").boolean(true).key("temperature").real(0);
  w.key("stream_options").begin_object().key("include_usage").boolean(true).end_object().end_object();
  const std::string body = w.take();
  const std::string req = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nAccept: "
      "text/event-stream\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{}",
      o.host, o.port, body.size(), body);
  for (size_t off = 0; off < req.size();) {
    ssize_t n = ::send(fd, req.data() + off, req.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return finish(outcome::client_error, fmt::format("send failed: {}", std::strerror(errno)));
    off += size_t(n);
  }
  response_reader rd(fd, deadline);
  if (!rd.read_head())
    return finish(rd.timed_out() ? outcome::timeout : outcome::client_error, "connection closed before the response head");
  r.status = rd.status();
  std::string piece, body_in;
  if (r.status != 200) {
    while (rd.next(piece)) body_in += piece;
    if (rd.timed_out()) return finish(outcome::timeout, "timed out reading the error body");
    return finish(outcome::server_error, body_in.substr(0, 300));
  }
  // SSE: events are separated by a blank line; each carries one `data:` line.
  double last_chunk_s = -1;
  bool got_done = false;
  std::string sse_error;
  while (!got_done) {
    if (!rd.next(piece)) break;
    body_in += piece;
    size_t e;
    while ((e = body_in.find("\n\n")) != std::string::npos) {
      std::string ev = body_in.substr(0, e);
      body_in.erase(0, e + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      std::string data = ev.substr(6);
      if (data == "[DONE]") {
        got_done = true;
        break;
      }
      const double t = since_s(sent, clock_type::now());
      json::value v;
      try {
        v = json::parse(data);
      } catch (const std::exception& ex) {
        return finish(outcome::client_error, fmt::format("bad SSE JSON ({}): {}", ex.what(), data.substr(0, 200)));
      }
      if (const json::value* er = v.find("error")) {
        const json::value* m = er->find("message");
        sse_error = m && m->k == json::kind::string ? m->s : data.substr(0, 300);
        continue;
      }
      if (const json::value* u = v.find("usage"); u && u->k == json::kind::object) {
        if (const json::value* p = u->find("prompt_tokens"); p && p->is_int) r.prompt_tokens = p->i;
        if (const json::value* c = u->find("completion_tokens"); c && c->is_int) r.completion_tokens = c->i;
      }
      const json::value* ch = v.find("choices");
      if (ch && ch->k == json::kind::array && !ch->arr.empty()) {
        const json::value* text = ch->arr[0].find("text");
        if (text && text->k == json::kind::string) {
          const json::value* fin = ch->arr[0].find("finish_reason");
          const bool last = fin && fin->k == json::kind::string;
          // The closing chunk carries the finish reason and only text held back until then.
          if (!last || !text->s.empty()) {
            if (r.ttft_s < 0) r.ttft_s = t;
            else r.itl_s.push_back(t - last_chunk_s);
            last_chunk_s = t;
            ++r.chunks;
          }
          if (r.first_text_s < 0 && !text->s.empty()) r.first_text_s = t;
        }
      }
    }
  }
  if (!sse_error.empty()) return finish(outcome::sse_error, sse_error);
  if (!got_done) {
    if (rd.timed_out()) return finish(outcome::timeout, fmt::format("no [DONE] within --timeout-s {}", o.timeout_s));
    return finish(outcome::client_error, "the stream ended without data: [DONE]");
  }
  finish(outcome::completed);
}

/// A prompt for request `i`: an optional shared prefix (one of `prefix_groups`), then
/// unique words up to the sampled length.
struct prompt_maker {
  explicit prompt_maker(const options& o) : o_(o), rng_(o.seed) {
    std::mt19937 prng(o.seed ^ 0x9e3779b9u);
    for (int64_t g = 0; g < std::max<int64_t>(1, o.prefix_groups); ++g) prefixes_.push_back(words(prng, o.shared_prefix));
  }
  std::pair<std::string, int64_t> next(int64_t i) {
    std::lock_guard<std::mutex> l(m_);
    std::uniform_int_distribution<int64_t> len(o_.prompt_min, o_.prompt_max);
    const int64_t n = std::max(len(rng_), o_.shared_prefix + 1);
    std::string p = prefixes_[size_t(i % int64_t(prefixes_.size()))];
    std::string rest = words(rng_, n - o_.shared_prefix);
    return {p.empty() ? rest : p + " " + rest, n};
  }

 private:
  const options& o_;
  std::mutex m_;
  std::mt19937 rng_;
  std::vector<std::string> prefixes_;
};

/// Runs the load and returns one record per request (sent or dropped), by index.
inline std::vector<record> run_load(const options& o, prompt_maker& prompts, double& wall_s) {
  std::mutex m;
  std::vector<record> recs;
  const auto t0 = clock_type::now();
  auto due = [&](double s) { return t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(s)); };
  auto within = [&](int64_t i, double at_s) {
    return (o.requests <= 0 || i < o.requests) && (o.duration_s <= 0 || at_s < o.duration_s);
  };
  auto run_one = [&](int64_t i, double arrival_s) {
    record r;
    r.index = i;
    r.arrival_s = arrival_s;
    auto [text, n] = prompts.next(i);
    r.words = n;
    run_request(o, text, t0, r);
    std::lock_guard<std::mutex> l(m);
    if (o.sink) o.sink(std::move(r));
    else recs.push_back(std::move(r));
  };
  if (o.concurrency > 0) {
    // Closed loop: each stream sends its next request when the previous one ends.
    std::atomic<int64_t> next{0};
    std::vector<std::thread> streams;
    for (int64_t s = 0; s < o.concurrency; ++s)
      streams.emplace_back([&] {
        while (true) {
          const double at = since_s(t0, clock_type::now());
          const int64_t i = next.fetch_add(1);
          if (!within(i, at)) return;
          run_one(i, at);
        }
      });
    for (auto& t : streams) t.join();
  } else {
    // Open loop: a fixed pool of `max_inflight` client threads; an arrival that finds all
    // of them busy is dropped by the client (and counted), never delayed.
    struct job {
      int64_t i;
      double at;
    };
    std::mutex qm;
    std::condition_variable cv;
    std::deque<job> q;
    int64_t busy = 0;
    bool closing = false;
    std::vector<std::thread> pool;
    for (int64_t k = 0; k < o.max_inflight; ++k)
      pool.emplace_back([&] {
        while (true) {
          std::unique_lock<std::mutex> l(qm);
          cv.wait(l, [&] { return closing || !q.empty(); });
          if (q.empty()) return;
          job j = q.front();
          q.pop_front();
          l.unlock();
          run_one(j.i, j.at);
          l.lock();
          --busy;
        }
      });
    std::mt19937_64 arr_rng(o.seed * 7919u + 1);
    std::exponential_distribution<double> gap(o.rate > 0 ? o.rate : 1.0);
    double at = 0;
    for (int64_t i = 0;; ++i) {
      if (o.rate > 0) at += gap(arr_rng);
      else at = double(i / o.burst) * o.burst_every_s;
      if (!within(i, at)) break;
      std::this_thread::sleep_until(due(at));
      std::unique_lock<std::mutex> l(qm);
      if (busy >= o.max_inflight) {
        l.unlock();
        record r;
        r.index = i;
        r.arrival_s = at;
        r.sent_s = since_s(t0, clock_type::now());
        r.out = outcome::client_dropped;
        r.error = fmt::format("all --max-inflight {} client threads busy", o.max_inflight);
        std::lock_guard<std::mutex> g(m);
        if (o.sink) o.sink(std::move(r));
        else recs.push_back(std::move(r));
        continue;
      }
      ++busy;
      q.push_back({i, at});
      cv.notify_one();
    }
    {
      std::lock_guard<std::mutex> l(qm);
      closing = true;
    }
    cv.notify_all();
    for (auto& t : pool) t.join();
  }
  wall_s = since_s(t0, clock_type::now());
  std::sort(recs.begin(), recs.end(), [](const record& a, const record& b) { return a.index < b.index; });
  return recs;
}

struct summary {
  std::map<outcome, int64_t> by_outcome;
  int64_t st200 = 0, st503 = 0, st429 = 0, st4xx = 0, st_other = 0;
  int64_t sent = 0, good = 0, output_tokens = 0, prompt_tokens = 0, prompt_reported = 0, prompt_words = 0;
  double wall_s = 0, active_s = 0;
  std::vector<double> ttft, tpot, itl, e2e, reject;
  std::vector<double> first_text;  ///< time to the first visible text (ms): >= ttft
};

inline summary summarize(const std::vector<record>& recs, double wall_s, double slo_ttft_ms, double slo_tpot_ms) {
  summary s;
  s.wall_s = wall_s;
  double first = 1e30, last = 0;
  for (const record& r : recs) {
    ++s.by_outcome[r.out];
    if (r.out == outcome::client_dropped) continue;
    ++s.sent;
    first = std::min(first, r.sent_s);
    last = std::max(last, r.sent_s + std::max(0.0, r.e2e_s));
    if (r.status == 200) ++s.st200;
    else if (r.status == 503) ++s.st503;
    else if (r.status == 429) ++s.st429;
    else if (r.status >= 400 && r.status < 500) ++s.st4xx;
    else ++s.st_other;
    if (r.status != 200 && r.status != 0) s.reject.push_back(r.e2e_s * 1e3);
    if (r.prompt_tokens >= 0) s.prompt_tokens += r.prompt_tokens, ++s.prompt_reported, s.prompt_words += r.words;
    if (r.out != outcome::completed) continue;
    s.output_tokens += std::max<int64_t>(0, r.completion_tokens);
    if (r.ttft_s >= 0) s.ttft.push_back(r.ttft_s * 1e3);
    if (r.first_text_s >= 0) s.first_text.push_back(r.first_text_s * 1e3);
    if (r.tpot_s() >= 0) s.tpot.push_back(r.tpot_s() * 1e3);
    for (double g : r.itl_s) s.itl.push_back(g * 1e3);
    s.e2e.push_back(r.e2e_s * 1e3);
    const bool ttft_ok = slo_ttft_ms <= 0 || (r.ttft_s >= 0 && r.ttft_s * 1e3 <= slo_ttft_ms);
    const bool tpot_ok = slo_tpot_ms <= 0 || r.tpot_s() * 1e3 <= slo_tpot_ms;
    if (ttft_ok && tpot_ok) ++s.good;
  }
  s.active_s = last > first ? last - first : wall_s;
  return s;
}

inline void write_pcts(json::writer& w, const char* name, const std::vector<double>& v) {
  w.key(name).begin_object().key("p50").real(percentile(v, 50)).key("p90").real(percentile(v, 90));
  w.key("p99").real(percentile(v, 99)).key("n").num(int64_t(v.size())).end_object();
}

inline int64_t parse_int(const std::string& s, const char* flag) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(s, &used);
    if (used != s.size()) throw 0;
    return v;
  } catch (...) {
    throw tandem::error(fmt::format("--{} expects an integer, got '{}'", flag, s));
  }
}


}  // namespace tandem::cli::load
