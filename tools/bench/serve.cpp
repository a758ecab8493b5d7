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

#include "kernels/base/error.h"
#include "actors/common/limits.h"
#include "actors/runtime/embedded_cluster.h"
#include "tools/bench/load.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"
#include "transport/http/json.h"
#include "transport/rpc/front_end.h"

namespace tandem::cli {

namespace {

using namespace load;

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
      .opt("kernels", "with --embedded (and --compare-model): CPU kernel path ([model] kernels)", "best")
      .opt("kv-cache-dtype", "with --embedded (and --compare-model): f32 or f16 ([model] kv_cache_dtype)", "f32")
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
  if (!parse_bench_flags(f, a, "serve (--port P | --embedded --model FILE) (--rate R | --burst N | --concurrency N) [options]"))
    return 0;
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
  const bench_model_setup setup{int32_t(threads), f.str("kernels"), f.str("kv-cache-dtype")};
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
    co.kernel_isa = setup.kernels;
    co.kv_cache_dtype = setup.kv_cache_dtype;
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
  // Where the embedded worker's time went in the run: its forward passes against wall time
  // (the rest is the runtime between steps, or no work), from its metrics before and after.
  struct worker_marks {
    double forward_ms = 0, prefill_steps = 0, decode_steps = 0, decode_tokens = 0;
  };
  auto marks = [&] {
    worker_marks m;
    if (!cluster) return m;
    const std::string t = cluster->metrics_text();
    m.forward_ms = metric_sum(t, "tandem_worker_forward_ms_sum");
    m.prefill_steps = metric_sum(t, "tandem_prefill_batches_total");
    m.decode_steps = metric_sum(t, "tandem_decode_steps_total");
    m.decode_tokens = metric_sum(t, "tandem_decode_tokens_total");
    return m;
  };
  const worker_marks before = marks();
  double wall_s = 0;
  const std::vector<record> recs = run_load(o, prompts, wall_s);
  const worker_marks after = marks();
  const summary s = summarize(recs, wall_s, slo_ttft_ms, slo_tpot_ms);
  const double out_tps = double(s.output_tokens) / s.active_s;

  // The same run's single-process decode at batch N, on a quiet machine: the server first.
  double model_tps = 0, same_work_tps = 0, prefill_s = 0;
  int64_t model_ctx = 0, prompt_tokens = 0;
  if (compare) {
    if (fe) fe->stop();
    if (fe_thread.joinable()) fe_thread.join();
    fe.reset();
    cluster.reset();
    model_ctx = (o.prompt_min + o.prompt_max) / 2 + o.max_tokens / 2;
    model_tps = bench_model_decode_tokens_per_s(model_path, setup, o.concurrency, model_ctx);
    // The same work in one process: N prompts of the served length, prefilled in the
    // scheduler's chunks, then max_tokens decode steps at batch N. Served tokens/s over this
    // is the runtime's overhead alone; the line above also charges it for the prefill.
    prompt_tokens = s.prompt_reported > 0 ? std::llround(double(s.prompt_tokens) / double(s.prompt_reported)) : 0;
    if (prompt_tokens > 0 && model_tps > 0) {
      prefill_s = bench_model_prefill_s(model_path, setup, o.concurrency, prompt_tokens,
                                        limits{}.prefill_chunk_tokens);
      const double out = double(o.concurrency * o.max_tokens);
      same_work_tps = out / (prefill_s + out / model_tps);
    }
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
  row("first text", s.first_text);
  row("TPOT", s.tpot);
  row("ITL", s.itl);
  row("E2E", s.e2e);
  if (!s.reject.empty()) std::printf("rejection p50 %.2f ms, p99 %.2f ms\n", percentile(s.reject, 50), percentile(s.reject, 99));
  const int64_t completed = s.by_outcome.count(outcome::completed) ? s.by_outcome.at(outcome::completed) : 0;
  std::printf("throughput: %.2f req/s, %.1f output tokens/s; goodput %lld requests (%.2f req/s) within TTFT <= %s, TPOT <= %s\n",
              double(completed) / s.active_s, out_tps, (long long)s.good, double(s.good) / s.active_s,
              slo_ttft_ms > 0 ? fmt::format("{} ms", slo_ttft_ms).c_str() : "any",
              slo_tpot_ms > 0 ? fmt::format("{} ms", slo_tpot_ms).c_str() : "any");
  if (embedded) {
    const double busy_s = (after.forward_ms - before.forward_ms) / 1e3;
    const double steps = after.decode_steps - before.decode_steps;
    std::printf("worker: forward passes %.2f s of the run's %.2f s (%.1f%%); %.0f prefill steps, %.0f decode steps of "
                "%.1f sequences on average\n",
                busy_s, wall_s, wall_s > 0 ? 100.0 * busy_s / wall_s : 0.0, after.prefill_steps - before.prefill_steps,
                steps, steps > 0 ? (after.decode_tokens - before.decode_tokens) / steps : 0.0);
  }
  if (compare)
    std::printf("compare: served %.1f tokens/s / bench model decode batch %lld (ctx %lld) %.1f tokens/s = %.3f (goal >= 0.8)\n",
                out_tps, (long long)o.concurrency, (long long)model_ctx, model_tps, model_tps > 0 ? out_tps / model_tps : 0.0);
  if (compare && same_work_tps > 0)
    std::printf("compare (same work): served %.1f tokens/s / in-process prefill of %lld x %lld-token prompts (%.2f s) + "
                "%lld decode steps at batch %lld %.1f tokens/s = %.3f (goal >= 0.8)\n",
                out_tps, (long long)o.concurrency, (long long)prompt_tokens, prefill_s, (long long)o.max_tokens,
                (long long)o.concurrency, same_work_tps, out_tps / same_work_tps);
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
    write_pcts(w, "first_text_ms", s.first_text);
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
      w.key("ratio").real(model_tps > 0 ? out_tps / model_tps : 0.0);
      w.key("same_work").begin_object().key("prompt_tokens").num(prompt_tokens).key("prefill_s").real(prefill_s);
      w.key("tokens_per_s").real(same_work_tps).key("ratio").real(same_work_tps > 0 ? out_tps / same_work_tps : 0.0);
      w.end_object().end_object();
    }
    w.key("records").begin_array();
    for (const record& r : recs) {
      w.begin_object().key("index").num(r.index).key("arrival_s").real(r.arrival_s).key("sent_s").real(r.sent_s);
      w.key("outcome").str(outcome_name(r.out)).key("status").num(r.status);
      w.key("ttft_ms").real(ms_or_none(r.ttft_s)).key("first_text_ms").real(ms_or_none(r.first_text_s));
      w.key("e2e_ms").real(ms_or_none(r.e2e_s)).key("tpot_ms").real(ms_or_none(r.tpot_s()));
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
