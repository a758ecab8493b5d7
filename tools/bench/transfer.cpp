// tandem bench transfer: KV page transfer bandwidth over UCX, as a ratio to memcpy of the same
// bytes (same run), next to ucx_perftest's ucp_put_bw at the same size when it is installed.
#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "kernels/base/clock.h"
#include "kernels/base/error.h"
#include "tools/bench/bench_flags.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"
#include "transport/ucx/kv_engine.h"

extern char** environ;

namespace tandem::cli {
namespace {

using namespace tandem::ucx;
using clk = std::chrono::steady_clock;

/// A layout whose page is `bytes` long: 4 layers (for the per-layer mode), 1 KV head of 64.
kv_layout layout_for(size_t bytes) {
  kv_layout l;
  l.n_layers = 4;
  l.n_kv_heads = 1;
  l.head_dim = 64;
  l.page_size = int32_t(bytes / (2 * 4 * 64 * sizeof(float)));
  return l;
}

struct side {
  std::optional<kv_pool> heap_pool;
  std::map<transfer_id, bool> released;
  std::unique_ptr<kv_engine> engine_ptr;
  kv_engine& engine;
  kv_pool& pool;
  side(const cluster_clock& clock, const std::string& name, kv_layout l, int32_t pages, engine_options o, bool heap)
      : engine_ptr(make(clock, name, l, pages, std::move(o), heap)), engine(*engine_ptr), pool(engine.pool()) {}
  std::unique_ptr<kv_engine> make(const cluster_clock& clock, const std::string& name, kv_layout l, int32_t pages,
                                  engine_options o, bool heap) {
    auto rel = [this](transfer_id id, transfer_role, const pool_pages&, bool ok) { released[id] = ok; };
    kv_identity id{name, "bench", "f32", l};
    if (!heap) return std::make_unique<kv_engine>(clock, pages, id, std::move(o), rel);
    heap_pool.emplace(l, pages);
    return std::make_unique<kv_engine>(clock, *heap_pool, id, std::move(o), rel);
  }
};

template <class F>
void pump(side& a, side& b, F done, const char* what) {
  auto until = clk::now() + std::chrono::seconds(60);
  while (!done()) {
    a.engine.progress();
    b.engine.progress();
    if (clk::now() > until) throw tandem::error(fmt::format("bench transfer: timed out waiting for {}", what));
  }
}

double seconds_since(clk::time_point t0) { return std::chrono::duration<double>(clk::now() - t0).count(); }

/// Best-of-`reps` bandwidth (GB/s) of one request moving `n` pages, and of memcpy of the same.
struct result {
  double ucx_gbs = 0, memcpy_gbs = 0;
};

result measure(size_t page_bytes, int32_t n, int reps, const std::string& tls, put_mode mode, bool heap) {
  steady_cluster_clock clock;
  engine_options opt;
  opt.tls = tls;
  opt.mode = mode;
  opt.limits.transferring_ms = 120000;
  side prefill(clock, "bench-prefill", layout_for(page_bytes), n, opt, heap);
  side decode(clock, "bench-decode", layout_for(page_bytes), n, opt, heap);
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id to_prefill = decode.engine.add_peer("127.0.0.1", port);

  std::vector<int32_t> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n));
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  // Scatter the destination so no two pages coalesce into one put: every page is its own write.
  std::shuffle(dst.begin(), dst.end(), std::mt19937(7));
  for (int32_t p = 0; p < n; ++p) std::memset(prefill.pool.page_data(p), p & 0xff, page_bytes);
  std::vector<uint8_t> copy_dst(size_t(n) * page_bytes, 1);

  result r;
  const double bytes = double(n) * double(page_bytes);
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms up (handshake, page faults)
    transfer_id id = transfer_id(rep + 1);
    auto t0 = clk::now();
    decode.engine.table().start_receive(id, to_prefill, pool_pages{dst});
    if (rep == 0) pump(prefill, decode, [&] { return prefill.engine.peer_named("bench-decode").has_value(); }, "the handshake");
    peer_id to_decode = *prefill.engine.peer_named("bench-decode");
    prefill.engine.table().start_send(id, to_decode, pool_pages{src});
    prefill.engine.table().source_ready(id);
    pump(prefill, decode, [&] { return decode.released.count(id) && prefill.released.count(id); }, "a transfer");
    double ucx_s = seconds_since(t0);
    if (!decode.released[id]) throw tandem::error("bench transfer: a transfer failed: " + decode.engine.table().last_error());

    t0 = clk::now();
    for (int32_t i = 0; i < n; ++i)
      std::memcpy(copy_dst.data() + size_t(dst[size_t(i)]) * page_bytes, prefill.pool.page_data(src[size_t(i)]),
                  page_bytes);
    double copy_s = seconds_since(t0);
    if (rep == 0) continue;
    r.ucx_gbs = std::max(r.ucx_gbs, bytes / ucx_s / 1e9);
    r.memcpy_gbs = std::max(r.memcpy_gbs, bytes / copy_s / 1e9);
  }
  for (int32_t i = 0; i < n; i += std::max(1, n / 16))
    if (std::memcmp(prefill.pool.page_data(src[size_t(i)]), decode.pool.page_data(dst[size_t(i)]), page_bytes) != 0)
      throw tandem::error("bench transfer: a transferred page differs from its source");
  return r;
}

bool on_path(const std::string& exe) {
  const char* path = getenv("PATH");
  std::stringstream ss(path ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && access((dir + "/" + exe).c_str(), X_OK) == 0) return true;
  return false;
}

/// ucx_perftest -t ucp_put_bw on loopback: a server subprocess and a client whose "Final:" line
/// gives the overall bandwidth (MB/s as UCX prints it, 2^20 bytes). Returns GB/s (1e9), or -1.
double perftest_put_bw(size_t bytes, int port, const std::string& tls) {
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "UCX_TLS=", 8) != 0) env_s.emplace_back(*e);
  if (!tls.empty()) env_s.push_back("UCX_TLS=" + tls);
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string p = std::to_string(port), size = std::to_string(bytes);
  std::string iters = std::to_string(std::max<size_t>(200, (size_t(2) << 30) / bytes / 4));
  std::vector<std::string> srv_args = {"ucx_perftest", "-p", p}, cli_args = {"ucx_perftest", "127.0.0.1", "-p", p,
                                                                          "-t", "ucp_put_bw", "-s", size, "-n", iters};
  auto argv = [](std::vector<std::string>& a) {
    std::vector<char*> v;
    for (auto& s : a) v.push_back(s.data());
    v.push_back(nullptr);
    return v;
  };
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  pid_t srv = 0;
  auto sv = argv(srv_args);
  if (posix_spawnp(&srv, "ucx_perftest", &fa, nullptr, sv.data(), envp.data()) != 0) return -1;
  double gbs = -1;
  // The server needs a moment to listen: retry the client a few times rather than guess.
  for (int attempt = 0; attempt < 20 && gbs < 0; ++attempt) {
    int out[2];
    if (pipe(out) != 0) break;
    posix_spawn_file_actions_t ca;
    posix_spawn_file_actions_init(&ca);
    posix_spawn_file_actions_adddup2(&ca, out[1], 1);
    posix_spawn_file_actions_addopen(&ca, 2, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addclose(&ca, out[0]);
    pid_t cli = 0;
    auto cv = argv(cli_args);
    int rc = posix_spawnp(&cli, "ucx_perftest", &ca, nullptr, cv.data(), envp.data());
    posix_spawn_file_actions_destroy(&ca);
    close(out[1]);
    std::string text;
    char buf[4096];
    ssize_t k;
    while (rc == 0 && (k = read(out[0], buf, sizeof buf)) > 0) text.append(buf, size_t(k));
    close(out[0]);
    int st = 0;
    if (rc == 0) waitpid(cli, &st, 0);
    if (auto at = text.find("Final:"); at != std::string::npos) {
      std::istringstream line(text.substr(at + 6));
      double f[6] = {};
      for (double& x : f) line >> x;
      if (line) gbs = f[5] * 1048576.0 / 1e9;
    }
    if (gbs < 0) usleep(200 * 1000);
  }
  posix_spawn_file_actions_destroy(&fa);
  kill(srv, SIGTERM);
  waitpid(srv, nullptr, 0);
  return gbs;
}

}  // namespace

int bench_transfer(args a) {
  flags f;
  f.opt("sizes", "page sizes in bytes, comma separated (multiples of 2048)", "4096,16384,65536,262144,1048576")
      .opt("total-mib", "bytes moved per request, MiB", "64")
      .opt("reps", "timed repetitions per size (best is reported)", "5")
      .opt("tls", "UCX_TLS for both sides (empty: UCX's default, shared memory on one host)", "")
      .opt("mode", "batched | per_layer | both", "both")
      .sw("heap-pool", "keep the KV pools in plain heap memory (not UCX-allocated): no shared memory transport")
      .opt("perftest-port", "port for the ucx_perftest comparison", "13377");
  if (!parse_bench_flags(f, a, "transfer [options]")) return 0;
  std::vector<size_t> sizes;
  std::stringstream ss(f.str("sizes"));
  for (std::string s; std::getline(ss, s, ',');) {
    size_t v = std::stoull(s);
    if (v < 2048 || v % 2048) throw tandem::error("--sizes: " + s + " is not a multiple of 2048 bytes");
    sizes.push_back(v);
  }
  std::string mode = f.str("mode");
  if (mode != "batched" && mode != "per_layer" && mode != "both")
    throw tandem::error("--mode must be batched, per_layer or both, got '" + mode + "'");
  std::string tls = f.str("tls");
  bool perftest = on_path("ucx_perftest");
  if (!perftest) fmt::print("ucx_perftest not on PATH (package ucx-utils): skipping the ucp_put_bw column\n");
  fmt::print("KV page transfer over UCX on loopback (TLS={}, pools in {} memory), {} MiB per request, best of {}\n",
             tls.empty() ? "default" : tls, f.on("heap-pool") ? "heap" : "UCX-allocated", f.num("total-mib"),
             f.num("reps"));
  fmt::print("{:>9} {:>10} {:>11} {:>11} {:>8} {:>11} {:>8} {:>14}\n", "page", "pages", "memcpy GB/s", "batch GB/s",
             "x memcpy", "layer GB/s", "x memcpy", "perftest GB/s");
  for (size_t sz : sizes) {
    int32_t n = int32_t(std::max<size_t>(16, size_t(f.num("total-mib")) * 1048576 / sz));
    result b, l;
    if (mode != "per_layer") b = measure(sz, n, int(f.num("reps")), tls, put_mode::batched, f.on("heap-pool"));
    if (mode != "batched") l = measure(sz, n, int(f.num("reps")), tls, put_mode::per_layer, f.on("heap-pool"));
    double mem = std::max(b.memcpy_gbs, l.memcpy_gbs);
    double pt = perftest ? perftest_put_bw(sz, int(f.num("perftest-port")), tls) : -1;
    auto col = [](double v) { return v > 0 ? fmt::format("{:.2f}", v) : std::string("-"); };
    fmt::print("{:>9} {:>10} {:>11} {:>11} {:>8} {:>11} {:>8} {:>14}\n", sz, n, col(mem), col(b.ucx_gbs),
               b.ucx_gbs > 0 ? fmt::format("{:.2f}x", b.ucx_gbs / mem) : "-", col(l.ucx_gbs),
               l.ucx_gbs > 0 ? fmt::format("{:.2f}x", l.ucx_gbs / mem) : "-",
               perftest ? (pt > 0 ? col(pt) : std::string("failed")) : std::string("skipped"));
  }
  fmt::print("(layer mode: one put per layer of a page, {} layers; the per-request time includes the descriptor "
             "message, the puts, the flush and the completion notification)\n",
             layout_for(4096).n_layers);
  return 0;
}

}  // namespace tandem::cli
