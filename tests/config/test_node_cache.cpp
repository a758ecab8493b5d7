// Per-node cache settings: a [node.cache] table over the cluster's [cache] (a prefill node with
// a host tier, a decode node without), checked by the same rules, sized by the code serve runs,
// and shown by `tandem check-config`.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "actors/config/cluster_config.h"
#include "tests/e2e/process.h"
#include "tests/transport/fake_api.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

machine_info fixed_machine() {
  machine_info m;
  m.mem_total_bytes = 16ull << 30;
  m.mem_available_bytes = 8ull << 30;
  m.cpus = 8;
  return m;
}

/// Router, prefill and decode on three hosts; `p_cache` / `d_cache` are the lines of each
/// node's [node.cache] table ("" = none), `head` goes before the nodes.
std::string pd(const std::string& head, const std::string& p_cache, const std::string& d_cache) {
  std::string s = head +
                  "\n[[node]]\nname = \"r\"\nhost = \"10.0.0.1\"\nroles = [\"router\"]\ncluster_port = 9000\n"
                  "[[node]]\nname = \"p\"\nhost = \"10.0.0.2\"\nroles = [\"prefill\", \"cache\", \"worker\"]\n"
                  "cluster_port = 9000\nkv_port = 9001\n";
  if (!p_cache.empty()) s += "[node.cache]\n" + p_cache;
  s += "\n[[node]]\nname = \"d\"\nhost = \"10.0.0.3\"\nroles = [\"decode\", \"cache\", \"worker\"]\ncluster_port = 9000\n";
  if (!d_cache.empty()) s += "[node.cache]\n" + d_cache;
  return s;
}

std::string joined(const config_check& c) {
  std::string s;
  for (const auto& e : c.errors) s += e + "\n";
  for (const auto& n : c.notes) s += "note: " + n + "\n";
  return s;
}

/// A micro gemma2 model (window 32: two pools) in `dir`; its path.
std::string write_micro_gemma2(const fs::path& dir) {
  const std::string model = (dir / "gemma2.gguf").string();
  make_model_options o;
  o.preset = "micro";
  o.arch = "gemma2";
  o.sliding_window = 32;
  write_random_llama(o, model);
  return model;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& e : lines) s += e + "\n";
  return s;
}

}  // namespace

TEST_CASE("node cache: [node.cache] overrides the cluster's [cache] for that node only") {
  const auto m = fixed_machine();
  auto c = check_cluster_config(pd("[cache]\nhost_ratio = 2\nwrite_policy = \"write_back\"\n", "host_size_gb = 4\n",
                                   "host_ratio = 0\n"),
                                "t.toml", m);
  INFO(joined(c));
  REQUIRE(c.ok());
  const auto* p = c.cfg.find_node("p");
  const auto* d = c.cfg.find_node("d");
  const auto* r = c.cfg.find_node("r");
  // The host tier's size is one setting: host_size_gb replaces the inherited host_ratio.
  CHECK(p->cache.host_size_gb == 4);
  CHECK(p->cache.host_ratio == 0);
  CHECK(p->cache.write_policy == cache_write_policy::write_back);  // inherited
  CHECK(d->cache.host_ratio == 0);
  CHECK(d->cache.host_size_gb == 0);
  CHECK(r->cache.host_ratio == 2);  // no table: the cluster's
  CHECK(c.cfg.cache.host_ratio == 2);
}

TEST_CASE("node cache: a node's table is checked by the cluster-level rules, named by node") {
  const auto m = fixed_machine();
  auto typo = check_cluster_config(pd("", "host_ration = 2\n", ""), "t.toml", m);
  CHECK(joined(typo).find("node[1].cache.host_ration: unknown key; did you mean 'host_ratio'?") != std::string::npos);
  auto both = check_cluster_config(pd("", "host_ratio = 1\nhost_size_gb = 1\n", ""), "t.toml", m);
  CHECK(joined(both).find("node[1].cache.host_size_gb = 1: is exclusive with cache.host_ratio = 1") != std::string::npos);
  auto disk = check_cluster_config(pd("", "", "disk_dir = \"/tmp\"\n"), "t.toml", m);
  CHECK(joined(disk).find("node[2].cache.disk_dir = \"/tmp\": needs cache.disk_size_gb") != std::string::npos);
  auto off = check_cluster_config(pd("[cache]\nhost_ratio = 2\n", "enabled = false\n", ""), "t.toml", m);
  CHECK(joined(off).find("node[1].cache.enabled = false: turns prefix reuse off, but host/disk tiers are configured") !=
        std::string::npos);
  auto range = check_cluster_config(pd("", "host_ratio = -1\n", ""), "t.toml", m);
  CHECK(joined(range).find("node[1].cache.host_ratio = -1: out of range") != std::string::npos);
  // Only the decode node turns its tier off: the cluster's stays valid for the others.
  auto ok = check_cluster_config(pd("[cache]\nhost_ratio = 2\n", "", "enabled = false\nhost_ratio = 0\n"), "t.toml", m);
  INFO(joined(ok));
  CHECK(ok.ok());
}

TEST_CASE("node cache: with the model, each node's tiers are sized by the code serve runs") {
  e2e::temp_dir dir;
  const std::string model = e2e::write_micro_model(dir.path);
  const auto m = fixed_machine();
  const std::string head = "[limits]\npage_size = 16\nkv_cache_mb = 1\n[model]\npath = \"" + model + "\"\n";
  // A host tier smaller than one page (the micro model's 16-token page is 8 KiB) on p only.
  auto tiny = check_cluster_config(pd(head, "host_size_gb = 0.000001\n", ""), "t.toml", m);
  INFO(joined(tiny));
  CHECK(joined(tiny).find("node 'p': cache.host_size_gb = 1e-06 is not supported for this model's KV layout") !=
        std::string::npos);
  CHECK(joined(tiny).find("node 'd'") == std::string::npos);
  auto fine = check_cluster_config(pd(head, "host_size_gb = 0.01\n", "host_ratio = 0\n"), "t.toml", m);
  INFO(joined(fine));
  CHECK(fine.ok());
}

TEST_CASE("kv sizing: size_kv_pools gives the device, host and disk pages serve allocates") {
  kv_layout layout;
  layout.n_layers = 2;
  layout.n_kv_heads = 1;
  layout.head_dim = 64;
  layout.page_size = 16;
  const double page = double(layout.page_bytes());
  REQUIRE(page > 0);
  limits lim;
  lim.kv_cache_mb = 1;
  lim.device_pages = 0;
  cache_config c;
  c.host_ratio = 2;
  auto k = size_kv_pools(lim, c, layout, 0);
  CHECK(k.ok());
  CHECK(k.device_pages == int64_t((1 << 20) / page));
  CHECK(k.host_pages == 2 * k.device_pages);
  CHECK(k.disk_pages == 0);
  lim.prefix_cache = false;  // no prefix reuse: no tiers behind the pool
  CHECK(size_kv_pools(lim, c, layout, 0).host_pages == 0);
  lim.prefix_cache = true;
  c.host_ratio = 0;
  c.host_size_gb = page * 10 / (1024.0 * 1024.0 * 1024.0);  // ten pages' bytes
  CHECK(size_kv_pools(lim, c, layout, 0).host_pages == 10);
  lim.device_pages = 3;
  CHECK(size_kv_pools(lim, c, layout, 0).device_pages == 3);
  lim.device_pages = 0;
  lim.kv_cache_mb = 0;
  auto none = size_kv_pools(lim, c, layout, 0);
  REQUIRE_FALSE(none.ok());
  CHECK(none.problems[0].find("give at least one page") != std::string::npos);
}

TEST_CASE("cli: check-config shows each node's effective cache settings") {
  e2e::temp_dir dir;
  std::ofstream(dir.path / "pd.toml") << pd("[cache]\nhost_ratio = 2\n", "host_size_gb = 4\n", "host_ratio = 0\n");
  const std::string err_path = (dir.path / "err.txt").string();
  std::string out;
  int code = -1;
  {
    e2e::child p({TANDEM_BINARY, "check-config", (dir.path / "pd.toml").string()}, {}, err_path);
    out = p.read_all(std::chrono::seconds(30));
    code = p.wait(std::chrono::seconds(30));
  }
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("  node p: cache: host 4 GiB, no disk tier, write_through_selective (2 hits); page_size 16") !=
        std::string::npos);
  CHECK(out.find("  node d: cache: no host tier, no disk tier") != std::string::npos);
}

TEST_CASE("kv sizing: a window pool gets a ring per sequence, the full pool the rest, tiers by block") {
  kv_layout page;
  page.n_layers = 1;
  page.n_kv_heads = 1;
  page.head_dim = 64;
  page.page_size = 16;
  kv_pools_layout set;
  set.pools.push_back(kv_pool_spec{"full", page, 0, {1}});
  set.pools.push_back(kv_pool_spec{"window", page, 32, {0}});
  const int64_t pb = int64_t(page.page_bytes());
  limits lim;
  lim.kv_cache_mb = 1;
  lim.max_running_seqs = 4;
  lim.max_prefill_batch_seqs = 2;
  lim.prefill_chunk_tokens = 16;
  cache_config c;
  c.host_ratio = 1;
  auto k = size_kv_pools(lim, c, set, 0);
  REQUIRE(k.ok());
  REQUIRE(k.pool_pages.size() == 2);
  const int64_t ring = set.pools[1].max_pages(int64_t(1) << 40, 16);  // ceil(47/16) + 1 = 4
  CHECK(ring == 4);
  CHECK(k.pool_pages[1] == 6 * ring);
  CHECK(k.pool_pages[0] == ((1 << 20) - 6 * ring * pb) / pb);
  CHECK(k.device_pages == k.pool_pages[0]);
  // host_ratio: every pool gets that multiple of its own device pages.
  REQUIRE(k.host_pool_pages.size() == 2);
  CHECK(k.host_pages == k.device_pages);
  CHECK(k.host_pool_pages[1] == k.pool_pages[1]);
  CHECK(k.host_pool_bytes[1] == uint64_t(k.pool_pages[1] * pb));
  c.host_ratio = 0;
  // host_size_gb: split across the pools in proportion to their device bytes, whole pages each.
  const double gib = 1024.0 * 1024.0 * 1024.0;
  c.host_size_gb = double(pb) * 100 / gib;  // a hundred pages' bytes
  k = size_kv_pools(lim, c, set, 0);
  REQUIRE(k.ok());
  REQUIRE(k.host_pool_pages.size() == 2);
  const double total = double(k.pool_pages[0] + k.pool_pages[1]);
  CHECK(k.host_pool_pages[0] == int64_t(std::floor(100 * double(k.pool_pages[0]) / total + 1e-9)));
  CHECK(k.host_pool_pages[1] == int64_t(std::floor(100 * double(k.pool_pages[1]) / total + 1e-9)));
  CHECK(k.host_pool_pages[1] >= 1);
  CHECK(k.host_pool_pages[0] + k.host_pool_pages[1] <= 100);
  CHECK(k.host_pool_pages[0] + k.host_pool_pages[1] >= 99);
  CHECK(k.host_pages == k.host_pool_pages[0]);
  // An explicit share per pool.
  c.host_pool_share = {{"full", 0.75}, {"window", 0.25}};
  k = size_kv_pools(lim, c, set, 0);
  REQUIRE(k.ok());
  CHECK(k.host_pool_pages[0] == 75);
  CHECK(k.host_pool_pages[1] == 25);
  // Shares that do not fit the layout are refused, naming the pools.
  c.host_pool_share = {{"full", 0.75}, {"windw", 0.25}};
  auto bad = size_kv_pools(lim, c, set, 0);
  CHECK_FALSE(bad.ok());
  CHECK(joined(bad.problems).find("names pool 'windw', which this model's KV layout does not have (its pools: full, "
                                  "window)") != std::string::npos);
  CHECK(joined(bad.problems).find("does not name pool 'window'") != std::string::npos);
  c.host_pool_share = {{"full", 0.5}, {"window", 0.25}};
  CHECK(joined(size_kv_pools(lim, c, set, 0).problems).find("sum to 0.75") != std::string::npos);
  c.host_pool_share.clear();
  // A budget that leaves the window pool without a page: refused, naming the minimum size.
  c.host_size_gb = double(pb) * 4 / gib;  // the window pool's share is under a page
  auto tiny = size_kv_pools(lim, c, set, 0);
  CHECK_FALSE(tiny.ok());
  const std::string why = joined(tiny.problems);
  INFO(why);
  CHECK(why.find("one page of pool 'window'") != std::string::npos);
  CHECK(why.find("host pool would hold no page; use cache.host_ratio (e.g. 2) or a cache.host_size_gb of at least") !=
        std::string::npos);
  // ... and the minimum it names is enough.
  const auto at = why.find("of at least ") + std::strlen("of at least ");
  c.host_size_gb = std::stod(why.substr(at));
  auto enough = size_kv_pools(lim, c, set, 0);
  CHECK(enough.ok());
  CHECK(enough.host_pool_pages[1] >= 1);
  c.host_size_gb = double(pb) * 100 / gib;
  // Too small for the rings next to a full page: pools of equal page counts.
  lim.kv_cache_mb = 0;
  lim.device_pages = 0;
  CHECK_FALSE(size_kv_pools(lim, c, set, 0).ok());
  // The one-pool set sizes as before.
  lim.kv_cache_mb = 1;
  c.host_size_gb = 0;
  CHECK(size_kv_pools(lim, c, kv_pools_layout::single(page), 0).device_pages == (1 << 20) / pb);
}

TEST_CASE("cli: check-config prints each pool of a sliding-window model (one process)") {
  e2e::temp_dir dir;
  const std::string model = write_micro_gemma2(dir.path);
  std::ofstream(dir.path / "one.toml") << "[limits]\nkv_cache_mb = 2\n[model]\npath = \"" + model +
                                              "\"\n[cache]\nhost_ratio = 1\n[[node]]\nname = \"all\"\nhost = "
                                              "\"127.0.0.1\"\nroles = [\"router\", \"prefill\", \"decode\", "
                                              "\"cache\", \"worker\"]\n";
  const std::string err_path = (dir.path / "err.txt").string();
  std::string out;
  int code = -1;
  {
    e2e::child p({TANDEM_BINARY, "check-config", (dir.path / "one.toml").string()}, {}, err_path);
    out = p.read_all(std::chrono::seconds(30));
    code = p.wait(std::chrono::seconds(30));
  }
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("KV pool 'full':") != std::string::npos);
  CHECK(out.find("KV pool 'window' (window 32):") != std::string::npos);
  CHECK(out.find("host tier:") != std::string::npos);
  {
    e2e::child p({TANDEM_BINARY, "check-config", "--json", (dir.path / "one.toml").string()}, {}, err_path);
    out = p.read_all(std::chrono::seconds(30));
    code = p.wait(std::chrono::seconds(30));
  }
  INFO(out);
  CHECK(code == 0);
  CHECK(out.find("\"node\":\"all\"") != std::string::npos);
  CHECK(out.find("{\"name\":\"window\",\"window_tokens\":32,\"pages\":") != std::string::npos);
  CHECK(out.find("\"host\":{\"bytes\":") != std::string::npos);
  CHECK(out.find("\"window_tokens\":32,\"pages\":256,\"bytes\":1048576,\"host_pages\":256,") != std::string::npos);
}

TEST_CASE("config: backend = cuda is refused without a CUDA build or device, naming the fix") {
  const std::string one = "[model]\npath = \"m.gguf\"\nbackend = \"cuda\"\ndevice = 1\n[[node]]\nname = \"all\"\nhost = "
                          "\"127.0.0.1\"\nroles = [\"router\", \"prefill\", \"decode\", \"cache\", \"worker\"]\n";
  auto m = fixed_machine();
  m.cuda_devices = -1;
  auto no_build = check_cluster_config(one, "t.toml", m);
  CHECK(joined(no_build).find("model.backend = \"cuda\": this tandem was built without the CUDA backend; rebuild it "
                              "with -DTANDEM_CUDA=ON") != std::string::npos);
  m.cuda_devices = 0;
  CHECK(joined(check_cluster_config(one, "t.toml", m)).find("no CUDA device is visible here") != std::string::npos);
  m.cuda_devices = 1;
  CHECK(joined(check_cluster_config(one, "t.toml", m)).find("[model] device = 1 but this machine has 1 CUDA device;") !=
        std::string::npos);
  m.cuda_devices = 2;
  CHECK(joined(check_cluster_config(one, "t.toml", m)).find("model.backend") == std::string::npos);
  auto bad = check_cluster_config("[model]\nbackend = \"tpu\"\n" + one.substr(one.find("[[node]]")), "t.toml", m);
  CHECK(joined(bad).find("model.backend") != std::string::npos);
}

TEST_CASE("node cache: host_pool_share splits a sliding-window model's host budget, checked against its pools") {
  e2e::temp_dir dir;
  const std::string model = write_micro_gemma2(dir.path);
  const auto m = fixed_machine();
  const std::string head = "[limits]\npage_size = 16\nkv_cache_mb = 2\n[model]\npath = \"" + model + "\"\n";
  // Device bytes split evenly (the micro window pool is as large as the full pool): so is the host.
  auto even = check_cluster_config(pd(head, "host_size_gb = 0.01\n", ""), "t.toml", m);
  INFO(joined(even));
  REQUIRE(even.ok());
  REQUIRE(even.plans.size() == 2);
  const auto& pools = even.plans[0].node == "p" ? even.plans[0].pools : even.plans[1].pools;
  REQUIRE(pools.size() == 2);
  // Each pool's host bytes in proportion to its device bytes (within a page).
  CHECK(pools[0].host_pages > 0);
  CHECK(pools[1].host_pages > 0);
  CHECK(std::abs(double(pools[0].host_bytes) / double(pools[0].bytes) -
                 double(pools[1].host_bytes) / double(pools[1].bytes)) < 0.01);
  // An explicit split.
  auto split =
      check_cluster_config(pd(head, "host_size_gb = 0.01\nhost_pool_share = { full = 0.9, window = 0.1 }\n", ""),
                           "t.toml", m);
  INFO(joined(split));
  REQUIRE(split.ok());
  const auto& sp = split.plans[0].node == "p" ? split.plans[0].pools : split.plans[1].pools;
  CHECK(sp[0].host_bytes > 8 * sp[1].host_bytes);
  CHECK(sp[0].host_bytes < 10 * sp[1].host_bytes);
  // Shares that name another pool, a bad value, or a share next to host_ratio: refused at the key.
  auto typo = check_cluster_config(pd(head, "host_size_gb = 0.01\nhost_pool_share = { full = 0.5, swa = 0.5 }\n", ""),
                                   "t.toml", m);
  CHECK(joined(typo).find("names pool 'swa', which this model's KV layout does not have (its pools: full, window)") !=
        std::string::npos);
  auto range =
      check_cluster_config(pd(head, "host_size_gb = 0.01\nhost_pool_share = { full = 2, window = 0.5 }\n", ""),
                           "t.toml", m);
  CHECK(joined(range).find("node[1].cache.host_pool_share.full = 2: must be a fraction in (0, 1]") != std::string::npos);
  auto ratio = check_cluster_config(pd(head, "host_ratio = 1\nhost_pool_share = { full = 0.5, window = 0.5 }\n", ""),
                                    "t.toml", m);
  INFO(joined(ratio));
  CHECK(joined(ratio).find("node[1].cache.host_pool_share = ") != std::string::npos);
  CHECK(joined(ratio).find(": splits cache.host_size_gb, but the host tier is sized by host_ratio") != std::string::npos);
}
