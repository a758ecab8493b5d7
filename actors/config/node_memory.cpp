#include "actors/config/node_memory.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <system_error>

#include "actors/common/cache_config.h"
#include "actors/config/cache_table.h"
#include "actors/config/config_checker.h"

namespace tandem::config_detail {

void check_node_memory(const node_memory_inputs& in, const machine_info& m, config_check& out) {
  // Each node's pools, sized by the code `tandem serve` runs (size_kv_pools), unless a cache
  // table already has errors of its own (the same problem would be reported twice in other words).
  const bool cache_table_errors = std::any_of(out.errors.begin(), out.errors.end(), [](const std::string& e) {
    return e.find(": cache.") != std::string::npos || e.find(".cache.") != std::string::npos;
  });
  std::set<std::string> cache_msgs;
  uint64_t local_bytes = 0;
  std::map<int32_t, uint64_t> numa_bytes;
  std::vector<std::string> local_users;
  for (size_t i = 0; i < out.cfg.nodes.size(); ++i) {
    const auto& n = out.cfg.nodes[i];
    if (!n.has_role("cache")) continue;
    // Problems of a node's own [node.cache] are reported there; else at the cluster's [cache].
    const toml::position where = i < in.node_cache_pos.size() ? in.node_cache_pos[i] : in.cache_pos;
    double device_bytes = double(out.cfg.lim.kv_cache_mb) * 1024.0 * 1024.0, host_bytes = 0;
    if (in.model.pools) {
      // The plan `tandem serve --node` makes of this node (actor_cluster); RAM: over all local nodes below.
      const node_plan np = plan_node(spec_of(out.cfg, n), in.model, 0);
      const kv_layout& layout = np.layout;
      const kv_pools_layout& set = np.pools;
      const kv_sizing& k = np.sizing;
      device_bytes = 0;
      node_kv_plan plan;
      plan.node = n.name;
      plan.numa_node = n.numa_node;
      for (size_t p = 0; p < set.pools.size() && p < k.pool_pages.size(); ++p) {
        const uint64_t b = uint64_t(k.pool_pages[p]) * uint64_t(set.pools[p].page.page_bytes());
        device_bytes += double(b);
        const bool h = p < k.host_pool_pages.size();
        plan.pools.push_back({set.pools[p].name, set.pools[p].window_tokens, k.pool_pages[p], b,
                              h ? k.host_pool_pages[p] : 0, h ? k.host_pool_bytes[p] : 0,
                              uint64_t(k.disk_pages) * cache_disk_file_bytes(set.pools[p].page)});
        if (h) host_bytes += double(k.host_pool_bytes[p]);
      }
      plan.host_bytes = uint64_t(host_bytes);
      plan.disk_blocks = k.disk_pages;
      plan.disk_bytes = uint64_t(k.disk_pages) * cache_disk_block_bytes(set);
      if (k.ok()) out.plans.push_back(std::move(plan));
      if (k.device_pages < 1) {
        const size_t pb = layout.page_bytes();
        out.errors.push_back(fmt::format(
            "{}:{}:{}: limits.kv_cache_mb = {}: holds no page of node '{}' ({} bytes per page: {}); raise kv_cache_mb to "
            "at least {}",
            in.source_name, in.lim_pos.line, in.lim_pos.column, out.cfg.lim.kv_cache_mb, n.name, pb, layout.describe(),
            (pb + (1u << 20) - 1) >> 20));
      } else if (!cache_table_errors) {
        for (const auto& msg : k.problems)
          if (cache_msgs.insert(fmt::format("{}:{}", where.line, msg)).second)
            out.errors.push_back(fmt::format("{}:{}:{}: {}{}", in.source_name, where.line, where.column,
                                             where.line == in.cache_pos.line ? "" : fmt::format("node '{}': ", n.name), msg));
      }
    } else {
      // The layout is unknown here (model elsewhere): what the settings alone say.
      if (out.cfg.lim.device_pages > 0) device_bytes = 0;
      host_bytes = n.cache.host_size_gb > 0 ? n.cache.host_size_gb * gib : n.cache.host_ratio * device_bytes;
    }
    if (!in.on_this_machine(n)) continue;
    // On the CPU backend the device pool is host memory as well.
    uint64_t need = uint64_t(device_bytes + host_bytes);
    local_bytes += need;
    local_users.push_back(fmt::format("'{}' {}", n.name, fmt_gib(double(need))));
    if (n.numa_node >= 0) numa_bytes[n.numa_node] += need;
  }
  // The disk tier of each node on this machine, where its directory is.
  std::error_code ec;
  std::set<std::string> disk_dirs;
  for (const auto& n : out.cfg.nodes) {
    const cache_config& c = n.cache;
    if (!n.has_role("cache") || !in.on_this_machine(n) || c.disk_dir.empty() || !disk_dirs.insert(c.disk_dir).second)
      continue;
    if (!std::filesystem::exists(c.disk_dir, ec)) continue;
    if (!std::filesystem::is_directory(c.disk_dir, ec)) {
      out.errors.push_back(fmt::format("{}:{}:{}: cache.disk_dir = \"{}\": is not a directory; point it at a directory "
                                       "for the disk tier's files",
                                       in.source_name, in.cache_pos.line, in.cache_pos.column, c.disk_dir));
    } else if (struct statvfs fs{}; ::statvfs(c.disk_dir.c_str(), &fs) == 0) {
      double capacity = double(fs.f_blocks) * double(fs.f_frsize);
      if (c.disk_size_gb * gib > capacity)
        out.errors.push_back(fmt::format(
            "{}:{}:{}: cache.disk_size_gb = {}: the filesystem of cache.disk_dir = \"{}\" holds only {}; lower "
            "disk_size_gb or use a larger disk",
            in.source_name, in.cache_pos.line, in.cache_pos.column, c.disk_size_gb, c.disk_dir, fmt_gib(capacity)));
    }
  }
  // Each worker on this machine also holds the copies its kernels make of the weights: the
  // amx tile layout of the f16/bf16 ones (kernels = "amx"), the packed low-bit ones (AVX-512
  // VNNI), and on the CPU backend the rest copied out of the file's mapping.
  auto per_worker = [&](uint64_t bytes, const char* what) {
    if (bytes == 0) return;
    for (const auto& n : out.cfg.nodes) {
      if (!n.has_role("worker") || !in.on_this_machine(n)) continue;
      local_bytes += bytes;
      local_users.push_back(fmt::format("'{}' {} {}", n.name, what, fmt_gib(double(bytes))));
      if (n.numa_node >= 0) numa_bytes[n.numa_node] += bytes;
    }
  };
  per_worker(in.amx_copy_bytes, "amx weight copy");
  per_worker(in.packed_copy_bytes, "packed low-bit weight copy");
  per_worker(in.weight_copy_bytes, "in-memory weight copy");
  const bool amx_copies = in.amx_copy_bytes > 0, packed_copies = in.packed_copy_bytes > 0,
             weight_copies = in.weight_copy_bytes > 0;
  if (m.mem_total_bytes > 0 && local_bytes > m.mem_total_bytes) {
    std::string list;
    for (const auto& s : local_users) list += (list.empty() ? "" : ", ") + s;
    out.errors.push_back(fmt::format(
        "{}:{}:{}: cache: the KV pools of the nodes on this machine need {} ({}) but it has {} of RAM; lower "
        "cache.host_size_gb / cache.host_ratio or limits.kv_cache_mb{}",
        in.source_name, in.cache_pos.line, in.cache_pos.column, fmt_gib(double(local_bytes)), list, fmt_gib(double(m.mem_total_bytes)),
        std::string(amx_copies ? ", or drop model.kernels = \"amx\" (it copies the weights)" : "") +
            (packed_copies ? ", or run with TANDEM_PACK=0 (no packed copy of the low-bit weights, slower prefill)"
                           : "") +
            (weight_copies ? ", or run with TANDEM_COPY_WEIGHTS=0 (the kernels read the mmapped file: no copy, "
                             "slower decode)"
                           : "")));
  }
  for (auto [id, bytes] : numa_bytes) {
    if (size_t(id) >= m.numa_node_bytes.size() || m.numa_node_bytes[size_t(id)] == 0) continue;
    if (bytes > m.numa_node_bytes[size_t(id)])
      out.errors.push_back(fmt::format(
          "{}:{}:{}: cache: the KV pools pinned to NUMA node {} need {} but that node has {}; lower the cache sizes or "
          "spread the nodes over NUMA nodes",
          in.source_name, in.cache_pos.line, in.cache_pos.column, id, fmt_gib(double(bytes)),
          fmt_gib(double(m.numa_node_bytes[size_t(id)]))));
  }
}

}  // namespace tandem::config_detail
