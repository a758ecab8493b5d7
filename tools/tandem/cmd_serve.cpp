// tandem serve: an embedded single-process cluster behind the HTTP and RPC front ends,
// all on one kj event loop.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include <fmt/format.h>

#include <kj/async-unix.h>
#include <spdlog/spdlog.h>

#include "actors/common/cpu_cores.h"
#include "kernels/base/error.h"
#include "actors/common/logging.h"
#include "actors/config/cluster_config.h"
#include "actors/runtime/actor_cluster.h"
#include "actors/runtime/embedded_cluster.h"
#include "kernels/tokenizer/tokenizer.h"
#include "actors/common/limits_table.h"
#include "tools/tandem/backend_select.h"
#include "tools/tandem/commands.h"
#include "tools/tandem/config_report.h"
#include "tools/tandem/exit_codes.h"
#include "tools/tandem/flags.h"
#include "transport/auth/api_keys.h"
#include "transport/chat/jinja.h"
#include "transport/rpc/front_end.h"
#include "transport/ucx/kv_netdev.h"
#include "transport/ucx/kv_port_ucx.h"

namespace tandem::cli {

namespace {

/// The flags of the limits that `tandem serve --model` takes (limits_table.h's serve_flag),
/// with the table's meaning and default; --threads defaults to the physical cores instead.
void declare_limit_flags(flags& f) {
  for (const auto& l : limit_fields()) {
    if (!l.serve_flag) continue;
    std::string def = l.boolean ? "off" : l.default_text();
    if (std::string(l.key) == "threads") def = std::to_string(physical_cores());
    std::string help = l.meaning;
    if (l.boolean) help = "on: " + help + "; off: not";
    f.opt(l.serve_flag, help, def);
  }
}

/// Reads those flags into `lim`, each checked against the table's bounds (message names the flag).
void read_limit_flags(const flags& f, limits& lim) {
  for (const auto& l : limit_fields()) {
    if (!l.serve_flag) continue;
    const std::string name = l.serve_flag;
    if (l.boolean) {
      const std::string v = f.str(name);
      if (v != "on" && v != "off") throw usage_error("flag --" + name + " = '" + v + "' is not a switch; use on or off");
      l.set(lim, v == "on");
      continue;
    }
    const int64_t v = f.num(name);
    if (auto msg = check_limit(l, v, "flag --" + name); !msg.empty()) throw usage_error(msg);
    l.set(lim, v);
  }
}

/// Every limit flag: with --config the file sets them.
std::vector<std::string> limit_flag_names() {
  std::vector<std::string> r;
  for (const auto& l : limit_fields())
    if (l.serve_flag) r.emplace_back(l.serve_flag);
  return r;
}

int port_flag(const flags& f, const std::string& name) {
  int64_t v = f.num(name);
  if (v < 0 || v > 65535) throw usage_error("flag --" + name + " = " + std::to_string(v) + " is not a port; use 0..65535 (0 picks a free one)");
  return static_cast<int>(v);
}

/// A node with only some roles (its links to the other nodes are in its spec, spec_of): on
/// prefill and decode nodes whose counterpart runs elsewhere, the worker's KV transfer port over UCX.
void configure_kv_port(const cluster_config& cfg, const node_config& node, cluster_options& co) {
  const bool needs_kv = (node.has_role("prefill") && !node.has_role("decode")) ||
                        (node.has_role("decode") && !node.has_role("prefill"));
  ucx::kv_port_options ko;
  ko.node = node.name;
  if (needs_kv) {
    if (node.has_role("prefill")) {
      ko.listen_host = co.ports.host;
      ko.listen_port = static_cast<uint16_t>(co.ports.kv);
    }
    if (node.has_role("decode"))
      for (const auto* p : cfg.nodes_with_role("prefill"))
        if (p->name != node.name) ko.sources.push_back({p->name, p->host, static_cast<uint16_t>(p->kv_port)});
    const char* tls = std::getenv("TANDEM_KV_TLS");
    // The listener needs tcp (the sockaddr connection manager); shared memory carries the
    // puts between processes of one host. UCX_TLS in the environment still wins in UCX.
    ko.engine.tls = tls && *tls ? tls : "tcp,sm,self";
    // Only the interface of the node's address (UCX's tcp transport listens on every device
    // it is given); the cluster secret authenticates the handshake (docs/security.md).
    ko.engine.net_devices = ucx::net_devices_for_host(node.host, ucx::interface_addresses());
    if (!cfg.api_key_file.empty()) ko.engine.secret = client_api_key(cfg.api_key_file);
    const char* fault = std::getenv("TANDEM_KV_FAULT");
    ko.engine.faults = ucx::fault_hook_from_spec(fault ? fault : "");
    const int64_t t = cfg.transfer_timeout_ms;
    ko.engine.limits.bootstrap_ms = t;
    ko.engine.limits.waiting_ms = t;
    ko.engine.limits.transferring_ms = t;
    ko.engine.limits.quarantine_ms = t;
    ko.engine.limits.max_transfers = size_t(cfg.lim.kv_transfer_max_live);
    ko.engine.limits.max_quarantined = size_t(cfg.lim.kv_transfer_max_quarantined);
    ko.engine.limits.max_early_descriptors = size_t(cfg.lim.kv_transfer_max_early_descriptors);
    ko.resolve_ms = t;
  }
  if (!needs_kv) return;
  co.configure_node = [ko](actor_cluster_options& ao) {
    auto k = ko;
    k.model = ao.model_id;
    // A device's pools (--backend cuda): transfers stage through pinned host slots.
    k.engine.device = ao.device;
    if (const char* mb = std::getenv("TANDEM_KV_STAGING_MB"); mb && *mb)
      k.engine.staging_bytes = size_t(std::max(1L, std::strtol(mb, nullptr, 10))) << 20;
    ao.kv_transfer = ucx::make_kv_port_factory(k);
  };
}

/// Fills the options from the node `--node` of the config `--config`, after every check of
/// `tandem check-config`; exits 1 with the same messages if the config is invalid.
void configure_from_file(const flags& f, cluster_options& co, front_end_options& fo) {
  std::vector<std::string> file_set = limit_flag_names();
  for (const char* flag : {"model", "host", "port", "rpc-port", "admin-port", "host-ratio", "host-size-gb",
                           "cache-write-policy", "cache-disk-dir", "cache-disk-size-gb", "min-load-back-tokens",
                           "router-policy", "router-migration", "kernels", "kv-cache-dtype", "backend", "device"})
    file_set.emplace_back(flag);
  for (const auto& flag : file_set)
    if (f.has(flag))
      throw usage_error(fmt::format("flag --{} conflicts with --config: the config file sets it; edit the file instead",
                                      flag));
  std::string path = f.str("config");
  if (!f.has("node")) throw usage_error("--config needs --node NAME: the [[node]] of the config this process runs");
  config_check c;
  try {
    machine_info here = machine_info::probe(f.str("node"));
    here.cuda_devices = cuda_devices_here();
    c = check_cluster_config_file(path, here);
  } catch (const tandem::error& e) {
    throw config_error(e.what());
  }
  // The same lines as `tandem check-config`; if any is an error, main's error line follows (exit 1).
  print_config_problems(c);
  if (!c.ok()) {
    throw config_error(fmt::format("{}: {} problem{}; the node was not started (fix them and run `tandem check-config {}`)",
                                    path, c.errors.size(), c.errors.size() == 1 ? "" : "s", path));
  }
  std::string names;
  for (const auto& n : c.cfg.nodes) names += (names.empty() ? "" : ", ") + n.name;
  if (!f.has("node")) throw usage_error(fmt::format("--config needs --node NAME, one of: {}", names));
  const node_config* node = c.cfg.find_node(f.str("node"));
  if (!node) throw config_error(fmt::format("--node {}: {} has no such node; use one of: {}", f.str("node"), path, names));
  if (c.cfg.model_path.empty())
    throw config_error(fmt::format("{}: model.path is not set; add [model] path = \"FILE.gguf\"", path));
  // The node's settings as check-config planned them (spec_of: limits with its page size, its
  // effective cache, policy, roles and links).
  static_cast<node_spec&>(co) = spec_of(c.cfg, *node);
  if (!node->all_roles()) configure_kv_port(c.cfg, *node, co);
  co.model_path = c.cfg.model_path;
  co.kernel_isa = c.cfg.kernel_isa;
  co.kv_cache_dtype = c.cfg.kv_cache_dtype;
  co.device = select_backend(c.cfg.backend, c.cfg.device);
  fo.auth_allowlist = c.cfg.auth_allowlist;
  if (!c.cfg.api_key_file.empty()) fo.keys = std::make_shared<api_keys>(api_keys::load_file(c.cfg.api_key_file));
}

/// --api-key-file / --auth-allowlist (without --config; the config's [security] otherwise), and
/// the warning for a node reachable from the network without keys.
void configure_security(const flags& f, front_end_options& fo) {
  if (f.has("config") && (f.has("api-key-file") || f.has("auth-allowlist")))
    throw usage_error("flags --api-key-file/--auth-allowlist conflict with --config: set [security] api_key_file and "
                        "auth_allowlist in the file instead");
  if (f.has("api-key-file")) fo.keys = std::make_shared<api_keys>(api_keys::load_file(f.str("api-key-file")));
  if (f.has("auth-allowlist")) {
    fo.auth_allowlist.clear();
    std::string list = f.str("auth-allowlist");
    for (size_t p = 0; p <= list.size();) {
      size_t e = std::min(list.find(',', p), list.size());
      std::string path = list.substr(p, e - p);
      if (!path.empty() && path[0] != '/')
        throw usage_error("flag --auth-allowlist: '" + path + "' is not an absolute path; use e.g. /health,/metrics");
      if (!path.empty()) fo.auth_allowlist.push_back(path);
      p = e + 1;
    }
  }
  const std::string& h = fo.host;
  bool loopback = h == "localhost" || h == "::1" || h.rfind("127.", 0) == 0;
  if (!loopback && (!fo.keys || fo.keys->empty()))
    spdlog::warn("tandem serve: binding {} without API keys: anyone who can reach these ports can generate and inspect; "
                 "pass --api-key-file FILE (or [security] api_key_file) or bind 127.0.0.1 (docs/security.md)",
                 h);
}

/// The supervisor's report once it gave up on this node's actors (set from an actor thread).
struct escalation {
  std::mutex m;
  std::string why;
};

/// TANDEM_WORKER_FAULT (a test hook, like TANDEM_KV_FAULT) and the exit on escalation: a node
/// whose restart budget is spent stops serving and exits non-zero with the supervisor's report,
/// so a process manager (systemd's Restart=on-failure and its start limit) takes over.
void configure_supervision(cluster_options& co, const std::shared_ptr<escalation>& esc) {
  const char* wf = std::getenv("TANDEM_WORKER_FAULT");
  const std::string fault = wf ? wf : "";
  if (!fault.empty() && fault != "start")
    throw tandem::error("TANDEM_WORKER_FAULT = '" + fault + "' is not a fault; use start (every worker fails as it starts)");
  auto prev = co.configure_node;
  co.configure_node = [prev, fault, esc](actor_cluster_options& ao) {
    if (prev) prev(ao);
    ao.worker_fails_at_start = fault == "start";
    ao.on_escalate = [esc](const std::string& why) {
      {
        std::lock_guard<std::mutex> l(esc->m);
        esc->why = why;
      }
      // The front end's event loop takes SIGTERM as its stop; the report is thrown after it.
      ::kill(::getpid(), SIGTERM);
    };
  };
}

/// The --chat-template-file text, parsed once here so that a bad template stops serve at
/// start with its line and column instead of failing every chat request.
std::string read_chat_template(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tandem::error("flag --chat-template-file: cannot read '" + path + "'; pass a readable Jinja template file");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) throw tandem::error("flag --chat-template-file: '" + path + "' is empty");
  try {
    jinja::template_ check(text);
  } catch (const jinja::error& e) {
    throw tandem::error(fmt::format("flag --chat-template-file: '{}': {}; fix the template", path, e.what()));
  }
  return text;
}

/// Every flag of `tandem serve` but the limits' (declare_limit_flags).
void declare_serve_flags(flags& f) {
  f.opt("model", "GGUF model file (required)")
      .opt("host", "address to bind; 0.0.0.0 exposes the node to the network", "127.0.0.1")
      .opt("port", "HTTP port (OpenAI API); 0 picks a free port", "8080")
      .opt("rpc-port", "Cap'n Proto RPC port; 0 picks a free port", "8081")
      .opt("admin-port", "admin port for `tandem inspect`; 0 picks a free port (default: no admin port)")
      .opt("log-level", "trace, debug, info, warn, error", "info")
      .opt("log-format", "text, or json: one object per line with ts, level, actor, request_id, msg", "text")
      .opt("config", "cluster config file (TOML, see docs/config.md); checked like `tandem check-config` first")
      .opt("node", "with --config: the [[node]] of the config this process runs")
      .opt("host-ratio", "host KV cache tier (L2) as a multiple of the device pool; 0 = none", "0")
      .opt("host-size-gb", "host KV cache tier (L2) in GiB (instead of --host-ratio)", "0")
      .opt("cache-write-policy", "write_through, write_through_selective or write_back", "write_through_selective")
      .opt("cache-disk-dir", "directory of the disk KV cache tier (L3); empty = none")
      .opt("cache-disk-size-gb", "bound of the disk tier in GiB", "0")
      .opt("min-load-back-tokens", "shorter host/disk hits are recomputed (0 = one page)", "0")
      .opt("api-key-file", "API keys, one per line (chmod 600); every HTTP route but --auth-allowlist, the RPC and the admin port then need one")
      .opt("auth-allowlist", "comma-separated HTTP paths served without a key", "/health,/health/ready")
      .opt("router-policy", "round_robin, power_of_two or cache_aware", "round_robin")
      .opt("kernels",
           "CPU kernel path: best (the widest vector path), scalar, avx2, avx512, or amx (f16/bf16 matmuls on "
           "AMX tiles: faster prefill and large decode batches, slower batch-1 decode)",
           "best")
      .opt("backend", "what the model runs on: cpu, or cuda (a build with -DTANDEM_CUDA=ON and a GPU)", "cpu")
      .opt("device", "the CUDA device index with --backend cuda", "0")
      .opt("kv-cache-dtype",
           "KV cache element type: f32, or f16 (half the memory per cached token and half the bytes a decode "
           "step's attention reads; values rounded to 11 significant bits)",
           "f32")
      .opt("router-migration", "on: a stream whose decode node is lost continues on another; off: it ends with an error",
           "on")
      .opt("chat-template-file",
           "a Jinja chat template that replaces the model's tokenizer.chat_template for /v1/chat/completions "
           "(default: the model's, else the Llama-2 format; docs/chat_templates.md)");
}

/// Fills the options from the flags (serve --model, without --config).
void configure_from_flags(const flags& f, cluster_options& co) {
  if (f.has("node")) throw usage_error("--node NAME needs --config FILE");
  if (f.str("model").empty()) throw usage_error("--model FILE is required (write one with `tandem make-model`)");
  co.model_path = f.str("model");
  read_limit_flags(f, co.lim);
  const auto policy = parse_route_policy(f.str("router-policy"));
  if (!policy)
    throw tandem::error(error_kind::failed, "router policy '" + f.str("router-policy") +
                                                "' is not a policy; use round_robin, power_of_two or cache_aware");
  co.policy.kind = *policy;
  co.kernel_isa = f.str("kernels");
  co.kv_cache_dtype = f.str("kv-cache-dtype");
  co.device = select_backend(f.str("backend"), static_cast<int32_t>(f.num("device")));
  if (f.str("router-migration") != "on" && f.str("router-migration") != "off")
    throw usage_error("flag --router-migration = '" + f.str("router-migration") + "' is not a switch; use on or off");
  co.lim.router_migration = f.str("router-migration") == "on";
  co.ports.host = f.str("host");
  co.ports.http = port_flag(f, "port");
  co.ports.rpc = port_flag(f, "rpc-port");
  co.ports.admin = f.has("admin-port") ? port_flag(f, "admin-port") : -1;
  co.cache.host_ratio = f.real("host-ratio");
  co.cache.host_size_gb = f.real("host-size-gb");
  if (!parse_cache_write_policy(f.str("cache-write-policy"), co.cache.write_policy))
    throw usage_error("flag --cache-write-policy = '" + f.str("cache-write-policy") +
                        "' is not a policy; use write_through, write_through_selective or write_back");
  co.cache.disk_dir = f.str("cache-disk-dir");
  co.cache.disk_size_gb = f.real("cache-disk-size-gb");
  const int64_t min_lb = f.num("min-load-back-tokens");
  if (min_lb < 0 || min_lb > INT32_MAX)
    throw usage_error("flag --min-load-back-tokens = " + std::to_string(min_lb) +
                        " must be a token count >= 0 (0 = one page)");
  co.cache.min_load_back_tokens = static_cast<int32_t>(min_lb);
}

}  // namespace

int serve(args a) {
  flags f;
  declare_serve_flags(f);
  declare_limit_flags(f);
  if (!f.parse(a)) {
    std::fprintf(stderr, "usage: tandem serve --model FILE [options]\n       tandem serve --config FILE --node NAME\n%s",
                 f.help().c_str());
    return 0;
  }
  cluster_options co;
  front_end_options fo;
  co.log_level = f.str("log-level");
  if (f.str("log-format") != "text" && f.str("log-format") != "json")
    throw usage_error("flag --log-format = '" + f.str("log-format") + "' is not a format; use text or json");
  co.log_json = f.str("log-format") == "json";
  // The front ends log through spdlog's default logger: same format as the actors'.
  if (co.log_json) spdlog::default_logger()->set_formatter(make_json_log_formatter());
  if (f.has("config")) {
    configure_from_file(f, co, fo);
  } else {
    configure_from_flags(f, co);
  }
  // The front ends bind where the node's spec says (its [[node]], or the flags above).
  fo.host = co.ports.host;
  fo.http_port = co.ports.http;
  fo.rpc_port = co.ports.rpc;
  fo.admin_port = co.ports.admin;
  configure_security(f, fo);
  auto esc = std::make_shared<escalation>();
  configure_supervision(co, esc);
  if (auto msg = co.lim.validate(); !msg.empty()) throw usage_error(msg);  // flags (--config is checked above)
  auto level = spdlog::level::from_str(co.log_level);
  if (level == spdlog::level::off && co.log_level != "off")
    throw usage_error("flag --log-level = '" + co.log_level + "' is not a level; use trace, debug, info, warn or error");
  spdlog::set_level(level);

  fo.lim = co.lim;
  fo.handle_signals = true;
  if (const std::string ct = f.str("chat-template-file"); !ct.empty()) fo.chat_template = read_chat_template(ct);

  // Signals must be captured before the cluster starts its threads, so they inherit the mask.
  kj::UnixEventPort::captureSignal(SIGINT);
  kj::UnixEventPort::captureSignal(SIGTERM);
  std::signal(SIGPIPE, SIG_IGN);

  auto cluster = embedded_cluster::start(co);
  for (const auto& w : cluster->tok().warnings()) spdlog::warn("tandem serve: {}", w);
  front_end fe(*cluster, fo);
  fe.run([](const listener_info& l) {
    std::printf("tandem: %s listening on %s:%u\n", l.what.c_str(), l.host.c_str(), static_cast<unsigned>(l.port));
    std::fflush(stdout);
  });
  {
    std::lock_guard<std::mutex> l(esc->m);
    if (!esc->why.empty())
      throw tandem::error(error_kind::failed, esc->why + "; tandem serve stopped (exit 1)");
  }
  spdlog::info("tandem serve: stopped");
  return 0;
}

}  // namespace tandem::cli
