// The plain parts of the cluster config: node and cluster lookups, the role names, the
// did-you-mean suggestions, and what the checks know about this machine (machine_info).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "actors/config/cluster_config.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/quant_packed.h"
#include "kernels/cpu/weight_copy.h"

namespace tandem {

bool node_config::has_role(const std::string& r) const { return std::find(roles.begin(), roles.end(), r) != roles.end(); }

bool node_config::all_roles() const {
  for (const auto& r : node_roles())
    if (!has_role(r)) return false;
  return true;
}

std::vector<const node_config*> cluster_config::nodes_with_role(const std::string& role) const {
  std::vector<const node_config*> v;
  for (const auto& n : nodes)
    if (n.has_role(role)) v.push_back(&n);
  return v;
}

const node_config* cluster_config::find_node(const std::string& name) const {
  for (const auto& n : nodes)
    if (n.name == name) return &n;
  return nullptr;
}

const std::vector<std::string>& node_roles() {
  static const std::vector<std::string> roles = {"router", "prefill", "decode", "cache", "worker"};
  return roles;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  size_t allowed = std::max<size_t>(2, word.size() / 3);
  return best_d <= allowed ? best : "";
}

namespace {

uint64_t meminfo_kb(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto k = line.find(key + ":");
    if (k == std::string::npos) continue;
    std::istringstream rest(line.substr(k + key.size() + 1));
    uint64_t kb = 0;
    rest >> kb;
    return kb;
  }
  return 0;
}

}  // namespace

machine_info machine_info::probe(const std::string& node) {
  machine_info m;
  m.node = node;
  m.mem_total_bytes = meminfo_kb("/proc/meminfo", "MemTotal") * 1024;
  m.mem_available_bytes = meminfo_kb("/proc/meminfo", "MemAvailable") * 1024;
  m.cpus = int32_t(std::thread::hardware_concurrency());
  for (cpu_isa i : cpu::all_isas)
    if (cpu::isa_supported(i)) m.kernel_paths.emplace_back(cpu::to_string(i));
  m.packs_low_bit = cpu::packs(ggml_type::q4_0) && cpu::packing_enabled();
  m.copies_weights = cpu::weight_copy_enabled();
  // NUMA nodes as the kernel reports them (what libnuma reads too); ids are dense in practice.
  for (int32_t n = 0;; ++n) {
    std::string p = fmt::format("/sys/devices/system/node/node{}/meminfo", n);
    if (!std::filesystem::exists(p)) break;
    m.numa_node_bytes.push_back(meminfo_kb(p, "MemTotal") * 1024);
  }
  return m;
}

}  // namespace tandem
