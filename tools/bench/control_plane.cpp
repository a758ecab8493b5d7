// tandem bench control-plane: CPU time the actors spend per generated token (router ->
// prefill scheduler -> handoff -> decode scheduler -> sampling -> streaming callback), with
// a null model whose forward does a fixed minimum of work (fills the logits). The forward's
// own CPU time is measured on its thread and subtracted, so what is left is the serving
// machinery around the kernels.
#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/base/error.h"
#include "actors/common/metrics.h"
#include "actors/runtime/actor_cluster.h"
#include "kernels/model/llama.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

namespace {

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

/// A model with no weights: each forward writes one-hot logits (next = last token + 1).
/// Its CPU time is summed so the benchmark can take it out.
class null_model final : public llama_model {
 public:
  explicit null_model(int32_t n_vocab) {
    cfg_.name = "null";
    cfg_.n_vocab = n_vocab;
    cfg_.n_embd = 4;
    cfg_.n_layer = 1;
    cfg_.n_head = 1;
    cfg_.n_head_kv = 1;
    cfg_.head_dim = 4;
    cfg_.n_ctx = 1 << 16;
    cfg_.n_ff = 4;
  }
  const model_config& config() const override { return cfg_; }
  kv_layout layout(int32_t page_size) const override { return kv_layout{1, 1, 4, page_size}; }
  void forward(std::span<const batch_seq> batch, kv_pools&, std::vector<float>& logits) override {
    const double t0 = thread_cpu_s();
    size_t n = 0;
    for (const auto& s : batch) n += s.want_logits ? 1 : 0;
    logits.assign(n * size_t(cfg_.n_vocab), 0.0f);
    size_t r = 0;
    for (const auto& s : batch) {
      if (!s.want_logits) continue;
      logits[r * size_t(cfg_.n_vocab) + size_t((s.tokens.back() + 1) % cfg_.n_vocab)] = 1.0f;
      ++r;
    }
    forwards_.fetch_add(1, std::memory_order_relaxed);
    const double dt = thread_cpu_s() - t0;
    // Only the worker thread calls forward; a plain add under the atomic is enough.
    forward_cpu_ns_.fetch_add(int64_t(dt * 1e9), std::memory_order_relaxed);
  }
  double forward_cpu_s() const { return double(forward_cpu_ns_.load()) * 1e-9; }
  int64_t forwards() const { return forwards_.load(); }

 private:
  model_config cfg_;
  std::atomic<int64_t> forward_cpu_ns_{0}, forwards_{0};
};

struct waiter {
  std::mutex m;
  std::condition_variable cv;
  int64_t finished = 0, tokens = 0, errors = 0;
  std::string first_error;

  event_callback cb() {
    return [this](token_event ev) {
      std::lock_guard lk(m);
      tokens += int64_t(ev.tokens.size());
      if (ev.err) {
        ++errors;
        if (first_error.empty()) first_error = ev.err->what();
      }
      if (ev.finished) {
        ++finished;
        cv.notify_all();
      }
    };
  }
  bool wait(int64_t n, std::chrono::seconds t) {
    std::unique_lock lk(m);
    return cv.wait_for(lk, t, [&] { return finished >= n; });
  }
};

struct run_result {
  int64_t tokens = 0;
  double wall_s = 0, cpu_s = 0, forward_s = 0;
  int64_t forwards = 0;
};

run_result run_once(actor_cluster& c, null_model& m, int64_t requests, int64_t prompt, int64_t max_tokens,
                    const std::string& tag, int64_t timeout_s) {
  waiter w;
  std::vector<completion_request> reqs;
  for (int64_t i = 0; i < requests; ++i) {
    completion_request r;
    r.request_id = fmt::format("{}-{}", tag, i);
    for (int64_t t = 0; t < prompt; ++t) r.prompt.push_back(int32_t((i * 7 + t) % 200 + 1));
    r.max_tokens = int32_t(max_tokens);
    r.ignore_eos = true;
    reqs.push_back(std::move(r));
  }
  const double f0 = m.forward_cpu_s();
  const int64_t n0 = m.forwards();
  const double c0 = process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& r : reqs) c.submit(std::move(r), w.cb());
  if (!w.wait(requests, std::chrono::seconds(timeout_s)))
    throw tandem::error(error_kind::failed,
                        fmt::format("control-plane bench: only {} of {} requests finished in {} s; use fewer "
                                    "--requests or --tokens",
                                    w.finished, requests, timeout_s));
  run_result r;
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_s = process_cpu_seconds() - c0;
  r.forward_s = m.forward_cpu_s() - f0;
  r.forwards = m.forwards() - n0;
  std::lock_guard lk(w.m);
  if (w.errors > 0)
    throw tandem::error(error_kind::failed,
                        fmt::format("control-plane bench: {} requests failed, first: {}", w.errors, w.first_error));
  r.tokens = w.tokens;
  return r;
}

}  // namespace

int bench_control_plane(args a) {
  flags f;
  f.opt("requests", "concurrent requests", "64")
      .opt("tokens", "tokens generated per request", "256")
      .opt("prompt", "prompt tokens per request", "16")
      .opt("batch", "decode batch size (limits.max_running_seqs)", "32")
      .opt("vocab", "vocabulary of the null model (sampling cost grows with it)", "256")
      .opt("scheduler-threads", "CAF scheduler threads", "2")
      .sw("json", "print one JSON object instead of text");
  if (!parse_bench_flags(f, a, "control-plane [options]   (also: tandem bench model --null)")) return 0;
  const int64_t requests = f.num("requests"), tokens = f.num("tokens"), prompt = f.num("prompt"),
                batch = f.num("batch"), vocab = f.num("vocab"), sched = f.num("scheduler-threads");
  if (requests < 1 || requests > 4096 || tokens < 1 || tokens > 4096 || prompt < 1 || prompt > 4096 || batch < 1 ||
      vocab < 2 || vocab > (1 << 20) || sched < 1)
    throw tandem::error("out-of-range flag: --requests 1..4096, --tokens 1..4096, --prompt 1..4096, --batch >= 1, "
                        "--vocab 2..1048576, --scheduler-threads >= 1");
  limits l;
  l.page_size = 16;
  const int64_t pages_per_req = (prompt + tokens + l.page_size - 1) / l.page_size + 1;
  l.device_pages = int32_t(std::min<int64_t>(pages_per_req * requests + 16, 1 << 20));
  l.max_running_seqs = int32_t(batch);
  l.max_queued_requests = int32_t(std::max<int64_t>(requests, 256));
  l.max_inflight_requests = int32_t(std::max<int64_t>(requests * 2, 1024));
  l.prefix_cache = false;
  l.threads = 1;
  l.scheduler_threads = int32_t(sched);
  l.max_new_tokens = int32_t(std::max<int64_t>(tokens, 16));
  auto model = std::make_shared<null_model>(int32_t(vocab));
  actor_cluster_options o;
  o.lim = l;
  o.model_id = "null";
  o.eos_id = -1;
  o.sink = std::make_shared<spdlog::sinks::null_sink_mt>();
  o.log_level = "warn";
  actor_cluster c(model, o);
  run_once(c, *model, std::min<int64_t>(requests, 8), prompt, std::min<int64_t>(tokens, 16), "warm", 120);
  const run_result r = run_once(c, *model, requests, prompt, tokens, "run", 600);
  const double per_tok_us = (r.cpu_s - r.forward_s) / double(r.tokens) * 1e6;
  const double total_us = r.cpu_s / double(r.tokens) * 1e6;
  if (f.on("json")) {
    std::printf("{\"requests\":%lld,\"tokens\":%lld,\"batch\":%lld,\"vocab\":%lld,\"forwards\":%lld,"
                "\"wall_s\":%.4f,\"process_cpu_s\":%.4f,\"forward_cpu_s\":%.4f,"
                "\"control_plane_cpu_us_per_token\":%.3f,\"total_cpu_us_per_token\":%.3f,\"tokens_per_s\":%.1f}\n",
                (long long)requests, (long long)r.tokens, (long long)batch, (long long)vocab, (long long)r.forwards,
                r.wall_s, r.cpu_s, r.forward_s, per_tok_us, total_us, double(r.tokens) / r.wall_s);
    return 0;
  }
  std::printf("null model (vocab %lld): %lld requests x %lld tokens, decode batch %lld, %lld forwards\n",
              (long long)vocab, (long long)requests, (long long)tokens, (long long)batch, (long long)r.forwards);
  std::printf("wall %.3f s (%.0f tokens/s); process CPU %.3f s, of which null forward %.3f s\n", r.wall_s,
              double(r.tokens) / r.wall_s, r.cpu_s, r.forward_s);
  std::printf("control plane: %.2f us CPU per generated token (goal < 10: %s); all CPU: %.2f us/token\n", per_tok_us,
              per_tok_us < 10 ? "met" : "NOT met", total_us);
  return 0;
}

}  // namespace tandem::cli
