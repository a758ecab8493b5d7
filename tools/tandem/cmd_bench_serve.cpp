// tandem bench serve: a load generator over HTTP against a running tandem server, or one it
// starts in-process (--embedded). Streams /v1/completions (SSE) so time to first token and
// inter-token latency are measured per request; arrivals are open-loop (Poisson or bursts:
// the client never waits for the server, so overload shows up as rejections and queueing)
// or closed-loop (--concurrency N streams). With --compare-model it also measures the
// single-process batched decode throughput in the same run and prints the ratio.
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
#include <cmath>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <deque>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/common/error.h"
#include "actors/runtime/embedded_cluster.h"
#include "tools/tandem/bench_modes.h"
#include "tools/tandem/flags.h"
#include "transport/http/json.h"
#include "transport/rpc/front_end.h"

namespace tandem::cli {

namespace {

using clock_type = std::chrono::steady_clock;

double since_s(clock_type::time_point t0, clock_type::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

/// How one request ended; every request has exactly one.
enum class outcome { completed, server_error, sse_error, timeout, client_error, client_dropped };

const char* outcome_name(outcome o) {
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
constexpr outcome all_outcomes[] = {outcome::completed,    outcome::server_error, outcome::sse_error,
                                    outcome::timeout,      outcome::client_error, outcome::client_dropped};

/// One request as the client saw it; times in seconds since the start of the run.
struct record {
  int64_t index = 0;
  double arrival_s = 0;   ///< when it was due (open loop) or sent (closed loop)
  double sent_s = 0;      ///< when the connection was opened
  double ttft_s = -1;     ///< first text chunk, from sent_s; -1 = none
  double e2e_s = -1;      ///< end of the response, from sent_s
  int status = 0;         ///< HTTP status; 0 = no response
  outcome out = outcome::client_error;
  int64_t words = 0;                ///< prompt length the client built, in words
  int64_t prompt_tokens = -1;       ///< the server's usage.prompt_tokens; -1 = not reported
  int64_t completion_tokens = -1;   ///< the server's usage.completion_tokens
  int64_t chunks = 0;               ///< SSE chunks with text
  std::vector<double> itl_s;        ///< gaps between text chunks
  std::string error;                ///< why it did not complete
  double tpot_s() const {
    return completion_tokens > 1 && ttft_s >= 0 ? (e2e_s - ttft_s) / double(completion_tokens - 1) : -1;
  }
};

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
};

// Common short English words: with a word-level or BPE tokenizer each is about one token
// after a space, so a prompt of N words is roughly N tokens (the server's count is reported).
constexpr const char* word_list[] = {
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as", "his",
    "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not", "but", "what", "all",
    "were", "when", "we", "there", "can", "an", "your", "which", "their", "said", "if", "do", "will",
    "each", "about", "how", "up", "out", "them", "then", "she", "many", "some", "so", "these", "would",
    "other", "into", "has", "more", "her", "two", "like", "him", "see", "time", "could", "no", "make",
    "than", "first", "been", "its", "who", "now", "people", "my", "made", "over", "did", "down", "only",
    "way", "find", "use", "may", "water", "long", "little", "very", "after", "words", "called", "just"};
constexpr size_t n_words = sizeof(word_list) / sizeof(word_list[0]);

std::string words(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<size_t> w(0, n_words - 1);
  std::string s;
  for (int64_t i = 0; i < n; ++i) {
    if (i) s += ' ';
    s += word_list[w(rng)];
  }
  return s;
}

/// A socket connected to host:port, or -1 with `err` set.
int connect_tcp(const std::string& host, uint16_t port, double timeout_s, std::string& err) {
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
void run_request(const options& o, const std::string& prompt, clock_type::time_point t0, record& r) {
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
        if (text && text->k == json::kind::string && !text->s.empty()) {
          if (r.ttft_s < 0) r.ttft_s = t;
          else r.itl_s.push_back(t - last_chunk_s);
          last_chunk_s = t;
          ++r.chunks;
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
std::vector<record> run_load(const options& o, prompt_maker& prompts, double& wall_s) {
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
    recs.push_back(std::move(r));
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
        recs.push_back(std::move(r));
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
};

summary summarize(const std::vector<record>& recs, double wall_s, double slo_ttft_ms, double slo_tpot_ms) {
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

void write_pcts(json::writer& w, const char* name, const std::vector<double>& v) {
  w.key(name).begin_object().key("p50").real(percentile(v, 50)).key("p90").real(percentile(v, 90));
  w.key("p99").real(percentile(v, 99)).key("n").num(int64_t(v.size())).end_object();
}

/// A scatter plot of TTFT and E2E (ms, log scale) against arrival time; rejections in red.
std::string svg_plot(const std::vector<record>& recs) {
  const double W = 900, H = 480, L = 70, R = 20, T = 40, B = 50;
  double tmax = 1e-3, ymax = 1, ymin = 1e9;
  for (const record& r : recs) {
    tmax = std::max(tmax, r.arrival_s);
    if (r.e2e_s > 0) ymax = std::max(ymax, r.e2e_s * 1e3), ymin = std::min(ymin, r.e2e_s * 1e3);
    if (r.ttft_s > 0) ymin = std::min(ymin, r.ttft_s * 1e3);
  }
  ymin = std::pow(10.0, std::floor(std::log10(std::max(ymin, 0.01))));
  ymax = std::pow(10.0, std::ceil(std::log10(std::max(ymax, ymin * 10))));
  auto x = [&](double t) { return L + (W - L - R) * t / tmax; };
  auto y = [&](double ms) {
    const double v = std::log10(std::clamp(ms, ymin, ymax));
    return H - B - (H - T - B) * (v - std::log10(ymin)) / (std::log10(ymax) - std::log10(ymin));
  };
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"20\" font-size=\"14\">tandem bench serve: latency by arrival time</text>\n",
      W, H, L);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>\n", L, H - B, W - R);
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\"/>\n", L, T, H - B);
  for (double d = ymin; d <= ymax * 1.001; d *= 10)
    s += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#ddd\"/><text x=\"{3}\" y=\"{4:.1f}\" "
        "text-anchor=\"end\">{5:g}</text>\n",
        L, y(d), W - R, L - 6, y(d) + 4, d);
  for (int k = 0; k <= 5; ++k) {
    const double t = tmax * k / 5;
    s += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.2f}</text>\n", x(t), H - B + 18, t);
  }
  s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">arrival time (s)</text>\n", (L + W - R) / 2, H - 12);
  s += fmt::format("<text x=\"16\" y=\"{0}\" transform=\"rotate(-90 16 {0})\" text-anchor=\"middle\">latency (ms, log)</text>\n",
                   (T + H - B) / 2);
  for (const record& r : recs) {
    if (r.out == outcome::completed) {
      s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"#1f77b4\"/>", x(r.arrival_s), y(r.e2e_s * 1e3));
      if (r.ttft_s >= 0)
        s += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"#ff7f0e\"/>", x(r.arrival_s), y(r.ttft_s * 1e3));
      s += "\n";
    } else if (r.e2e_s >= 0) {
      s += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" fill=\"#d62728\" text-anchor=\"middle\">x</text>\n", x(r.arrival_s),
                       y(r.e2e_s * 1e3) + 4);
    }
  }
  const double lx = W - R - 260;
  s += fmt::format(
      "<circle cx=\"{0}\" cy=\"30\" r=\"4\" fill=\"#ff7f0e\"/><text x=\"{1}\" y=\"34\">TTFT</text>"
      "<circle cx=\"{2}\" cy=\"30\" r=\"4\" fill=\"#1f77b4\"/><text x=\"{3}\" y=\"34\">E2E</text>"
      "<text x=\"{4}\" y=\"34\" fill=\"#d62728\">x not completed (E2E)</text>\n</svg>\n",
      lx, lx + 8, lx + 60, lx + 68, lx + 110);
  return s;
}

int64_t parse_int(const std::string& s, const char* flag) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(s, &used);
    if (used != s.size()) throw 0;
    return v;
  } catch (...) {
    throw tandem::error(fmt::format("--{} expects an integer, got '{}'", flag, s));
  }
}

}  // namespace

int bench_serve(args a) {
  flags f;
  f.opt("host", "server address", "127.0.0.1")
      .opt("port", "server HTTP port (not with --embedded)", "8080")
      .sw("embedded", "start an embedded cluster and HTTP front end in this process (needs --model)")
      .opt("model", "with --embedded or --compare-model: GGUF model file")
      .opt("threads", "with --embedded: kernel threads of the worker (and of --compare-model)", "1")
      .opt("max-running-seqs", "with --embedded: decode batch size", "32")
      .opt("max-queued-requests", "with --embedded: prefill queue bound", "256")
      .opt("kv-cache-mb", "with --embedded: KV cache size in MiB", "256")
      .opt("rate", "open loop: Poisson arrivals at this many requests/s")
      .opt("burst", "open loop: N requests at once every --burst-every seconds")
      .opt("burst-every", "seconds between bursts", "1")
      .opt("concurrency", "closed loop: N streams, each sends its next request when the previous ends")
      .opt("requests", "stop after this many requests (0 = no bound; then --duration-s bounds)", "64")
      .opt("duration-s", "stop sending after this many seconds (0 = no bound)", "0")
      .opt("seed", "seed of arrivals and prompts", "1")
      .opt("prompt-tokens", "prompt length in words (~tokens): N or MIN:MAX (uniform)", "128")
      .opt("max-tokens", "output tokens per request (sent with ignore_eos, so exact)", "64")
      .opt("shared-prefix-tokens", "the first N words of each prompt are shared by its session group", "0")
      .opt("prefix-groups", "number of distinct shared prefixes (requests use them round robin)", "1")
      .opt("max-inflight", "open loop: client threads; arrivals beyond are counted as client_dropped", "256")
      .opt("warmup", "requests sent one by one before the run and not counted (first-request setup)", "1")
      .opt("timeout-s", "client-side timeout of one request", "60")
      .opt("slo-ttft-ms", "goodput: TTFT bound (0 = none)", "0")
      .opt("slo-tpot-ms", "goodput: time per output token bound (0 = none)", "0")
      .opt("json", "write everything (summary and per-request records) to this file")
      .opt("svg", "write a plot of TTFT and E2E latency over arrival time to this file")
      .sw("compare-model", "also measure single-process batched decode (bench model) at batch --concurrency and print the ratio");
  if (!f.parse(a)) {
    std::printf("usage: tandem bench serve (--port P | --embedded --model FILE) (--rate R | --burst N | --concurrency N) [options]\n\n%s",
                f.help().c_str());
    return 0;
  }
  if (!f.positional().empty()) throw tandem::error("unexpected argument '" + f.positional().front() + "'");
  options o;
  o.host = f.str("host");
  const int n_modes = int(f.has("rate")) + int(f.has("burst")) + int(f.has("concurrency"));
  if (n_modes != 1) throw tandem::error("give exactly one of --rate R, --burst N or --concurrency N");
  if (f.has("rate")) o.rate = f.real("rate");
  if (f.has("burst")) o.burst = f.num("burst");
  if (f.has("concurrency")) o.concurrency = f.num("concurrency");
  o.burst_every_s = f.real("burst-every");
  if (f.has("rate") && !(o.rate > 0)) throw tandem::error("--rate must be > 0 requests/s");
  if (f.has("burst") && (o.burst < 1 || !(o.burst_every_s > 0)))
    throw tandem::error("--burst must be >= 1 and --burst-every > 0 seconds");
  if (f.has("concurrency") && (o.concurrency < 1 || o.concurrency > 4096))
    throw tandem::error("--concurrency must be in [1, 4096]");
  o.requests = f.num("requests");
  o.duration_s = f.real("duration-s");
  if (o.requests < 0 || o.duration_s < 0) throw tandem::error("--requests and --duration-s must be >= 0");
  if (o.requests == 0 && o.duration_s == 0)
    throw tandem::error("--requests 0 and --duration-s 0 would never stop; bound one of them");
  o.seed = uint32_t(f.num("seed"));
  const std::string pt = f.str("prompt-tokens");
  if (auto c = pt.find(':'); c != std::string::npos) {
    o.prompt_min = parse_int(pt.substr(0, c), "prompt-tokens");
    o.prompt_max = parse_int(pt.substr(c + 1), "prompt-tokens");
  } else {
    o.prompt_min = o.prompt_max = parse_int(pt, "prompt-tokens");
  }
  if (o.prompt_min < 1 || o.prompt_max < o.prompt_min)
    throw tandem::error("--prompt-tokens must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got '" + pt + "'");
  o.max_tokens = f.num("max-tokens");
  o.shared_prefix = f.num("shared-prefix-tokens");
  o.prefix_groups = f.num("prefix-groups");
  if (o.max_tokens < 1) throw tandem::error("--max-tokens must be >= 1");
  if (o.shared_prefix < 0 || o.shared_prefix >= o.prompt_min || o.prefix_groups < 1)
    throw tandem::error("--shared-prefix-tokens must be >= 0 and below the shortest prompt; --prefix-groups >= 1");
  o.max_inflight = f.num("max-inflight");
  if (o.max_inflight < 1 || o.max_inflight > 4096) throw tandem::error("--max-inflight must be in [1, 4096]");
  o.timeout_s = f.real("timeout-s");
  if (!(o.timeout_s > 0)) throw tandem::error("--timeout-s must be > 0");
  const double slo_ttft_ms = f.real("slo-ttft-ms"), slo_tpot_ms = f.real("slo-tpot-ms");
  const bool embedded = f.on("embedded"), compare = f.on("compare-model");
  const std::string model_path = f.str("model");
  if ((embedded || compare) && model_path.empty())
    throw tandem::error("--embedded and --compare-model need --model FILE (write one with tandem make-model)");
  if (compare && o.concurrency < 1)
    throw tandem::error("--compare-model compares against decode at batch --concurrency N; give --concurrency");
  const int64_t threads = f.num("threads");
  if (threads < 1 || threads > 1024) throw tandem::error("--threads must be in [1, 1024]");
  std::signal(SIGPIPE, SIG_IGN);

  // The embedded server: cluster + HTTP front end on its own thread, on a free port.
  std::unique_ptr<embedded_cluster> cluster;
  std::unique_ptr<front_end> fe;
  std::promise<uint16_t> ready;  // the embedded front end's HTTP port; outlives its thread
  std::thread fe_thread;
  if (embedded) {
    if (f.has("port")) throw tandem::error("--port conflicts with --embedded (the embedded server picks a free port)");
    cluster_options co;
    co.model_path = model_path;
    co.log_level = "warn";
    co.lim.threads = int32_t(threads);
    co.lim.max_running_seqs = int32_t(f.num("max-running-seqs"));
    co.lim.max_queued_requests = int32_t(f.num("max-queued-requests"));
    co.lim.kv_cache_mb = int32_t(f.num("kv-cache-mb"));
    if (auto msg = co.lim.validate(); !msg.empty()) throw tandem::error(msg);
    cluster = embedded_cluster::start(co);
    front_end_options fo;
    fo.http_port = 0;
    fo.rpc_port = -1;
    fo.lim = co.lim;
    fe = std::make_unique<front_end>(*cluster, fo);
    auto port = ready.get_future();
    fe_thread = std::thread([&] {
      bool reported = false;
      try {
        fe->run([&](const listener_info& l) {
          if (l.what == "http") ready.set_value(l.port), reported = true;
        });
      } catch (...) {
        // After the port was reported the load is already running; the requests then fail
        // with client errors that name the cause.
        if (!reported) ready.set_exception(std::current_exception());
      }
    });
    try {
      o.port = port.get();
    } catch (...) {
      fe_thread.join();
      throw;
    }
  } else {
    const int64_t p = f.num("port");
    if (p < 1 || p > 65535) throw tandem::error("--port must be in [1, 65535]");
    o.port = uint16_t(p);
  }
  struct stop_server {
    std::unique_ptr<front_end>& fe;
    std::thread& t;
    ~stop_server() {
      if (fe) fe->stop();
      if (t.joinable()) t.join();
    }
  } stopper{fe, fe_thread};

  prompt_maker prompts(o);
  const int64_t warmup = f.num("warmup");
  if (warmup < 0 || warmup > 1000) throw tandem::error("--warmup must be in [0, 1000]");
  for (int64_t i = 0; i < warmup; ++i) {
    prompt_maker warm_prompts(o);  // its own generator: the run's prompts do not depend on --warmup
    record r;
    run_request(o, warm_prompts.next(i).first, clock_type::now(), r);
    if (r.out != outcome::completed)
      throw tandem::error(fmt::format("warm-up request {} did not complete ({}, HTTP {}): {}", i, outcome_name(r.out),
                                      r.status, r.error));
  }
  double wall_s = 0;
  const std::vector<record> recs = run_load(o, prompts, wall_s);
  const summary s = summarize(recs, wall_s, slo_ttft_ms, slo_tpot_ms);
  const double out_tps = double(s.output_tokens) / s.active_s;

  // The same run's single-process decode at batch N, on a quiet machine: the server first.
  double model_tps = 0;
  int64_t model_ctx = 0;
  if (compare) {
    if (fe) fe->stop();
    if (fe_thread.joinable()) fe_thread.join();
    fe.reset();
    cluster.reset();
    model_ctx = (o.prompt_min + o.prompt_max) / 2 + o.max_tokens / 2;
    model_tps = bench_model_decode_tokens_per_s(model_path, int32_t(threads), o.concurrency, model_ctx);
  }

  const std::string mode = o.rate > 0 ? fmt::format("poisson {} req/s", o.rate)
                           : o.burst > 0 ? fmt::format("bursts of {} every {} s", o.burst, o.burst_every_s)
                                         : fmt::format("closed loop, {} streams", o.concurrency);
  std::printf("tandem bench serve: %s:%u%s, %s, prompts %lld..%lld words, %lld output tokens\n", o.host.c_str(),
              unsigned(o.port), embedded ? " (embedded)" : "", mode.c_str(), (long long)o.prompt_min,
              (long long)o.prompt_max, (long long)o.max_tokens);
  std::printf("requests %lld sent in %.2f s:", (long long)s.sent, s.wall_s);
  for (outcome oc : all_outcomes) {
    auto it = s.by_outcome.find(oc);
    std::printf(" %s %lld", outcome_name(oc), (long long)(it == s.by_outcome.end() ? 0 : it->second));
  }
  std::printf("\nHTTP status: 200 %lld, 503 %lld, 429 %lld, other 4xx %lld, other %lld\n", (long long)s.st200,
              (long long)s.st503, (long long)s.st429, (long long)s.st4xx, (long long)s.st_other);
  if (s.prompt_reported > 0)
    std::printf("prompt: %.1f words -> %.1f tokens per request (server usage.prompt_tokens)\n",
                double(s.prompt_words) / double(s.prompt_reported), double(s.prompt_tokens) / double(s.prompt_reported));
  std::printf("%-10s %10s %10s %10s %8s\n", "ms", "p50", "p90", "p99", "n");
  auto row = [](const char* n, const std::vector<double>& v) {
    std::printf("%-10s %10.2f %10.2f %10.2f %8zu\n", n, percentile(v, 50), percentile(v, 90), percentile(v, 99), v.size());
  };
  row("TTFT", s.ttft);
  row("TPOT", s.tpot);
  row("ITL", s.itl);
  row("E2E", s.e2e);
  if (!s.reject.empty()) std::printf("rejection p50 %.2f ms, p99 %.2f ms\n", percentile(s.reject, 50), percentile(s.reject, 99));
  const int64_t completed = s.by_outcome.count(outcome::completed) ? s.by_outcome.at(outcome::completed) : 0;
  std::printf("throughput: %.2f req/s, %.1f output tokens/s; goodput %lld requests (%.2f req/s) within TTFT <= %s, TPOT <= %s\n",
              double(completed) / s.active_s, out_tps, (long long)s.good, double(s.good) / s.active_s,
              slo_ttft_ms > 0 ? fmt::format("{} ms", slo_ttft_ms).c_str() : "any",
              slo_tpot_ms > 0 ? fmt::format("{} ms", slo_tpot_ms).c_str() : "any");
  if (compare)
    std::printf("compare: served %.1f tokens/s / bench model decode batch %lld (ctx %lld) %.1f tokens/s = %.3f (goal >= 0.8)\n",
                out_tps, (long long)o.concurrency, (long long)model_ctx, model_tps, model_tps > 0 ? out_tps / model_tps : 0.0);
  if (compare && !s.itl.empty()) {
    // Without prefill and ramp: N streams each getting a token every median ITL.
    const double steady_tps = double(o.concurrency) / (percentile(s.itl, 50) / 1e3);
    std::printf("compare (decode only): %lld streams / ITL p50 = %.1f tokens/s = %.3f of bench model\n",
                (long long)o.concurrency, steady_tps, model_tps > 0 ? steady_tps / model_tps : 0.0);
  }
  for (const record& r : recs)
    if (r.out != outcome::completed && r.out != outcome::server_error && r.out != outcome::client_dropped) {
      std::printf("first failure (request %lld, %s): %s\n", (long long)r.index, outcome_name(r.out), r.error.c_str());
      break;
    }

  if (f.has("json")) {
    json::writer w;
    w.begin_object().key("host").str(o.host).key("port").num(o.port).key("embedded").boolean(embedded);
    w.key("mode").str(o.rate > 0 ? "poisson" : o.burst > 0 ? "burst" : "closed_loop");
    w.key("rate").real(o.rate).key("burst").num(o.burst).key("burst_every_s").real(o.burst_every_s);
    w.key("concurrency").num(o.concurrency).key("seed").num(o.seed);
    w.key("prompt_tokens_min").num(o.prompt_min).key("prompt_tokens_max").num(o.prompt_max);
    w.key("max_tokens").num(o.max_tokens).key("shared_prefix_tokens").num(o.shared_prefix);
    w.key("requests").num(int64_t(recs.size())).key("sent").num(s.sent).key("wall_s").real(s.wall_s);
    w.key("active_s").real(s.active_s);
    w.key("outcomes").begin_object();
    for (outcome oc : all_outcomes)
      w.key(outcome_name(oc)).num(s.by_outcome.count(oc) ? s.by_outcome.at(oc) : 0);
    w.end_object();
    w.key("status").begin_object().key("200").num(s.st200).key("503").num(s.st503).key("429").num(s.st429);
    w.key("4xx").num(s.st4xx).key("other").num(s.st_other).end_object();
    write_pcts(w, "ttft_ms", s.ttft);
    write_pcts(w, "tpot_ms", s.tpot);
    write_pcts(w, "itl_ms", s.itl);
    write_pcts(w, "e2e_ms", s.e2e);
    write_pcts(w, "rejection_ms", s.reject);
    w.key("request_throughput").real(double(completed) / s.active_s).key("output_tokens_per_s").real(out_tps);
    w.key("output_tokens").num(s.output_tokens);
    w.key("goodput").begin_object().key("requests").num(s.good).key("per_s").real(double(s.good) / s.active_s);
    w.key("slo_ttft_ms").real(slo_ttft_ms).key("slo_tpot_ms").real(slo_tpot_ms).end_object();
    if (compare) {
      w.key("compare_model").begin_object().key("batch").num(o.concurrency).key("context").num(model_ctx);
      w.key("decode_tokens_per_s").real(model_tps).key("served_tokens_per_s").real(out_tps);
      w.key("ratio").real(model_tps > 0 ? out_tps / model_tps : 0.0).end_object();
    }
    w.key("records").begin_array();
    for (const record& r : recs) {
      w.begin_object().key("index").num(r.index).key("arrival_s").real(r.arrival_s).key("sent_s").real(r.sent_s);
      w.key("outcome").str(outcome_name(r.out)).key("status").num(r.status);
      w.key("ttft_ms").real(r.ttft_s >= 0 ? r.ttft_s * 1e3 : -1).key("e2e_ms").real(r.e2e_s >= 0 ? r.e2e_s * 1e3 : -1);
      w.key("tpot_ms").real(r.tpot_s() >= 0 ? r.tpot_s() * 1e3 : -1);
      w.key("prompt_words").num(r.words).key("prompt_tokens").num(r.prompt_tokens);
      w.key("completion_tokens").num(r.completion_tokens).key("chunks").num(r.chunks);
      w.key("itl_ms").begin_array();
      for (double g : r.itl_s) w.real(g * 1e3);
      w.end_array();
      if (!r.error.empty()) w.key("error").str(r.error);
      w.end_object();
    }
    w.end_array().end_object();
    std::ofstream out(f.str("json"));
    out << w.text() << "\n";
    if (!out) throw tandem::error("cannot write --json " + f.str("json"));
  }
  if (f.has("svg")) {
    std::ofstream out(f.str("svg"));
    out << svg_plot(recs);
    if (!out) throw tandem::error("cannot write --svg " + f.str("svg"));
  }
  return 0;
}

}  // namespace tandem::cli
