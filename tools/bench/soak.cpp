// tandem bench soak: sustained overload. An embedded cluster with Tandem's default bounds,
// behind its own HTTP front end, gets its capacity measured (closed loop), then an open-loop
// load of --overload x that capacity (Poisson or bursts) for --duration-s. Goals: the
// process's resident memory stays bounded (growth from the end of the warm-up to the end of
// the run < --max-rss-growth-pct), no mailbox or queue ever exceeds its bound (the gates'
// high-water marks from /metrics), and every request sent gets exactly one final answer
// (a completion or an explicit error status). Exits 1 if a goal is missed.
//
// The cluster runs in a child process that samples its own RSS and heap 4x a second and sends
// them over a pipe, so the load generator (its client threads' stacks, buffers) is not measured.
// The load generator keeps constant memory anyway: records go to a tally (options::sink), not
// into a vector that grows with the run.
#include <fmt/format.h>
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/base/error.h"
#include "tools/bench/cluster.h"
#include "tools/bench/load.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"
#include "transport/http/json.h"

namespace tandem::cli {

namespace {

using namespace load;

/// Resident set size of this process in bytes (/proc/self/statm), 0 if unreadable.
int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  in >> size >> resident;
  return in ? resident * int64_t(::sysconf(_SC_PAGESIZE)) : 0;
}

/// Bytes the allocator has handed out and not had back (all glibc arenas): growth here is live
/// memory (a leak or a growing structure); RSS growth without it is fragmentation or caching.
int64_t heap_in_use_bytes() {
  const struct mallinfo2 mi = ::mallinfo2();
  return int64_t(mi.uordblks + mi.hblkhd);
}

/// One memory sample of the server process, written by it to the soak over a pipe.
struct mem_sample {
  double t_s = 0;  ///< seconds since the overload started (set by the soak on receipt)
  int64_t rss = 0, heap = 0;
};

/// The cluster under test in a child process of its own, so the load generator's memory (its
/// threads' stacks, its buffers) is not in the RSS measured. The child serves until the soak
/// closes its command pipe and writes a memory sample every `period_ms` meanwhile.
class server_process {
 public:
  server_process(const cluster_options& co, int period_ms) {
    int up[2], down[2];
    if (::pipe2(up, O_CLOEXEC) != 0 || ::pipe2(down, O_CLOEXEC) != 0)
      throw tandem::error(fmt::format("pipe failed: {}", std::strerror(errno)));
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ < 0) throw tandem::error(fmt::format("fork failed: {}", std::strerror(errno)));
    if (pid_ == 0) {
      ::close(up[0]);
      ::close(down[1]);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::_exit(serve(co, period_ms, down[0], up[1]));
    }
    ::close(up[1]);
    ::close(down[0]);
    from_ = up[0];
    to_ = down[1];
    // The first message is the HTTP port (or 0 and an error text).
    int64_t port = 0;
    if (!read_all(from_, &port, sizeof port) || port <= 0) {
      char why[512] = {};
      if (port == 0) (void)!::read(from_, why, sizeof why - 1);
      reap();
      throw tandem::error(fmt::format("the soak's server process did not start: {}", why[0] ? why : "it exited"));
    }
    port_ = uint16_t(port);
    reader_ = std::thread([this] {
      int64_t m[2];
      while (read_all(from_, m, sizeof m)) {
        std::lock_guard<std::mutex> l(mu_);
        samples_.push_back({since_s(t0_, clock_type::now()), m[0], m[1]});
      }
    });
  }
  ~server_process() { stop(); }
  uint16_t port() const { return port_; }
  /// Restarts the sample clock and drops the samples so far (the overload starts now).
  void mark_start() {
    std::lock_guard<std::mutex> l(mu_);
    t0_ = clock_type::now();
    samples_.clear();
  }
  /// The latest sample (zeros before the first).
  mem_sample latest() const {
    std::lock_guard<std::mutex> l(mu_);
    return samples_.empty() ? mem_sample{} : samples_.back();
  }
  std::vector<mem_sample> samples() const {
    std::lock_guard<std::mutex> l(mu_);
    return samples_;
  }
  /// Closes the command pipe, waits for the child; its exit status (0 = clean shutdown).
  int stop() {
    if (to_ >= 0) ::close(to_), to_ = -1;
    if (reader_.joinable()) reader_.join();
    return reap();
  }

 private:
  static bool read_all(int fd, void* p, size_t n) {
    auto* b = static_cast<char*>(p);
    while (n) {
      const ssize_t r = ::read(fd, b, n);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      b += r, n -= size_t(r);
    }
    return true;
  }
  static bool write_all(int fd, const void* p, size_t n) {
    const auto* b = static_cast<const char*>(p);
    while (n) {
      const ssize_t r = ::write(fd, b, n);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      b += r, n -= size_t(r);
    }
    return true;
  }
  /// The child: the cluster behind its front end, a memory sample every period until `cmd` closes.
  static int serve(const cluster_options& co, int period_ms, int cmd, int out) {
    try {
      bench_cluster c(co);
      const int64_t port = c.port();
      if (!write_all(out, &port, sizeof port)) return 1;
      while (true) {
        const int64_t m[2] = {rss_bytes(), heap_in_use_bytes()};
        if (!write_all(out, m, sizeof m)) return 1;
        pollfd p{cmd, POLLIN, 0};
        const int r = ::poll(&p, 1, period_ms);
        if (r < 0 && errno != EINTR) return 1;
        if (r > 0) break;  // EOF (or anything): the soak is done
      }
      return 0;  // ~bench_cluster stops the actors: a clean shutdown is part of the run
    } catch (const std::exception& e) {
      const int64_t zero = 0;
      write_all(out, &zero, sizeof zero);
      write_all(out, e.what(), std::strlen(e.what()));
      return 1;
    }
  }
  int reap() {
    if (from_ >= 0 && !reader_.joinable()) ::close(from_), from_ = -1;
    if (pid_ <= 0) return status_;
    int st = 0;
    while (::waitpid(pid_, &st, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    return status_;
  }
  pid_t pid_ = -1;
  int from_ = -1, to_ = -1, status_ = 0;
  uint16_t port_ = 0;
  std::thread reader_;
  mutable std::mutex mu_;
  clock_type::time_point t0_ = clock_type::now();
  std::vector<mem_sample> samples_;
};

/// Median of field `f` over the samples in [from_s, to_s] (0 if none).
int64_t median(const std::vector<mem_sample>& v, double from_s, double to_s, int64_t mem_sample::*f) {
  std::vector<double> x;
  for (const auto& s : v)
    if (s.t_s >= from_s && s.t_s <= to_s) x.push_back(double(s.*f));
  return int64_t(percentile(x, 50));
}

/// GET `path` from the server; the body, or throws.
std::string http_get(const options& o, const std::string& path) {
  std::string err;
  const int fd = connect_tcp(o.host, o.port, 10, err);
  if (fd < 0) throw tandem::error(err);
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } c{fd};
  const std::string req = fmt::format("GET {} HTTP/1.1\r\nHost: {}:{}\r\nConnection: close\r\n\r\n", path, o.host, o.port);
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != ssize_t(req.size()))
    throw tandem::error("cannot send GET " + path);
  response_reader rd(fd, clock_type::now() + std::chrono::seconds(10));
  if (!rd.read_head() || rd.status() != 200) throw tandem::error(fmt::format("GET {}: HTTP {}", path, rd.status()));
  std::string body, piece;
  while (rd.next(piece)) body += piece;
  return body;
}

/// Every series of metric `name` in a Prometheus text as (labels, value).
std::vector<std::pair<std::string, double>> series(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  std::string line;
  std::vector<std::pair<std::string, double>> out;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : '\0';
    if (next != ' ' && next != '{') continue;
    const size_t sp = line.rfind(' ');
    out.emplace_back(line.substr(name.size(), sp - name.size()), std::strtod(line.c_str() + sp + 1, nullptr));
  }
  return out;
}
double metric(const std::string& text, const std::string& name) {
  double v = 0;
  for (const auto& s : series(text, name)) v += s.second;
  return v;
}

/// What the client saw, counted as the records arrive (constant memory but the latency lists).
struct tally {
  int64_t arrivals = 0, sent = 0, dropped = 0, answered = 0, completed = 0;
  std::map<int, int64_t> by_status;
  std::map<outcome, int64_t> by_outcome;
  std::vector<double> ttft_ms, reject_ms;
  std::vector<std::string> unanswered;  ///< the first few requests without a final answer, and why
  void add(record&& r) {
    ++arrivals;
    ++by_outcome[r.out];
    if (r.out == outcome::client_dropped) {
      ++dropped;
      return;
    }
    ++sent;
    ++by_status[r.status];
    const bool final_answer =
        r.status != 0 && (r.out == outcome::completed || r.out == outcome::server_error || r.out == outcome::sse_error);
    if (final_answer) ++answered;
    else if (unanswered.size() < 5)
      unanswered.push_back(fmt::format("request {} ({}, HTTP {}): {}", r.index, outcome_name(r.out), r.status, r.error));
    if (r.out == outcome::completed) {
      ++completed;
      if (r.ttft_s >= 0) ttft_ms.push_back(r.ttft_s * 1e3);
    } else if (r.status != 200 && r.status != 0) {
      reject_ms.push_back(r.e2e_s * 1e3);
    }
  }
};

/// One bounded structure: its deepest point against its bound.
struct mark {
  std::string what;
  double high_water = 0, bound = 0;
  bool ok() const { return high_water <= bound; }
};

/// The high-water marks of every mailbox gate and the prefill queues, from the node's /metrics.
std::vector<mark> bound_marks(const std::string& text) {
  std::vector<mark> out;
  std::map<std::string, double> bounds;
  for (const auto& [labels, v] : series(text, "tandem_mailbox_bound")) bounds[labels] = v;
  for (const auto& [labels, v] : series(text, "tandem_mailbox_high_water")) {
    auto b = bounds.find(labels);
    out.push_back({"mailbox" + labels, v, b == bounds.end() ? -1 : b->second});
  }
  out.push_back({"prefill queue (requests)", metric(text, "tandem_prefill_queued_requests_high_water"),
                 metric(text, "tandem_prefill_queued_requests_bound")});
  out.push_back({"prefill queue (tokens)", metric(text, "tandem_prefill_queued_tokens_high_water"),
                 metric(text, "tandem_prefill_queued_tokens_bound")});
  return out;
}

}  // namespace

int bench_soak(args a) {
  flags f;
  f.opt("model", "GGUF model file (required; tandem make-model writes a small one)")
      .opt("threads", "kernel threads of the worker", "1")
      .opt("max-running-seqs", "decode batch size", "8")
      .opt("prompt-tokens", "prompt length in words (~tokens)", "64")
      .opt("max-tokens", "output tokens per request", "16")
      .opt("capacity-s", "closed-loop capacity measurement (seconds)", "4")
      .opt("overload", "offered load as a multiple of the measured capacity", "3")
      .opt("duration-s", "length of the overload (seconds)", "60")
      .opt("warmup-s", "the RSS baseline is taken this long into the overload (allocator and caches warm)", "10")
      .opt("arrivals", "poisson | bursty (bursts of rate x --burst-every-s requests)", "poisson")
      .opt("burst-every-s", "seconds between bursts with --arrivals bursty", "1")
      .opt("max-rss-growth-pct", "goal: RSS growth from the warm-up to the end of the run, percent", "5")
      .opt("kv-cache-mb", "limits.kv_cache_mb of the cluster (small: the pool is a fixed part of the RSS baseline)", "64")
      .opt("max-queue-wait-ms", "limits.max_queue_wait_ms of the cluster (0 = off, the default limit)", "0")
      .opt("max-inflight", "client threads (an arrival finding all busy is dropped and fails the run)", "512")
      .opt("timeout-s", "client-side timeout of one request", "120")
      .opt("seed", "seed of arrivals and prompts", "1")
      .opt("json", "write the results to this file");
  if (!parse_bench_flags(f, a, "soak --model FILE [options]")) return 0;
  const std::string model = bench_model_path(f);
  const double cap_s = f.real("capacity-s"), duration_s = f.real("duration-s"), warmup_s = f.real("warmup-s");
  const double overload = f.real("overload"), every_s = f.real("burst-every-s"), max_growth = f.real("max-rss-growth-pct");
  if (!(cap_s > 0) || !(duration_s > 0)) throw tandem::error("--capacity-s and --duration-s must be > 0 seconds");
  // The baseline is the median of the 2 s before the warm-up's end, the end value the median
  // of the run's last 2 s: the two windows must not overlap.
  if (!(warmup_s >= 2) || !(warmup_s + 2 <= duration_s - 2))
    throw tandem::error("--warmup-s must be >= 2 and leave >= 4 s of --duration-s after it");
  if (!(overload > 0)) throw tandem::error("--overload must be > 0 (e.g. 3)");
  if (!(every_s > 0)) throw tandem::error("--burst-every-s must be > 0");
  if (!(max_growth >= 0)) throw tandem::error("--max-rss-growth-pct must be >= 0");
  const std::string arrivals = f.str("arrivals");
  if (arrivals != "poisson" && arrivals != "bursty") throw tandem::error("--arrivals must be poisson or bursty");
  const int64_t threads = f.num("threads"), running = f.num("max-running-seqs"), inflight = f.num("max-inflight");
  if (threads < 1 || threads > 1024) throw tandem::error("--threads must be in [1, 1024]");
  if (running < 1 || running > 4096) throw tandem::error("--max-running-seqs must be in [1, 4096]");
  if (inflight < 1 || inflight > 8192) throw tandem::error("--max-inflight must be in [1, 8192]");
  const int64_t queue_wait_ms = f.num("max-queue-wait-ms");
  if (queue_wait_ms < 0 || queue_wait_ms > INT32_MAX) throw tandem::error("--max-queue-wait-ms must be >= 0");
  options o;
  o.prompt_min = o.prompt_max = f.num("prompt-tokens");
  o.max_tokens = f.num("max-tokens");
  o.timeout_s = f.real("timeout-s");
  o.seed = uint32_t(f.num("seed"));
  o.max_inflight = inflight;
  if (o.prompt_min < 1 || o.max_tokens < 1 || !(o.timeout_s > 0))
    throw tandem::error("--prompt-tokens and --max-tokens must be >= 1, --timeout-s > 0");
  std::signal(SIGPIPE, SIG_IGN);

  cluster_options co;
  co.model_path = model;
  co.log_level = "error";
  co.lim.threads = int32_t(threads);
  co.lim.max_running_seqs = int32_t(running);
  co.lim.max_queue_wait_ms = int32_t(queue_wait_ms);
  const int64_t kv_mb = f.num("kv-cache-mb");
  if (kv_mb < 1 || kv_mb > INT32_MAX) throw tandem::error("--kv-cache-mb must be >= 1");
  co.lim.kv_cache_mb = int32_t(kv_mb);
  if (auto e = co.lim.validate(); !e.empty()) throw tandem::error(e);
  server_process server(co, 250);
  o.port = server.port();
  {
    options w = o;
    prompt_maker pm(w);
    record r;
    run_request(w, pm.next(0).first, clock_type::now(), r);
    if (r.out != outcome::completed)
      throw tandem::error(fmt::format("warm-up request did not complete ({}, HTTP {}): {}", outcome_name(r.out), r.status,
                                      r.error));
  }
  double capacity = 0;
  {
    // Capacity: closed loop at the decode batch size, completed requests per second.
    options cl = o;
    cl.concurrency = running;
    cl.duration_s = cap_s;
    prompt_maker pm(cl);
    double wall = 0;
    auto s = summarize(run_load(cl, pm, wall), wall, 0, 0);
    const int64_t done = s.by_outcome.count(outcome::completed) ? s.by_outcome.at(outcome::completed) : 0;
    capacity = double(done) / s.active_s;
    if (!(capacity > 0)) throw tandem::error("capacity measurement completed no request; raise --capacity-s");
  }
  const double rate = overload * capacity;
  std::printf("tandem bench soak: %s, prompts %lld words, %lld output tokens, decode batch %lld\n", model.c_str(),
              (long long)o.prompt_min, (long long)o.max_tokens, (long long)running);
  std::printf("capacity (closed loop, %lld streams, %.1f s): %.2f req/s; offering %.2fx = %.2f req/s (%s) for %.0f s\n",
              (long long)running, cap_s, capacity, overload, rate, arrivals.c_str(), duration_s);
  std::fflush(stdout);

  // The overload. Records go to the tally as they finish; the RSS is sampled 4x a second.
  tally t;
  options ol = o;
  ol.duration_s = duration_s;
  if (arrivals == "poisson") {
    ol.rate = rate;
  } else {
    ol.burst = std::max<int64_t>(1, int64_t(std::llround(rate * every_s)));
    ol.burst_every_s = every_s;
  }
  t.ttft_ms.reserve(size_t(rate * duration_s * 1.2) + 16);
  t.reject_ms.reserve(size_t(rate * duration_s * 1.2) + 16);
  ol.sink = [&t](record&& r) { t.add(std::move(r)); };
  prompt_maker pm(ol);
  double wall = 0;
  server.mark_start();
  const mem_sample at_start = [&] {
    // The first sample after the mark (at most one period away).
    for (int i = 0; i < 200; ++i) {
      if (auto m = server.latest(); m.rss > 0) return m;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return mem_sample{};
  }();
  run_load(ol, pm, wall);  // returns when every request has its answer (or timed out)
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // one more sample, drained
  const std::string metrics_text = http_get(o, "/metrics");
  const std::vector<mem_sample> samples = server.samples();
  const mem_sample drained = server.latest();
  const int64_t rss_start = at_start.rss, heap_start = at_start.heap;
  const int64_t rss_drained = drained.rss, heap_drained = drained.heap;
  const int64_t rss_base = median(samples, warmup_s - 2, warmup_s, &mem_sample::rss);
  const int64_t rss_end = median(samples, duration_s - 2, duration_s, &mem_sample::rss);
  int64_t rss_peak = 0;
  for (const auto& m : samples) rss_peak = std::max(rss_peak, m.rss);
  const double growth_pct = rss_base > 0 ? 100.0 * double(rss_end - rss_base) / double(rss_base) : 0;
  const int64_t heap_base = median(samples, warmup_s - 2, warmup_s, &mem_sample::heap);
  const int64_t heap_end = median(samples, duration_s - 2, duration_s, &mem_sample::heap);
  const int server_exit = server.stop();
  const auto marks = bound_marks(metrics_text);

  auto mib = [](int64_t b) { return double(b) / (1024.0 * 1024.0); };
  std::printf("load: %.1f s (drained), %lld arrivals, %lld sent, %lld answered, %lld completed (%.2f req/s), %lld "
              "dropped by the client\n",
              wall, (long long)t.arrivals, (long long)t.sent, (long long)t.answered, (long long)t.completed,
              double(t.completed) / wall, (long long)t.dropped);
  std::string statuses;
  for (const auto& [st, n] : t.by_status) statuses += fmt::format("{}{}: {}", statuses.empty() ? "" : ", ", st, n);
  std::printf("answers by HTTP status: %s\n", statuses.c_str());
  std::string reasons;
  for (const auto& [labels, v] : series(metrics_text, "tandem_rejections_total"))
    if (v != 0) reasons += fmt::format("{}{} {:.0f}", reasons.empty() ? "" : ", ", labels, v);
  std::printf("refusals by reason: [%s]\n", reasons.c_str());
  std::printf("admitted TTFT p50 %.1f ms, p99 %.1f ms; refusal latency p50 %.2f ms, p99 %.2f ms\n",
              percentile(t.ttft_ms, 50), percentile(t.ttft_ms, 99), percentile(t.reject_ms, 50),
              percentile(t.reject_ms, 99));
  std::printf("RSS: %.1f MiB at the start, %.1f MiB after the %.0f s warm-up (baseline), %.1f MiB at the end, peak "
              "%.1f MiB, %.1f MiB drained (%zu samples): growth %+.2f%%\n",
              mib(rss_start), mib(rss_base), warmup_s, mib(rss_end), mib(rss_peak), mib(rss_drained), samples.size(),
              growth_pct);
  std::printf("heap in use (malloc): %.1f MiB at the start, %.1f MiB after the warm-up, %.1f MiB at the end, %.1f MiB "
              "drained (%+.2f MiB from the start)\n",
              mib(heap_start), mib(heap_base), mib(heap_end), mib(heap_drained), mib(heap_drained - heap_start));
  bool bounds_ok = true;
  for (const auto& m : marks) {
    bounds_ok = bounds_ok && m.ok();
    std::printf("%-36s deepest %8.0f of bound %10.0f%s\n", m.what.c_str(), m.high_water, m.bound, m.ok() ? "" : "  EXCEEDED");
  }
  for (const auto& u : t.unanswered) std::printf("without a final answer: %s\n", u.c_str());
  const bool rss_ok = growth_pct < max_growth;
  const bool answers_ok = t.answered == t.sent && t.dropped == 0;
  const bool exit_ok = server_exit == 0;
  std::printf("goal: RSS growth < %.1f%%: %+.2f%% %s; every bound held: %s; answered == sent: %lld of %lld%s %s\n",
              max_growth, growth_pct, rss_ok ? "met" : "MISSED", bounds_ok ? "met" : "MISSED", (long long)t.answered,
              (long long)t.sent,
              t.dropped ? fmt::format(" ({} arrivals dropped by the client: raise --max-inflight)", t.dropped).c_str() : "",
              answers_ok ? "met" : "MISSED");
  std::printf("server process shut down cleanly: %s (exit status %d)\n", exit_ok ? "yes" : "NO", server_exit);

  if (f.has("json")) {
    json::writer w;
    w.begin_object().key("model").str(model).key("prompt_tokens").num(o.prompt_min).key("max_tokens").num(o.max_tokens);
    w.key("max_running_seqs").num(running).key("capacity_rps").real(capacity).key("overload").real(overload);
    w.key("rate_rps").real(rate).key("arrivals").str(arrivals).key("duration_s").real(duration_s);
    w.key("wall_s").real(wall).key("arrivals_n").num(t.arrivals).key("sent").num(t.sent);
    w.key("answered").num(t.answered).key("completed").num(t.completed).key("client_dropped").num(t.dropped);
    w.key("status").begin_object();
    for (const auto& [st, n] : t.by_status) w.key(std::to_string(st)).num(n);
    w.end_object();
    write_pcts(w, "ttft_ms", t.ttft_ms);
    write_pcts(w, "rejection_ms", t.reject_ms);
    w.key("rss").begin_object().key("start_bytes").num(rss_start).key("baseline_bytes").num(rss_base);
    w.key("end_bytes").num(rss_end).key("peak_bytes").num(rss_peak).key("drained_bytes").num(rss_drained);
    w.key("warmup_s").real(warmup_s).key("growth_pct").real(growth_pct);
    w.key("heap_start_bytes").num(heap_start).key("heap_baseline_bytes").num(heap_base);
    w.key("heap_end_bytes").num(heap_end).key("heap_drained_bytes").num(heap_drained);
    w.key("samples").begin_array();  // [seconds into the overload, RSS bytes, heap bytes in use]
    for (const auto& m : samples) w.begin_array().real(m.t_s).num(m.rss).num(m.heap).end_array();
    w.end_array().end_object();
    w.key("bounds").begin_array();
    for (const auto& m : marks)
      w.begin_object().key("what").str(m.what).key("high_water").real(m.high_water).key("bound").real(m.bound).end_object();
    w.end_array();
    w.key("goal").begin_object().key("rss_growth_pct").real(growth_pct).key("rss_growth_pct_max").real(max_growth);
    w.key("rss_met").boolean(rss_ok).key("bounds_met").boolean(bounds_ok).key("answers_met").boolean(answers_ok);
    w.key("server_exit_status").num(server_exit);
    w.end_object().end_object();
    std::ofstream out(f.str("json"));
    out << w.text() << "\n";
    if (!out) throw tandem::error("cannot write --json " + f.str("json"));
  }
  return rss_ok && bounds_ok && answers_ok && exit_ok ? 0 : 1;
}

}  // namespace tandem::cli
