#include "actors/config/cluster_config.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "actors/config/cache_table.h"
#include "actors/config/config_checker.h"
#include "actors/config/node_memory.h"
#include "actors/config/node_table.h"
#include "actors/common/limits_table.h"
#include "actors/config/toml.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/arch/registry.h"
#include "kernels/model/kv_pool.h"

namespace tandem {

namespace {

using toml::value;
using toml::value_type;
using config_detail::checker;
using config_detail::article_type;
using config_detail::fmt_gib;
using config_detail::gib;
using config_detail::is_local_host;


/// [security]: the key file must exist and be private (the same rules `tandem serve` enforces
/// when it reads the keys); allowlisted paths are absolute.
void check_security(checker& ck, const value& t, cluster_config& cfg) {
  ck.known_keys(t, "security", {"api_key_file", "auth_allowlist"});
  if (ck.string(t, "security", "api_key_file", cfg.api_key_file)) {
    const value* v = t.find("api_key_file");
    struct stat st {};
    if (cfg.api_key_file.empty())
      ck.error(v->pos, "security.api_key_file", v, "is empty; give a file with one key per line, or drop the key (auth off)");
    else if (::stat(cfg.api_key_file.c_str(), &st) != 0)
      ck.error(v->pos, "security.api_key_file", v,
               fmt::format("{}; create it with one key per line (e.g. `openssl rand -hex 32 > FILE`) and chmod 600 it",
                           std::strerror(errno)));
    else if (!S_ISREG(st.st_mode))
      ck.error(v->pos, "security.api_key_file", v, "is not a regular file; give a file with one key per line");
    else if (st.st_mode & (S_IRWXG | S_IRWXO))
      ck.error(v->pos, "security.api_key_file", v,
               fmt::format("is accessible by group or others (mode {:03o}); run `chmod 600 {}`", st.st_mode & 0777,
                           cfg.api_key_file));
  }
  if (const value* v = t.find("auth_allowlist")) {
    bool ok = v->type == value_type::array;
    std::vector<std::string> paths;
    if (ok)
      for (const auto& e : v->items) {
        if (e.type != value_type::string || e.str.empty() || e.str[0] != '/') ok = false;
        else paths.push_back(e.str);
      }
    if (!ok)
      ck.error(v->pos, "security.auth_allowlist", v,
               "expected an array of absolute paths; write auth_allowlist = [\"/health\"] (add \"/metrics\" for an "
               "unauthenticated Prometheus scrape)");
    else
      cfg.auth_allowlist = std::move(paths);
  }
}

struct model_kv {
  bool known = false;
  model_config config;  ///< what the architecture module read (shapes the KV layout)
  int32_t n_ctx = 0;
  /// Bytes of the copy `kernels = "amx"` makes of the f16/bf16 matmul weights (padded to
  /// whole 16 x 32 tiles, as amx_pack does).
  uint64_t amx_copy_bytes = 0;
  /// Bytes of the packed copy of the low-bit matmul weights (kernels/cpu/quant_packed.h).
  uint64_t packed_copy_bytes = 0;
  /// Bytes in the file of every matmul weight, of those that would be packed, and of the
  /// f16/bf16 ones the amx copy takes: what is left is copied into memory as it is
  /// (kernels/cpu/weight_copy.h).
  uint64_t matmul_bytes = 0, packable_bytes = 0, amx_taken_bytes = 0;
  kv_dtype dtype = kv_dtype::f32;  ///< [model] kv_cache_dtype
  kv_layout layout(int32_t page_size) const { return model_kv_layout(config, page_size, dtype); }
  kv_pools_layout pools(int32_t page_size) const { return model_pools_layout(config, page_size, dtype); }
};

/// The KV shape from GGUF metadata alone, read by the same architecture module the loader
/// uses (kernels/model/arch), without touching the weights.
model_kv read_model_kv(const std::string& path) {
  auto f = gguf::file::open(path);
  model_kv m;
  m.config = arch::read_config(f);
  m.n_ctx = m.config.n_ctx;
  // The matmul weights: every 2-D tensor but the embedding table, which is a matmul only as
  // the tied output (no output.weight).
  const bool tied = f.find_tensor("output.weight") == nullptr;
  for (const auto& t : f.tensors()) {
    if (t.name == "token_embd.weight" && !tied) continue;
    // Low-bit weights pack per 2-D slice, so a MoE layer's 3-D expert tensors count too.
    if (t.dims.size() != 2 && t.dims.size() != 3) continue;
    m.matmul_bytes += t.nbytes;
    if (cpu::has_packed_layout(t.type)) {
      m.packed_copy_bytes += cpu::packed_copy_bytes(t.view());
      m.packable_bytes += t.nbytes;
    }
    if (t.dims.size() != 2 || (t.type != ggml_type::f16 && t.type != ggml_type::bf16)) continue;
    m.amx_copy_bytes += cpu::amx_packed_bytes(t.view());
    m.amx_taken_bytes += t.nbytes;
  }
  m.known = true;
  return m;
}

/// [limits]: every field of the limits table, typed and in range (true: `threads` was set).
bool read_limits(checker& ck, const value& lim_t_ref, cluster_config& cfg) {
  const value* lim_t = &lim_t_ref;
  bool limits_threads_set = false;
  std::vector<std::string> known;
  for (const auto& f : limit_fields()) known.push_back(f.key);
  ck.known_keys(*lim_t, "limits", known);
  for (const auto& f : limit_fields()) {
    if (!f.is_integer()) {
      bool b = false;
      if (ck.boolean(*lim_t, "limits", f.key, b)) f.set(cfg.lim, b);
      continue;
    }
    int64_t v = 0;
    if (ck.integer(*lim_t, "limits", f.key, f.min, f.max, f.fix, v)) {
      f.set(cfg.lim, v);
      if (std::string(f.key) == "threads") limits_threads_set = true;
    }
  }
  return limits_threads_set;
}

/// [model]: path, cache type, backend and device, kernel path, threads (where the path is).
toml::position read_model_table(checker& ck, const value& t_ref, const machine_info& m, bool limits_threads_set,
                                cluster_config& cfg) {
  const value* t = &t_ref;
  toml::position model_path_pos{1, 1};
  ck.known_keys(*t, "model", {"path", "threads", "kernels", "kv_cache_dtype", "backend", "device"});
  ck.choice(*t, "model", "kv_cache_dtype", {"f32", "f16"}, cfg.kv_cache_dtype);
  int64_t dev = 0;
  if (ck.integer(*t, "model", "device", 0, 1023, "use the CUDA device index, e.g. 0", dev))
    cfg.device = static_cast<int32_t>(dev);
  if (ck.choice(*t, "model", "backend", {"cpu", "cuda"}, cfg.backend) && cfg.backend == "cuda") {
    const value* b = t->find("backend");
    if (m.cuda_devices < 0)
      ck.error(b->pos, "model.backend", b,
               "this tandem was built without the CUDA backend; rebuild it with -DTANDEM_CUDA=ON (cmake --preset "
               "cuda, needs nvcc) or use backend = \"cpu\"");
    else if (cfg.device >= m.cuda_devices)
      ck.error(b->pos, "model.backend", b,
               m.cuda_devices == 0
                   ? std::string("no CUDA device is visible here (no driver or no GPU); use backend = \"cpu\"")
                   : fmt::format("[model] device = {} but this machine has {} CUDA device{}; use a device in "
                                 "0..{}",
                                 cfg.device, m.cuda_devices, m.cuda_devices == 1 ? "" : "s", m.cuda_devices - 1));
  }
  // The kernel path: every name is checked, and one this machine cannot run is refused
  // here rather than when the worker builds the model.
  std::vector<std::string> paths;
  for (cpu_isa i : cpu::all_isas) paths.emplace_back(cpu::to_string(i));
  if (ck.choice(*t, "model", "kernels", paths, cfg.kernel_isa) && !m.kernel_paths.empty() &&
      std::find(m.kernel_paths.begin(), m.kernel_paths.end(), cfg.kernel_isa) == m.kernel_paths.end()) {
    std::string list;
    for (const auto& k : m.kernel_paths) list += (list.empty() ? "" : ", ") + k;
    ck.error(t->find("kernels")->pos, "model.kernels", t->find("kernels"),
             fmt::format("this machine cannot run the {} kernels; use one of: {}", cfg.kernel_isa, list));
  }
  if (ck.string(*t, "model", "path", cfg.model_path)) {
    model_path_pos = t->find("path")->pos;
    if (cfg.model_path.empty())
      ck.error(model_path_pos, "model.path", t->find("path"), "is empty; give the GGUF file every node loads, or drop the key");
  }
  int64_t th = 0;
  if (ck.integer(*t, "model", "threads", 1, 4096, "use the number of cores to compute on", th)) {
    if (limits_threads_set && th != cfg.lim.threads)
      ck.error(t->find("threads")->pos, "model.threads", t->find("threads"),
               fmt::format("conflicts with limits.threads = {}; set only one of them", cfg.lim.threads));
    cfg.lim.threads = int32_t(th);
  }
  return model_path_pos;
}

/// [router]: the target policy, cache_aware's balance thresholds, migration.
void read_router(checker& ck, const value& t_ref, cluster_config& cfg) {
  const value* t = &t_ref;
  ck.known_keys(*t, "router", {"policy", "balance_abs_tokens", "balance_rel", "migration"});
  ck.choice(*t, "router", "policy", {"round_robin", "power_of_two", "cache_aware"}, cfg.router_policy);
  // cache_aware leaves a target with the cached prefix once it holds more than
  // balance_abs_tokens more queued tokens than the least loaded one AND more than
  // balance_rel times as many: below 1x every choice would fall back (no cache affinity).
  int64_t abs_tokens = 0;
  if (ck.integer(*t, "router", "balance_abs_tokens", 0, int64_t(1) << 40,
                 "use e.g. 2048 (prompt tokens; 0 = the relative threshold alone decides)", abs_tokens))
    cfg.router_balance_abs_tokens = abs_tokens;
  double rel = 0;
  if (ck.real(*t, "router", "balance_rel", 1.0, 1e6,
              "use e.g. 1.5 (times the least loaded target's queued tokens; 1 = balance as soon as busier)", rel))
    cfg.router_balance_rel = rel;
  ck.boolean(*t, "router", "migration", cfg.lim.router_migration);
}

/// Where check_model_and_memory reports (the positions of [limits], [cache], model.path).
struct config_positions {
  toml::position lim, cache, model_path;
};

/// The model's KV layout (when the file is here) and each node's pools and memory on this machine.
void check_model_and_memory(const std::string& source_name, const machine_info& m,
                            const std::vector<const value*>& node_tables, const config_positions& pos,
                            config_check& out) {
  const cluster_config& cfg = out.cfg;
  const toml::position lim_pos = pos.lim, cache_pos = pos.cache, model_path_pos = pos.model_path;
  // Nodes on this machine: the model file must be readable here, and their memory is counted.
  auto on_this_machine = [&](const node_config& n) { return n.name == m.node || is_local_host(n.host); };
  std::string local_names;
  for (const auto& n : cfg.nodes)
    if (on_this_machine(n)) local_names += (local_names.empty() ? "'" : ", '") + n.name + "'";
  if (!m.node.empty() && !cfg.find_node(m.node) && !cfg.nodes.empty()) {
    std::string names;
    for (const auto& n : cfg.nodes) names += (names.empty() ? "" : ", ") + n.name;
    out.errors.push_back(fmt::format("{}:1:1: node: there is no node '{}' (--node); use one of: {}", source_name, m.node,
                                     names));
  }
  model_kv kv;
  std::error_code model_ec;
  const bool model_here = !cfg.model_path.empty() && std::filesystem::exists(cfg.model_path, model_ec);
  if (model_here) {
    try {
      kv = read_model_kv(cfg.model_path);
      parse_kv_dtype(cfg.kv_cache_dtype, kv.dtype);  // checked above: f32 or f16
      (void)kv.layout(16);  // a cache type the architecture cannot hold (f16 for MLA) fails here
    } catch (const std::exception& e) {
      kv = model_kv{};
      out.errors.push_back(fmt::format("{}:{}:{}: model.path = \"{}\": is not a usable GGUF model ({}); point it at a "
                                       "model written by llama.cpp or `tandem make-model`",
                                       source_name, model_path_pos.line, model_path_pos.column, cfg.model_path, e.what()));
    }
  } else if (!cfg.model_path.empty() && !local_names.empty()) {
    // `tandem serve` of these nodes would fail loading it: refuse now, once, with the fix.
    out.errors.push_back(fmt::format(
        "{}:{}:{}: model.path = \"{}\": {}; node{} {} run{} on this machine and load{} it: copy the model here or fix "
        "the path",
        source_name, model_path_pos.line, model_path_pos.column, cfg.model_path,
        model_ec ? model_ec.message() : std::string("no such file"), local_names.find(',') == std::string::npos ? "" : "s",
        local_names, local_names.find(',') == std::string::npos ? "s" : "", local_names.find(',') == std::string::npos ? "s" : ""));
  } else if (!cfg.model_path.empty()) {
    out.notes.push_back(fmt::format("model.path = \"{}\" is not on this machine and no node of this config runs here: the "
                                    "KV layout checks were skipped; run `tandem check-config --node NAME` on each node's "
                                    "machine",
                                    cfg.model_path));
  } else if (!m.node.empty()) {
    out.errors.push_back(fmt::format("{}:1:1: model.path: is not set, and node '{}' needs it; add [model] path = "
                                     "\"FILE.gguf\"",
                                     source_name, m.node));
  }
  if (kv.known && cfg.lim.max_context > kv.n_ctx)
    out.errors.push_back(fmt::format("{}:{}:{}: limits.max_context = {}: the model's context is {} tokens; use at most {} "
                                     "(0 = the model's)",
                                     source_name, lim_pos.line, lim_pos.column, cfg.lim.max_context, kv.n_ctx, kv.n_ctx));
  // Each node's pools and tiers, and whether they fit this machine (node_memory.cpp).
  config_detail::node_memory_inputs mem;
  mem.source_name = source_name;
  mem.lim_pos = lim_pos;
  mem.cache_pos = cache_pos;
  for (size_t i = 0; i < cfg.nodes.size(); ++i) {
    const value* own = i < node_tables.size() ? node_tables[i]->find("cache") : nullptr;
    mem.node_cache_pos.push_back(own && own->type == value_type::table ? own->pos : cache_pos);
  }
  if (kv.known) {
    mem.model.layout = [kv](int32_t ps) { return kv.layout(ps); };
    mem.model.pools = [kv](int32_t ps) { return kv.pools(ps); };
    mem.model.n_ctx = kv.n_ctx;
    if (cfg.kernel_isa == "amx") mem.amx_copy_bytes = kv.amx_copy_bytes;
    const bool packs = m.packs_low_bit && cfg.kernel_isa != "scalar" && cfg.kernel_isa != "avx2";
    if (packs) mem.packed_copy_bytes = kv.packed_copy_bytes;
    if (m.copies_weights && cfg.backend == "cpu")
      mem.weight_copy_bytes = kv.matmul_bytes - (packs ? kv.packable_bytes : 0) -
                              (cfg.kernel_isa == "amx" ? kv.amx_taken_bytes : 0);
  }
  mem.on_this_machine = on_this_machine;
  config_detail::check_node_memory(mem, m, out);
}

}  // namespace

config_check check_cluster_config(const std::string& text, const std::string& source_name, const machine_info& m) {
  config_check out;
  cluster_config& cfg = out.cfg;
  value root;
  try {
    root = toml::parse(text, source_name);
  } catch (const toml::parse_error& e) {
    out.errors.push_back(std::string(e.what()) + " (syntax error; nothing else was checked)");
    return out;
  }
  checker ck(source_name, out.errors);
  ck.known_keys(root, "", {"limits", "model", "cache", "node", "router", "transfer", "security"});
  size_t errors_before_limits = out.errors.size();

  // --- [limits]
  const value* lim_t = ck.table(root, "limits");
  const bool limits_threads_set = lim_t && read_limits(ck, *lim_t, cfg);
  toml::position lim_pos = lim_t ? lim_t->pos : toml::position{1, 1};

  // --- [model]
  toml::position model_path_pos{1, 1};
  if (const value* t = ck.table(root, "model")) model_path_pos = read_model_table(ck, *t, m, limits_threads_set, cfg);

  // Cross-field limits (only once every field was readable, so one mistake is not reported twice).
  if (out.errors.size() == errors_before_limits) {
    if (auto msg = cfg.lim.validate(); !msg.empty())
      out.errors.push_back(fmt::format("{}:{}:{}: {}", source_name, lim_pos.line, lim_pos.column, msg));
  }

  // --- [cache] (types and ranges; the tier's own rules live in validate_cache_config)
  toml::position cache_pos{1, 1};
  if (const value* t = ck.table(root, "cache")) {
    cache_pos = t->pos;
    config_detail::read_cache_table(ck, *t, "cache", cfg.cache);
    // The checks that need the model's KV layout (size_kv_pools) run with the layout below.
  }

  // --- [router], [transfer]
  if (const value* t = ck.table(root, "router")) read_router(ck, *t, cfg);
  if (const value* t = ck.table(root, "transfer")) {
    ck.known_keys(*t, "transfer", {"failure_policy", "timeout_ms"});
    std::string policy = to_string(cfg.transfer_failure_policy);
    if (ck.choice(*t, "transfer", "failure_policy", {"recompute", "fail"}, policy))
      cfg.transfer_failure_policy = parse_kv_failure_policy(policy).value_or(cfg.transfer_failure_policy);
    int64_t v = 0;
    if (ck.integer(*t, "transfer", "timeout_ms", 1, 3600000, "use e.g. 10000 (10 s)", v))
      cfg.transfer_timeout_ms = int32_t(v);
  }

  // --- [security]
  if (const value* t = ck.table(root, "security")) check_security(ck, *t, cfg);

  // --- [[node]], and the rules across nodes (node_table.cpp)
  const std::vector<const value*> node_tables = config_detail::read_nodes(ck, root, source_name, m, cfg, out.errors);
  if (!node_tables.empty()) config_detail::check_node_roles(ck, cfg, node_tables, root.find("node")->pos);

  // --- the model's KV layout and memory
  check_model_and_memory(source_name, m, node_tables, {lim_pos, cache_pos, model_path_pos}, out);
  return out;
}

config_check check_cluster_config_file(const std::string& path, const machine_info& m) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tandem::error(fmt::format("cannot read config file '{}'; check the path and its permissions", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw tandem::error(fmt::format("error reading config file '{}'", path));
  return check_cluster_config(ss.str(), path, m);
}

}  // namespace tandem
