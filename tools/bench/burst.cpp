// tandem bench burst: the overload incident, reproduced side by side in one run. On the same
// model and machine it starts (a) an embedded cluster with unbounded queues and (b) one with
// Tandem's bounds (the default limits plus a queue-wait bound), each behind its own HTTP
// front end, measures capacity (closed loop), then runs on each a Poisson load at 0.8x
// capacity and a 3x capacity burst, and on the bounded one the 0.8x load again after the
// burst. The bounded cluster's queue-wait bound comes from its own first 0.8x run, as an
// operator sets it from the normal-load TTFT of the cluster they run. It prints the p99 TTFT
// of the admitted requests of the burst against the same cluster's p99 at 0.8x (goal with
// bounds: <= 1.5x), the rejection latency (goal < 50 ms), the deepest prefill queue seen
// against its bound (from the node's metrics), the refusals at 0.8x load with every bound in
// place and the requests that got no final answer (must be 0).
#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "kernels/base/error.h"
#include "actors/runtime/embedded_cluster.h"
#include "tools/bench/cluster.h"
#include "tools/bench/load.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"
#include "transport/http/json.h"
#include "transport/rpc/front_end.h"

namespace tandem::cli {

namespace {

using namespace load;

/// Goal: the bounded cluster refuses at most this share (%) of the 0.8x-load requests.
constexpr double kMaxLoadRefusedPct = 1.0;

using served_cluster = bench_cluster;

/// One load phase against one cluster.
struct phase {
  std::string name;
  double rate = 0;
  summary s;
  int64_t without_answer = 0;  ///< sent, but no status and [DONE] nor error answer (timeouts, broken streams)
  int64_t st504 = 0;
  std::vector<record> recs;
};

/// The prompts and arrivals of one kind of phase: the same for both clusters (a side-by-side
/// comparison), different between phases. With one seed for all phases every phase replayed
/// the capacity run's prompts, so the unbounded cluster's 0.8x load was served from its
/// prefix cache (p50 TTFT 5-8 ms against 25-55 ms for the bounded cluster, which had not seen
/// them): its p99 set a wait bound the bounded cluster's real prefills could not meet, and the
/// bounded cluster refused up to 17% at 0.8x load.
enum class phase_kind : uint32_t { warm = 0, capacity = 1, load = 2, burst = 3, after = 4 };
uint32_t phase_seed(uint32_t seed, phase_kind k) { return seed * 8u + uint32_t(k); }

phase run_phase(const std::string& name, options o, double rate, double duration_s, phase_kind kind) {
  phase p;
  o.seed = phase_seed(o.seed, kind);
  p.name = name;
  p.rate = rate;
  o.rate = rate;
  o.burst = 0;
  o.concurrency = 0;
  o.requests = 0;
  o.duration_s = duration_s;
  prompt_maker prompts(o);
  double wall = 0;
  auto recs = run_load(o, prompts, wall);
  p.s = summarize(recs, wall, 0, 0);
  for (const auto& r : recs) {
    if (r.status == 504) ++p.st504;
    if (r.out == outcome::timeout || r.out == outcome::client_error) ++p.without_answer;
  }
  p.recs = std::move(recs);
  return p;
}

void write_phase(json::writer& w, const phase& p) {
  w.key(p.name).begin_object();
  w.key("rate").real(p.rate).key("sent").num(p.s.sent);
  const int64_t completed = p.s.by_outcome.count(outcome::completed) ? p.s.by_outcome.at(outcome::completed) : 0;
  w.key("completed").num(completed);
  w.key("rejected").num(int64_t(p.s.reject.size()));
  w.key("status").begin_object().key("200").num(p.s.st200).key("503").num(p.s.st503).key("429").num(p.s.st429);
  w.key("504").num(p.st504).end_object();
  write_pcts(w, "ttft_ms", p.s.ttft);
  write_pcts(w, "first_text_ms", p.s.first_text);
  write_pcts(w, "rejection_ms", p.s.reject);
  w.key("without_final_answer").num(p.without_answer);
  // Per request, for plots and for finding where a tail came from: arrival (s), HTTP status,
  // first token, first visible text and end (ms from sent; -1 = none).
  w.key("records").begin_array();
  for (const auto& r : p.recs) {
    w.begin_array().real(r.arrival_s).num(r.status).real(ms_or_none(r.ttft_s));
    w.real(ms_or_none(r.first_text_s)).real(ms_or_none(r.e2e_s)).end_array();
  }
  w.end_array();
  w.end_object();
}

}  // namespace

int bench_burst(args a) {
  flags f;
  f.opt("model", "GGUF model file (required; tandem make-model writes a small one)")
      .opt("threads", "kernel threads of each cluster's worker", "1")
      .opt("max-running-seqs", "decode batch size of both clusters", "8")
      .opt("prefill-chunk-tokens", "prompt tokens per prefill step of both clusters (0 = limits' default)", "0")
      .opt("prefill-pause-decode-waiting-seqs",
           "both clusters' limits.prefill_pause_decode_waiting_seqs (0 = the decode batch size, -1 = never pause)", "0")
      .opt("prompt-tokens", "prompt length in words (~tokens)", "64")
      .opt("max-tokens", "output tokens per request", "16")
      .opt("capacity-s", "closed-loop capacity measurement (seconds)", "4")
      .opt("load-s", "the 0.8x capacity Poisson run (seconds)", "6")
      .opt("burst-s", "the 3x capacity burst (seconds)", "4")
      .opt("max-queue-wait-ms",
           "queue-wait bound of the bounded cluster (0 = --queue-wait-p99-factor x its own p99 TTFT at 0.8x, "
           "measured first)",
           "0")
      .opt("queue-wait-p99-factor", "the bounded cluster's max_queue_wait_ms over its own 0.8x p99 TTFT", "1")
      .opt("timeout-s", "client-side timeout of one request", "60")
      .opt("seed", "seed of arrivals and prompts", "1")
      .opt("json", "write the results to this file");
  if (!parse_bench_flags(f, a, "burst --model FILE [options]")) return 0;
  const std::string model = bench_model_path(f);
  const double cap_s = f.real("capacity-s"), load_s = f.real("load-s"), burst_s = f.real("burst-s");
  if (!(cap_s > 0) || !(load_s > 0) || !(burst_s > 0))
    throw tandem::error("--capacity-s, --load-s and --burst-s must be > 0 seconds");
  const int64_t threads = f.num("threads"), running = f.num("max-running-seqs");
  if (threads < 1 || threads > 1024) throw tandem::error("--threads must be in [1, 1024]");
  if (running < 1 || running > 4096) throw tandem::error("--max-running-seqs must be in [1, 4096]");
  const int64_t chunk = f.num("prefill-chunk-tokens");
  if (chunk < 0 || chunk > (1 << 20)) throw tandem::error("--prefill-chunk-tokens must be in [0, 1048576]");
  const int64_t pause_at = f.num("prefill-pause-decode-waiting-seqs");
  if (pause_at < -1 || pause_at > (1 << 20))
    throw tandem::error("--prefill-pause-decode-waiting-seqs must be in [-1, 1048576] (-1 = never pause)");
  options o;
  o.prompt_min = o.prompt_max = f.num("prompt-tokens");
  o.max_tokens = f.num("max-tokens");
  o.timeout_s = f.real("timeout-s");
  o.seed = uint32_t(f.num("seed"));
  o.max_inflight = 2048;  // the client never drops an arrival: overload must reach the server
  if (o.prompt_min < 1 || o.max_tokens < 1 || !(o.timeout_s > 0))
    throw tandem::error("--prompt-tokens and --max-tokens must be >= 1, --timeout-s > 0");
  int64_t queue_wait_ms = f.num("max-queue-wait-ms");
  if (queue_wait_ms < 0 || queue_wait_ms > INT32_MAX) throw tandem::error("--max-queue-wait-ms must be >= 0");
  const double wait_factor = f.real("queue-wait-p99-factor");
  if (!(wait_factor > 0) || wait_factor > 100) throw tandem::error("--queue-wait-p99-factor must be in (0, 100]");
  std::signal(SIGPIPE, SIG_IGN);

  cluster_options base;
  base.model_path = model;
  base.log_level = "error";
  base.lim.threads = int32_t(threads);
  base.lim.max_running_seqs = int32_t(running);
  if (chunk > 0) base.lim.prefill_chunk_tokens = int32_t(chunk);
  base.lim.prefill_pause_decode_waiting_seqs = int32_t(pause_at);
  // (a) Unbounded: every admission bound out of the way (the incident's configuration).
  cluster_options unbounded = base;
  unbounded.lim.max_queued_requests = std::numeric_limits<int32_t>::max() / 2;
  unbounded.lim.max_queued_tokens = std::numeric_limits<int64_t>::max() / 4;
  unbounded.lim.max_inflight_requests = std::numeric_limits<int32_t>::max() / 2;
  unbounded.lim.router_mailbox = unbounded.lim.prefill_mailbox = unbounded.lim.decode_mailbox = 1 << 20;
  unbounded.lim.router_max_retries = 0;
  unbounded.lim.decode_page_admission = false;
  unbounded.lim.max_decode_waiting_seqs = -1;

  auto warm = [&](uint16_t port) {
    options w = o;
    w.port = port;
    w.seed = phase_seed(o.seed, phase_kind::warm);
    prompt_maker pm(w);
    record r;
    run_request(w, pm.next(0).first, clock_type::now(), r);
    if (r.out != outcome::completed)
      throw tandem::error(fmt::format("warm-up request did not complete ({}, HTTP {}): {}", outcome_name(r.out), r.status,
                                      r.error));
  };

  struct result {
    std::string name;
    phase load, burst;
    phase after;  ///< the bounded cluster's 0.8x load after the burst, with every bound in place
    double q_hw_requests = 0, q_bound_requests = 0, q_hw_tokens = 0, q_bound_tokens = 0, queue_wait_ms = 0;
    double ratio() const { return ratio_of(&summary::ttft); }
    /// The same ratio for the first visible text (a token whose text the stream holds back
    /// shows with the next one, so this one also includes a decode step).
    double text_ratio() const { return ratio_of(&summary::first_text); }
    double ratio_of(std::vector<double> summary::*v) const {
      const double base = percentile(load.s.*v, 99);
      return base > 0 ? percentile(burst.s.*v, 99) / base : 0;
    }
  };
  std::vector<result> results(2);
  results[0].name = "unbounded";
  results[1].name = "bounded";
  double capacity = 0;
  auto queue_marks = [](result& r, const served_cluster& c) {
    r.q_hw_requests = c.metric("tandem_prefill_queued_requests_high_water");
    r.q_bound_requests = c.metric("tandem_prefill_queued_requests_bound");
    r.q_hw_tokens = c.metric("tandem_prefill_queued_tokens_high_water");
    r.q_bound_tokens = c.metric("tandem_prefill_queued_tokens_bound");
  };
  // The phases alternate between the clusters (U 0.8x, B 0.8x, U 3x, B 3x) so a change in the
  // machine's background load affects both alike. run_load returns when every request has
  // its answer, so a cluster's backlog is drained before the next phase starts.
  served_cluster cu(unbounded);
  o.port = cu.port();
  warm(cu.port());
  // Capacity: closed loop at the decode batch size, completed requests per second.
  auto closed_loop = [&](uint16_t port) {
    options cl = o;
    cl.port = port;
    cl.concurrency = running;
    cl.requests = 0;
    cl.duration_s = cap_s;
    cl.seed = phase_seed(o.seed, phase_kind::capacity);
    prompt_maker pm(cl);
    double wall = 0;
    auto recs = run_load(cl, pm, wall);
    auto s = summarize(recs, wall, 0, 0);
    const int64_t done = s.by_outcome.count(outcome::completed) ? s.by_outcome.at(outcome::completed) : 0;
    const double c = s.active_s > 0 ? double(done) / s.active_s : 0;
    if (!(c > 0)) throw tandem::error("capacity measurement completed no request; raise --capacity-s");
    return c;
  };
  capacity = closed_loop(cu.port());
  std::printf("tandem bench burst: %s, prompts %lld words, %lld output tokens, decode batch %lld, prefill steps of "
              "%d tokens, prefill pauses at %s decode sequences waiting\n",
              model.c_str(), (long long)o.prompt_min, (long long)o.max_tokens, (long long)running,
              base.lim.prefill_chunk_tokens,
              pause_at < 0 ? "never (-1)" : pause_at == 0 ? "a batch of" : std::to_string(pause_at).c_str());
  std::printf("capacity (closed loop, %lld streams, %.1f s): %.2f req/s\n", (long long)running, cap_s, capacity);
  results[0].load = run_phase("load_0_8x", o, 0.8 * capacity, load_s, phase_kind::load);
  const bool calibrate = queue_wait_ms == 0;
  cluster_options bounded = base;                          // Tandem's default bounds ...
  bounded.lim.max_queue_wait_ms = int32_t(queue_wait_ms);  // ... plus the queue-wait bound (0: set below)
  served_cluster cb(bounded);
  options ob = o;
  ob.port = cb.port();
  warm(cb.port());
  // The same closed loop on the bounded cluster before its 0.8x run, as the unbounded one had:
  // with one warm-up request only, its 0.8x run (the bound's calibration) was its first real
  // traffic (KV pages touched for the first time) and read a p99 ~1.5x that of the same load
  // after the burst. Its rate says whether the machine's pace moved since the first one.
  const double capacity_b = closed_loop(cb.port());
  std::printf("bounded cluster, the same closed loop as its warm-up: %.2f req/s (%.2fx the unbounded cluster's)\n",
              capacity_b, capacity_b / capacity);
  results[1].load = run_phase("load_0_8x", ob, 0.8 * capacity, load_s, phase_kind::load);
  const std::string load_refusals = cb.nonzero("tandem_rejections_total");
  const double load_drain = cb.metric("tandem_prefill_drain_tokens_per_s");
  if (calibrate) {
    // The operator's choice made from the SLO: a request may wait (by the router's estimate,
    // which counts its own prefill) as long as the normal-load p99 TTFT of the cluster it runs
    // on, measured on that cluster (the bound is off in that run, so it cannot shape the tail
    // it is taken from) and set live. Taken from the unbounded cluster's run a minute earlier
    // instead, the bound followed the machine's pace then, not now: across 35 runs that p99
    // was 0.60-2.13x the bounded cluster's own, and every run at >= 1.1x missed the TTFT goal.
    // The goal's 1.5x is the room for the estimate's error: admitted p99 TTFT came out at
    // 1.15-1.59x the bound (a step's granularity, the HTTP hop, a decode backlog's pause), so
    // a factor of 1.25 missed in 2 of 3 runs where 1.0 met in 3 of 3 (tiny-15m, seeds 1-3).
    queue_wait_ms = std::max<int64_t>(1, int64_t(wait_factor * percentile(results[1].load.s.ttft, 99)));
    cb.cluster().set_max_queue_wait_ms(int32_t(std::min<int64_t>(queue_wait_ms, INT32_MAX)));
  }
  results[1].queue_wait_ms = double(queue_wait_ms);
  // What the router admits by now, from its metrics (the bound the burst runs under).
  const double bound_in_force = cb.metric("tandem_queue_wait_bound_ms");
  results[0].burst = run_phase("burst_3x", o, 3.0 * capacity, burst_s, phase_kind::burst);
  const char* const stages[] = {"tandem_ttft_ms", "tandem_prefill_queue_wait_ms", "tandem_prefill_compute_ms"};
  std::vector<served_cluster::hist> before;
  for (const char* h : stages) before.push_back(cb.histogram(h));
  results[1].burst = run_phase("burst_3x", ob, 3.0 * capacity, burst_s, phase_kind::burst);
  // Normal load again, every bound in place: what it refuses is what the bounds cost when
  // nothing is wrong, and its TTFT shows the cluster is back to normal after the burst.
  const double before_after = cb.metric("tandem_rejections_total");
  results[1].after = run_phase("load_0_8x_after_burst", ob, 0.8 * capacity, load_s, phase_kind::after);
  const double after_refusals_server = cb.metric("tandem_rejections_total") - before_after;
  {
    // Where the bounded cluster's admitted TTFT went in the burst (server side, bucket bounds).
    std::string parts;
    for (size_t i = 0; i < std::size(stages); ++i) {
      const auto h = cb.histogram(stages[i]);
      const double p99 = h.quantile_since(before[i], 0.99);
      parts += fmt::format("{}{} mean {:.1f} ms, p99 {}", parts.empty() ? "" : "; ", stages[i] + 7, h.mean_since(before[i]),
                           p99 < 0 ? std::string("> the last bucket") : fmt::format("<= {:.0f} ms", p99));
    }
    std::printf("bounded burst, server side: %s\n", parts.c_str());
  }
  queue_marks(results[0], cu);
  queue_marks(results[1], cb);
  std::printf("bounded, after its first 0.8x load (wait bound off): refusals [%s], prefill drain rate %.0f tokens/s\n",
              load_refusals.c_str(), load_drain);
  std::printf("prefill steps held for the decode backlog on the shared worker: unbounded %.0f times, %.0f ms; "
              "bounded %.0f times, %.0f ms\n",
              cu.metric("tandem_prefill_decode_pauses_total"), cu.metric("tandem_prefill_decode_paused_ms_total"),
              cb.metric("tandem_prefill_decode_pauses_total"), cb.metric("tandem_prefill_decode_paused_ms_total"));
  std::printf("refusals by reason: unbounded [%s]; bounded [%s]\n", cu.nonzero("tandem_rejections_total").c_str(),
              cb.nonzero("tandem_rejections_total").c_str());

  std::printf("%-10s %-10s %8s %8s %8s %10s %10s %10s %10s %12s\n", "cluster", "phase", "rate", "sent", "200",
              "rejected", "ttft p50", "ttft p99", "rej p50", "rej p99 (ms)");
  for (const auto& r : results)
    for (const phase* p : {&r.load, &r.burst, &r.after})
      if (!p->name.empty())
        std::printf("%-10s %-10s %8.2f %8lld %8lld %10zu %10.1f %10.1f %10.2f %12.2f\n", r.name.c_str(),
                    p->name.c_str(), p->rate, (long long)p->s.sent, (long long)p->s.st200, p->s.reject.size(),
                    percentile(p->s.ttft, 50), percentile(p->s.ttft, 99), percentile(p->s.reject, 50),
                    percentile(p->s.reject, 99));
  int64_t without = 0;
  for (const auto& r : results) {
    without += r.load.without_answer + r.burst.without_answer + r.after.without_answer;
    std::printf("%-10s burst admitted p99 TTFT %.1f ms = %.2fx its 0.8x-load p99 %.1f ms; queue high water %.0f "
                "requests (bound %.0f), %.0f tokens (bound %.0f)%s\n",
                r.name.c_str(), percentile(r.burst.s.ttft, 99), r.ratio(), percentile(r.load.s.ttft, 99),
                r.q_hw_requests, r.q_bound_requests, r.q_hw_tokens, r.q_bound_tokens,
                r.queue_wait_ms > 0 ? fmt::format("; max_queue_wait_ms {:.0f}", r.queue_wait_ms).c_str() : "");
    std::printf("%-10s first visible text p99: burst %.1f ms = %.2fx its 0.8x-load p99 %.1f ms\n", r.name.c_str(),
                percentile(r.burst.s.first_text, 99), r.text_ratio(), percentile(r.load.s.first_text, 99));
  }
  const auto& b = results[1];
  const double rej_p99 = percentile(b.burst.s.reject, 99);
  const bool ttft_ok = b.ratio() > 0 && b.ratio() <= 1.5;
  const bool rej_ok = b.burst.s.reject.empty() || rej_p99 < 50;
  const bool queue_ok = b.q_hw_requests <= b.q_bound_requests && b.q_hw_tokens <= b.q_bound_tokens;
  // Bounds that refuse at normal load trade an incident for a permanent outage of 1 in N:
  // judged on the 0.8x run after the burst, the first one with every bound in place. A bound
  // at the normal-load p99 that is within about two prefill steps (tiny-15m: p99 58-114 ms
  // against ~50 ms steps) refuses a few percent of a Poisson load's clumps here: the TTFT
  // goal's margin and this one pull apart, and the line shows which one a run gave up.
  const phase& normal = b.after;
  const double load_refused_pct =
      normal.s.sent > 0 ? 100.0 * double(normal.s.reject.size()) / double(normal.s.sent) : 0;
  const bool load_ok = load_refused_pct <= kMaxLoadRefusedPct;
  std::printf("goal: bounded admitted p99 TTFT <= 1.5x: %.2fx %s; rejections < 50 ms: p99 %.2f ms %s; queue within its "
              "bound: %s; requests without a final answer: %lld %s\n",
              b.ratio(), ttft_ok ? "met" : "MISSED", rej_p99, rej_ok ? "met" : "MISSED", queue_ok ? "yes" : "NO",
              (long long)without, without == 0 ? "met" : "MISSED");
  std::printf("goal: bounded refusals at 0.8x load after the burst (every bound in place) <= %.0f%%: %.2f%% (%zu of "
              "%lld; %.0f counted by the node) %s\n",
              kMaxLoadRefusedPct, load_refused_pct, normal.s.reject.size(), (long long)normal.s.sent,
              after_refusals_server, load_ok ? "met" : "MISSED");
  // Where the bound came from, and how far the two clusters' normal-load tails lie apart (the
  // unbounded one's was the old calibration source: far from 1 = the machine's pace moved).
  const double u_load_p99 = percentile(results[0].load.s.ttft, 99), b_load_p99 = percentile(b.load.s.ttft, 99);
  const double calib = b_load_p99 > 0 ? u_load_p99 / b_load_p99 : 0;
  std::printf("calibration: max_queue_wait_ms %.0f %s; in force in the router for the burst: %.0f ms; the "
              "unbounded cluster's 0.8x p99 %.1f ms (unbounded/bounded %.2f)\n",
              b.queue_wait_ms,
              calibrate ? fmt::format("= {:.2f}x the bounded cluster's own 0.8x p99 {:.1f} ms (wait bound off in "
                                      "that run), set live",
                                      wait_factor, b_load_p99)
                              .c_str()
                        : "from --max-queue-wait-ms",
              bound_in_force, u_load_p99, calib);
  std::printf("bounded 0.8x load: before the burst p99 TTFT %.1f ms, %zu refused (wait bound off); after it p99 "
              "%.1f ms, %zu refused\n",
              b_load_p99, b.load.s.reject.size(), percentile(normal.s.ttft, 99), normal.s.reject.size());

  if (f.has("json")) {
    json::writer w;
    w.begin_object().key("model").str(model).key("prompt_tokens").num(o.prompt_min).key("max_tokens").num(o.max_tokens);
    w.key("max_running_seqs").num(running).key("prefill_chunk_tokens").num(base.lim.prefill_chunk_tokens);
    w.key("prefill_pause_decode_waiting_seqs").num(pause_at);
    w.key("capacity_rps").real(capacity).key("capacity_bounded_rps").real(capacity_b);
    w.key("clusters").begin_object();
    for (const auto& r : results) {
      w.key(r.name).begin_object();
      write_phase(w, r.load);
      write_phase(w, r.burst);
      if (!r.after.name.empty()) write_phase(w, r.after);
      w.key("ttft_p99_ratio").real(r.ratio()).key("first_text_p99_ratio").real(r.text_ratio());
      w.key("max_queue_wait_ms").real(r.queue_wait_ms);
      w.key("queue_high_water_requests").real(r.q_hw_requests).key("queue_bound_requests").real(r.q_bound_requests);
      w.key("queue_high_water_tokens").real(r.q_hw_tokens).key("queue_bound_tokens").real(r.q_bound_tokens);
      w.end_object();
    }
    w.end_object();
    w.key("calibration_p99_ratio").real(calib);
    w.key("queue_wait_bound_source").str(calibrate ? "bounded_load_0_8x_p99" : "flag");
    w.key("queue_wait_p99_factor").real(calibrate ? wait_factor : 0);
    w.key("queue_wait_bound_in_force_ms").real(bound_in_force);
    w.key("goal").begin_object().key("ttft_ratio").real(b.ratio()).key("ttft_ratio_max").real(1.5);
    w.key("ttft_met").boolean(ttft_ok).key("rejection_p99_ms").real(rej_p99).key("rejection_p99_ms_max").real(50);
    w.key("rejection_met").boolean(rej_ok).key("queue_within_bound").boolean(queue_ok);
    w.key("without_final_answer").num(without);
    w.key("load_refused_pct").real(load_refused_pct).key("load_refused_pct_max").real(kMaxLoadRefusedPct);
    w.key("load_refused_met").boolean(load_ok).end_object();
    w.end_object();
    std::ofstream out(f.str("json"));
    out << w.text() << "\n";
    if (!out) throw tandem::error("cannot write --json " + f.str("json"));
  }
  return 0;
}

}  // namespace tandem::cli
