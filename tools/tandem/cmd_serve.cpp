// tandem serve: an embedded single-process cluster behind the HTTP and RPC front ends,
// all on one kj event loop.
#include <csignal>
#include <cstdio>

#include <kj/async-unix.h>
#include <spdlog/spdlog.h>

#include "actors/common/error.h"
#include "actors/runtime/embedded_cluster.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/flags.h"
#include "transport/rpc/front_end.h"

namespace tandem::cli {

namespace {

int32_t positive_i32(const flags& f, const std::string& name) {
  int64_t v = f.num(name);
  if (v <= 0 || v > INT32_MAX) throw tandem::error("flag --" + name + " = " + std::to_string(v) + " must be a positive 32-bit integer");
  return static_cast<int32_t>(v);
}

int port_flag(const flags& f, const std::string& name) {
  int64_t v = f.num(name);
  if (v < 0 || v > 65535) throw tandem::error("flag --" + name + " = " + std::to_string(v) + " is not a port; use 0..65535 (0 picks a free one)");
  return static_cast<int>(v);
}

}  // namespace

int serve(args a) {
  flags f;
  f.opt("model", "GGUF model file (required)")
      .opt("host", "address to bind; 0.0.0.0 exposes the node to the network", "127.0.0.1")
      .opt("port", "HTTP port (OpenAI API); 0 picks a free port", "8080")
      .opt("rpc-port", "Cap'n Proto RPC port; 0 picks a free port", "8081")
      .opt("threads", "kernel threads of the worker", "1")
      .opt("page-size", "tokens per KV page", "16")
      .opt("kv-cache-mb", "KV cache size in MiB", "256")
      .opt("max-running-seqs", "decode batch size", "32")
      .opt("max-queued-requests", "requests waiting for prefill before new ones get 503", "256")
      .opt("max-body-bytes", "largest HTTP request body", "4194304")
      .opt("log-level", "trace, debug, info, warn, error", "info")
      .opt("config", "cluster config (disaggregated deployment)")
      .opt("host-ratio", "host KV cache tier (L2) as a multiple of the device pool; 0 = none", "0")
      .opt("host-size-gb", "host KV cache tier (L2) in GiB (instead of --host-ratio)", "0")
      .opt("cache-write-policy", "write_through, write_through_selective or write_back", "write_through_selective")
      .opt("cache-disk-dir", "directory of the disk KV cache tier (L3); empty = none")
      .opt("cache-disk-size-gb", "bound of the disk tier in GiB", "0")
      .opt("min-load-back-tokens", "shorter host/disk hits are recomputed (0 = one page)", "0");
  if (!f.parse(a)) {
    std::fprintf(stderr, "usage: tandem serve --model FILE [options]\n%s", f.help().c_str());
    return 0;
  }
  if (f.has("config"))
    throw tandem::error(error_kind::unimplemented,
                        "--config (disaggregated prefill/decode deployment across nodes) is not implemented yet; "
                        "see the disaggregation issue. Run without --config for an embedded single-process cluster");
  if (f.str("model").empty()) throw tandem::error("--model FILE is required (write one with `tandem make-model`)");

  cluster_options co;
  co.model_path = f.str("model");
  co.log_level = f.str("log-level");
  co.lim.threads = positive_i32(f, "threads");
  co.lim.page_size = positive_i32(f, "page-size");
  co.lim.kv_cache_mb = positive_i32(f, "kv-cache-mb");
  co.lim.max_running_seqs = positive_i32(f, "max-running-seqs");
  co.lim.max_queued_requests = positive_i32(f, "max-queued-requests");
  int64_t body = f.num("max-body-bytes");
  if (body <= 0) throw tandem::error("flag --max-body-bytes = " + std::to_string(body) + " must be > 0");
  co.lim.max_body_bytes = body;
  if (auto msg = co.lim.validate(); !msg.empty()) throw tandem::error(msg);
  co.cache.host_ratio = f.real("host-ratio");
  co.cache.host_size_gb = f.real("host-size-gb");
  if (!parse_cache_write_policy(f.str("cache-write-policy"), co.cache.write_policy))
    throw tandem::error("flag --cache-write-policy = '" + f.str("cache-write-policy") +
                        "' is not a policy; use write_through, write_through_selective or write_back");
  co.cache.disk_dir = f.str("cache-disk-dir");
  co.cache.disk_size_gb = f.real("cache-disk-size-gb");
  const int64_t min_lb = f.num("min-load-back-tokens");
  if (min_lb < 0 || min_lb > INT32_MAX)
    throw tandem::error("flag --min-load-back-tokens = " + std::to_string(min_lb) +
                        " must be a token count >= 0 (0 = one page)");
  co.cache.min_load_back_tokens = static_cast<int32_t>(min_lb);
  auto level = spdlog::level::from_str(co.log_level);
  if (level == spdlog::level::off && co.log_level != "off")
    throw tandem::error("flag --log-level = '" + co.log_level + "' is not a level; use trace, debug, info, warn or error");
  spdlog::set_level(level);

  front_end_options fo;
  fo.host = f.str("host");
  fo.http_port = port_flag(f, "port");
  fo.rpc_port = port_flag(f, "rpc-port");
  fo.lim = co.lim;
  fo.handle_signals = true;

  // Signals must be captured before the cluster starts its threads, so they inherit the mask.
  kj::UnixEventPort::captureSignal(SIGINT);
  kj::UnixEventPort::captureSignal(SIGTERM);
  std::signal(SIGPIPE, SIG_IGN);

  auto cluster = embedded_cluster::start(co);
  front_end fe(*cluster, fo);
  fe.run([](const listener_info& l) {
    std::printf("tandem: %s listening on %s:%u\n", l.what.c_str(), l.host.c_str(), static_cast<unsigned>(l.port));
    std::fflush(stdout);
  });
  spdlog::info("tandem serve: stopped");
  return 0;
}

}  // namespace tandem::cli
