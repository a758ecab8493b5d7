// tandem bench cache: a multi-turn agentic workload (shared system prompt, growing history,
// several concurrent sessions) on the embedded cluster, run with the cache off, L1 only, and
// L1+L2+L3 side by side in one process; prints TTFT p50/p99 and throughput as ratios to
// cache-off, and an L2 hit against recomputing the same tokens.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unistd.h>

#include "kernels/base/error.h"
#include "actors/runtime/embedded_cluster.h"
#include "kernels/model/make_model.h"
#include "kernels/tokenizer/tokenizer.h"
#include "tools/bench/bench_flags.h"
#include "tools/bench/modes.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"

namespace tandem::cli {

namespace {

using clk = std::chrono::steady_clock;

struct bench_params {
  int sessions = 4, turns = 8, system_tokens = 384, user_tokens = 32, reply_tokens = 8;
  int32_t vocab = 0;
};

/// Deterministic token ids in [2, vocab) (skips BOS/EOS-like low ids).
struct token_source {
  uint64_t x;
  int32_t vocab;
  int32_t next() {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return 2 + static_cast<int32_t>((x >> 33) % uint64_t(vocab - 2));
  }
};

struct one_result {
  double ttft_ms = 0;
  int32_t prompt = 0, cached = 0, generated = 0;
  std::vector<int32_t> out;
};

/// Runs one request and waits; TTFT = submit to the first event carrying a token.
one_result run_one(embedded_cluster& c, const std::string& id, const std::vector<int32_t>& prompt, int max_tokens) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  one_result r;
  r.prompt = static_cast<int32_t>(prompt.size());
  completion_request rq;
  rq.request_id = id;
  rq.prompt = prompt;
  rq.max_tokens = max_tokens;
  rq.sampling.temperature = 0;
  rq.ignore_eos = true;
  auto t0 = clk::now();
  std::optional<tandem::error> err;
  c.submit(std::move(rq), [&](token_event ev) {
    std::lock_guard lk(m);
    if (!ev.tokens.empty() && r.out.empty())
      r.ttft_ms = std::chrono::duration<double, std::milli>(clk::now() - t0).count();
    r.out.insert(r.out.end(), ev.tokens.begin(), ev.tokens.end());
    if (ev.finished) {
      r.cached = ev.cached_tokens;
      if (ev.err) err = ev.err;
      done = true;
      cv.notify_all();
    }
  });
  std::unique_lock lk(m);
  cv.wait(lk, [&] { return done; });
  if (err) throw *err;
  r.generated = static_cast<int32_t>(r.out.size());
  return r;
}

struct run_stats {
  std::string name;
  std::vector<double> ttft_ms;
  double wall_s = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0, generated = 0, shareable = 0;
  std::vector<std::vector<int32_t>> outputs;  ///< per (session, turn), for the identity check
  std::string metrics;
  /// TTFT percentile, `p` as a fraction (0.5 = p50).
  double pct(double p) const { return percentile(ttft_ms, 100.0 * p); }
};

run_stats run_workload(embedded_cluster& c, const std::string& name, const bench_params& bp) {
  run_stats st;
  st.name = name;
  token_source sys_src{7, bp.vocab};
  std::vector<int32_t> system;
  for (int i = 0; i < bp.system_tokens; ++i) system.push_back(sys_src.next());
  std::mutex m;
  std::vector<std::vector<std::vector<int32_t>>> outs(static_cast<size_t>(bp.sessions));
  std::vector<std::thread> threads;
  auto t0 = clk::now();
  std::optional<tandem::error> failure;
  for (int s = 0; s < bp.sessions; ++s) {
    threads.emplace_back([&, s] {
      try {
        token_source src{1000 + uint64_t(s), bp.vocab};
        std::vector<int32_t> hist = system;
        for (int t = 0; t < bp.turns; ++t) {
          const int64_t shareable = static_cast<int64_t>(hist.size());  // what an earlier request has seen
          for (int k = 0; k < bp.user_tokens; ++k) hist.push_back(src.next());
          auto r = run_one(c, name + "-s" + std::to_string(s) + "-t" + std::to_string(t), hist, bp.reply_tokens);
          {
            std::lock_guard lk(m);
            st.ttft_ms.push_back(r.ttft_ms);
            st.prompt_tokens += r.prompt;
            st.cached_tokens += r.cached;
            st.generated += r.generated;
            st.shareable += shareable;
            outs[size_t(s)].push_back(r.out);
          }
          hist.insert(hist.end(), r.out.begin(), r.out.end());
        }
      } catch (const tandem::error& e) {
        std::lock_guard lk(m);
        failure = e;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failure) throw *failure;
  st.wall_s = std::chrono::duration<double>(clk::now() - t0).count();
  for (auto& o : outs)
    for (auto& x : o) st.outputs.push_back(x);
  st.metrics = c.metrics_text();
  return st;
}

double metric(const std::string& text, const std::string& line_prefix) {
  auto at = text.find("\n" + line_prefix + " ");
  if (at == std::string::npos) return 0;
  return std::stod(text.substr(at + line_prefix.size() + 2));
}

}  // namespace

int bench_cache(args a) {
  flags f;
  f.opt("model", "GGUF model (default: a random-weight model of --preset, written to a temp file)")
      .opt("preset", "model preset when --model is not given", "tiny-15m")
      .opt("sessions", "concurrent conversations", "4")
      .opt("turns", "turns per conversation", "8")
      .opt("system-tokens", "shared system prompt length", "384")
      .opt("user-tokens", "new user tokens per turn", "32")
      .opt("reply-tokens", "generated tokens per turn", "8")
      .opt("threads", "kernel threads", "1")
      .opt("device-pages", "device (L1) KV pages; small so that L1 cannot hold every session", "64")
      .opt("host-ratio", "host tier (L2) size as a multiple of the device pool", "4")
      .opt("cache-write-policy", "write_through, write_through_selective or write_back", "write_through")
      .opt("cache-disk-dir", "disk tier (L3) directory (default: a temp directory, removed at exit)")
      .opt("cache-disk-size-gb", "disk tier bound", "1");
  if (!parse_bench_flags(f, a, "cache [options]")) return 0;
  bench_params bp;
  bp.sessions = static_cast<int>(f.num("sessions"));
  bp.turns = static_cast<int>(f.num("turns"));
  bp.system_tokens = static_cast<int>(f.num("system-tokens"));
  bp.user_tokens = static_cast<int>(f.num("user-tokens"));
  bp.reply_tokens = static_cast<int>(f.num("reply-tokens"));
  if (bp.sessions < 1 || bp.turns < 1 || bp.system_tokens < 1 || bp.user_tokens < 1 || bp.reply_tokens < 1)
    throw tandem::error("--sessions, --turns, --system-tokens, --user-tokens and --reply-tokens must be >= 1");

  namespace fs = std::filesystem;
  const std::string tag = std::to_string(getpid());
  std::string model = f.str("model");
  std::string tmp_model;
  if (model.empty()) {
    tmp_model = (fs::temp_directory_path() / ("tandem_bench_cache_" + tag + ".gguf")).string();
    make_model_options mo;
    mo.preset = f.str("preset");
    mo.dtype = ggml_type::f16;
    write_random_llama(mo, tmp_model);
    model = tmp_model;
  }
  std::string disk = f.str("cache-disk-dir");
  std::string tmp_disk;
  if (disk.empty()) {
    tmp_disk = (fs::temp_directory_path() / ("tandem_bench_cache_l3_" + tag)).string();
    fs::remove_all(tmp_disk);
    disk = tmp_disk;
  }
  struct cleanup {
    std::string m, d;
    ~cleanup() {
      std::error_code ec;
      if (!m.empty()) fs::remove(m, ec);
      if (!d.empty()) fs::remove_all(d, ec);
    }
  } clean{tmp_model, tmp_disk};

  auto base = [&](bool cache) {
    cluster_options o;
    o.model_path = model;
    o.lim.threads = static_cast<int32_t>(f.num("threads"));
    o.lim.device_pages = static_cast<int32_t>(f.num("device-pages"));
    o.lim.prefix_cache = cache;
    o.log_level = "error";  // pool-full retries under contention are expected here
    return o;
  };
  cluster_options hier = base(true);
  hier.cache.host_ratio = f.real("host-ratio");
  if (!parse_cache_write_policy(f.str("cache-write-policy"), hier.cache.write_policy))
    throw tandem::error("--cache-write-policy = '" + f.str("cache-write-policy") +
                        "' is not a policy; use write_through, write_through_selective or write_back");
  hier.cache.write_through_threshold = 1;
  hier.cache.disk_dir = disk;
  hier.cache.disk_size_gb = f.real("cache-disk-size-gb");

  std::printf("tandem bench cache: %d sessions x %d turns, system prompt %d tokens, +%d user / %d reply tokens "
              "per turn, %d device pages of 16 tokens\n",
              bp.sessions, bp.turns, bp.system_tokens, bp.user_tokens, bp.reply_tokens,
              static_cast<int>(f.num("device-pages")));
  std::fflush(stdout);

  std::vector<run_stats> runs;
  double l2_ms = 0, recompute_ms = 0, l2_load_s = 0;
  int32_t l2_tokens = 0, probe_tokens = 0;
  double probe_host = 0, probe_disk = 0;
  const char* names[] = {"cache off", "L1 only", "L1+L2+L3"};
  for (int i = 0; i < 3; ++i) {
    auto o = i == 0 ? base(false) : i == 1 ? base(true) : hier;
    auto c = embedded_cluster::start(o);
    bp.vocab = static_cast<int32_t>(c->tok().n_vocab());
    runs.push_back(run_workload(*c, names[i], bp));
    if (i == 2) {
      // L2 hit vs recompute of the same tokens: a fresh prompt computed cold (recompute), then
      // pushed out of L1 by other prompts, then asked again (load-back from host).
      token_source src{99, bp.vocab};
      std::vector<int32_t> probe;
      for (int k = 0; k < 512; ++k) probe.push_back(src.next());
      probe_tokens = static_cast<int32_t>(probe.size());
      recompute_ms = run_one(*c, "probe-cold", probe, 1).ttft_ms;
      const int32_t flood = static_cast<int32_t>(f.num("device-pages")) * 16 - 32;
      for (int k = 0; k < 2; ++k) {
        std::vector<int32_t> other;
        for (int j = 0; j < flood; ++j) other.push_back(src.next());
        run_one(*c, "flood" + std::to_string(k), other, 1);
      }
      const auto before = c->metrics_text();
      const double lb0 = metric(before, "tandem_cache_load_back_seconds_total");
      const double host0 = metric(before, "tandem_cache_hit_tokens_total{tier=\"host\"}");
      const double disk0 = metric(before, "tandem_cache_hit_tokens_total{tier=\"disk\"}");
      auto hot = run_one(*c, "probe-l2", probe, 1);
      l2_ms = hot.ttft_ms;
      l2_tokens = hot.cached;
      const auto after = c->metrics_text();
      l2_load_s = metric(after, "tandem_cache_load_back_seconds_total") - lb0;
      probe_host = metric(after, "tandem_cache_hit_tokens_total{tier=\"host\"}") - host0;
      probe_disk = metric(after, "tandem_cache_hit_tokens_total{tier=\"disk\"}") - disk0;
    }
  }

  const auto& off = runs[0];
  std::printf("\n%-10s %9s %9s %10s %8s %9s %8s %9s %9s\n", "config", "ttft_p50", "ttft_p99", "tok/s", "cached",
              "p50_x", "p99_x", "thru_x", "same_out");
  for (const auto& r : runs) {
    const double thr = double(r.prompt_tokens + r.generated) / r.wall_s;
    const double thr_off = double(off.prompt_tokens + off.generated) / off.wall_s;
    std::printf("%-10s %7.1fms %7.1fms %10.0f %7.1f%% %8.2fx %7.2fx %8.2fx %9s\n", r.name.c_str(), r.pct(0.5),
                r.pct(0.99), thr, 100.0 * double(r.cached_tokens) / double(r.prompt_tokens),
                off.pct(0.5) / std::max(r.pct(0.5), 1e-9), off.pct(0.99) / std::max(r.pct(0.99), 1e-9),
                thr / thr_off, r.outputs == off.outputs ? "yes" : "NO");
  }
  std::printf("\nprefix share of the workload: %.1f%% of prompt tokens were seen by an earlier request\n",
              100.0 * double(off.shareable) / double(off.prompt_tokens));
  const auto& h = runs[2].metrics;
  std::printf("L1+L2+L3 hits: device %.0f, host %.0f, disk %.0f tokens; evictions device %.0f host %.0f disk %.0f; "
              "backed up host %.0f disk %.0f tokens; copy bandwidth %.2f GB/s\n",
              metric(h, "tandem_cache_hit_tokens_total{tier=\"device\"}"),
              metric(h, "tandem_cache_hit_tokens_total{tier=\"host\"}"),
              metric(h, "tandem_cache_hit_tokens_total{tier=\"disk\"}"),
              metric(h, "tandem_cache_evictions_total{tier=\"device\"}"),
              metric(h, "tandem_cache_evictions_total{tier=\"host\"}"),
              metric(h, "tandem_cache_evictions_total{tier=\"disk\"}"),
              metric(h, "tandem_cache_backup_tokens_total{tier=\"host\"}"),
              metric(h, "tandem_cache_backup_tokens_total{tier=\"disk\"}"),
              metric(h, "tandem_cache_copy_bandwidth_bytes_per_second") / 1e9);
  std::printf("L2 hit vs recompute, %d-token prompt: TTFT %.1f ms reusing %d tokens (%.0f from host, %.0f from disk; "
              "load-back %.2f ms) vs %.1f ms recomputing: %.2fx\n",
              probe_tokens, l2_ms, l2_tokens, probe_host, probe_disk, l2_load_s * 1000.0, recompute_ms,
              recompute_ms / std::max(l2_ms, 1e-9));
  bool ok = true;
  for (const auto& r : runs) ok = ok && r.outputs == off.outputs;
  if (!ok) {
    std::printf("FAIL: outputs with the cache differ from cache off\n");
    return 1;
  }
  return 0;
}

}  // namespace tandem::cli
