// The node plan (actors/runtime/node_plan.h): what one node runs with, computed once from its
// spec and the model's shape, and each role's options as views of it; check-config and the
// actor cluster `tandem serve` starts plan a node alike.
#include <doctest/doctest.h>
#include <spdlog/sinks/null_sink.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "actors/config/cluster_config.h"
#include "actors/runtime/actor_cluster.h"
#include "actors/runtime/node_plan.h"
#include "actors/runtime/node_plan_views.h"
#include "kernels/gguf/gguf.h"
#include "kernels/model/llama.h"
#include "kernels/model/make_model.h"
#include "tests/e2e/process.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

kv_layout small_layout(int32_t page_size) { return kv_layout{2, 2, 8, page_size}; }

/// A model of one full pool (2 layers) and a context of `n_ctx`.
model_shape one_pool(int32_t n_ctx = 512) {
  model_shape m;
  m.layout = small_layout;
  m.pools = [](int32_t ps) { return kv_pools_layout::single(small_layout(ps)); };
  m.n_ctx = n_ctx;
  m.n_vocab = 64;
  m.eos_id = 2;
  return m;
}

/// A full pool (layer 0) and a window pool of 32 tokens (layer 1).
model_shape two_pools() {
  model_shape m = one_pool();
  m.pools = [](int32_t ps) {
    kv_layout page{1, 2, 8, ps};
    kv_pools_layout set;
    set.pools.push_back(kv_pool_spec{"full", page, 0, {0}});
    set.pools.push_back(kv_pool_spec{"window", page, 32, {1}});
    return set;
  };
  return m;
}

node_config node(const std::string& name, std::vector<std::string> roles, int32_t cluster_port) {
  node_config n;
  n.name = name;
  n.host = "10.0.0." + std::to_string(cluster_port % 10);
  n.roles = std::move(roles);
  n.cluster_port = cluster_port;
  return n;
}

}  // namespace

TEST_CASE("node_plan: one pool sized from kv_cache_mb, and the node's page size reaches every role") {
  node_spec spec;
  spec.lim.page_size = 8;
  spec.lim.kv_cache_mb = 1;
  spec.node_name = "n1";
  const node_plan p = plan_node(spec, one_pool(), 0);
  REQUIRE(p.ok());
  const size_t page_bytes = small_layout(8).page_bytes();
  CHECK(p.n_pages == int32_t((1 << 20) / page_bytes));
  CHECK(p.extra_pages.empty());
  CHECK(p.holds_kv);
  CHECK(p.model.max_context == 512);
  CHECK(p.model.eos_id == 2);
  CHECK(p.model.n_vocab == 64);
  CHECK(p.layout.page_size == 8);
  CHECK(p.pools.page_size() == 8);
  // One value, every view.
  const auto wo = worker_options_of(p);
  const auto co = cache_tier_options_of(p);
  const auto so = scheduler_options_of(p);
  const auto ro = router_options_of(p);
  CHECK(wo.pools.page_size() == 8);
  CHECK(co.layout.page_size == 8);
  CHECK(so.lim.page_size == 8);
  CHECK(so.layout.page_size == 8);
  CHECK(ro.lim.page_size == 8);
  CHECK(wo.n_pages == p.n_pages);
  CHECK(co.n_pages == p.n_pages);
  CHECK(wo.pool_id == "n1/worker0");
  CHECK(so.pool_id == "n1/worker0");
  CHECK(so.node == "n1");
  CHECK(ro.model.max_context == 512);
  CHECK(so.shares_worker);
  CHECK(so.remote_decode_node.empty());
  CHECK(wo.host_pages == 0);
  CHECK(wo.disk_dir.empty());
  // limits.device_pages wins over kv_cache_mb.
  spec.lim.device_pages = 7;
  CHECK(plan_node(spec, one_pool(), 0).n_pages == 7);
}

TEST_CASE("node_plan: a window pool gets device and host pages of its own") {
  node_spec spec;
  spec.lim.page_size = 4;
  spec.lim.kv_cache_mb = 64;
  spec.cache.host_ratio = 1;
  const node_plan p = plan_node(spec, two_pools(), 0);
  REQUIRE(p.ok());
  REQUIRE(p.pools.pools.size() == 2);
  REQUIRE(p.extra_pages.size() == 1);
  REQUIRE(p.extra_host_pages.size() == 1);
  CHECK(p.sizing.pool_pages[0] == p.n_pages);
  CHECK(p.sizing.pool_pages[1] == p.extra_pages[0]);
  CHECK(p.host_pages == p.n_pages);  // host_ratio 1: as many as the device pool, pool by pool
  CHECK(p.extra_host_pages[0] == p.extra_pages[0]);
  const auto wo = worker_options_of(p);
  const auto co = cache_tier_options_of(p);
  CHECK(wo.extra_pages == p.extra_pages);
  CHECK(co.extra_pages == p.extra_pages);
  CHECK(wo.extra_host_pages == p.extra_host_pages);
  CHECK(co.extra_host_pages == p.extra_host_pages);
  CHECK(co.pools == p.pools);
}

TEST_CASE("node_plan: the context is the model's bounded by limits.max_context, and too short a context is refused") {
  node_spec spec;
  CHECK(plan_node(spec, one_pool(512), 0).model.max_context == 512);
  spec.lim.max_context = 128;
  CHECK(plan_node(spec, one_pool(512), 0).model.max_context == 128);
  spec.lim.max_context = 0;
  const node_plan none = plan_node(spec, one_pool(0), 0);
  CHECK_FALSE(none.ok());
  CHECK(none.error == "context length 0 is too small; set limits.max_context > 1");
}

TEST_CASE("node_plan: bad limits and KV settings are the plan's error, never an exception") {
  node_spec spec;
  spec.lim.page_size = 0;  // out of its range: nothing is sized with it
  int layout_calls = 0;
  model_shape counting = one_pool();
  counting.layout = [&](int32_t ps) {
    ++layout_calls;
    return small_layout(ps);
  };
  node_plan p = plan_node(spec, counting, 0);
  CHECK(p.error == spec.lim.validate());
  CHECK(p.error.find("page_size") != std::string::npos);
  CHECK(layout_calls == 0);
  CHECK(p.pools.pools.empty());

  // A combination only validate() refuses: the error is its message, the pools are still sized
  // (check-config reports both).
  spec.lim = limits{};
  spec.lim.rate_limit_burst = 4;
  p = plan_node(spec, one_pool(), 0);
  CHECK(p.error == spec.lim.validate());
  CHECK(p.n_pages > 1);

  // A host tier larger than the machine's memory: refused on a node that holds KV ...
  spec.lim = limits{};
  spec.cache.host_size_gb = 64;
  p = plan_node(spec, one_pool(), uint64_t(1) << 30);
  CHECK(p.error.rfind("invalid KV cache settings: ", 0) == 0);
  CHECK(p.error.find("cache.host_size_gb") != std::string::npos);
  // ... not on a router-only one, which allocates no pool.
  spec.roles = {node_role::router};
  p = plan_node(spec, one_pool(), uint64_t(1) << 30);
  CHECK(p.ok());
  CHECK_FALSE(p.holds_kv);
}

TEST_CASE("node_plan: spec_of a config node carries its page size, cache, policy, roles and links") {
  cluster_config cfg;
  cfg.lim.page_size = 16;
  cfg.router_policy = "cache_aware";
  cfg.router_balance_abs_tokens = 99;
  cfg.transfer_failure_policy = kv_failure_policy::fail;
  cfg.nodes.push_back(node("r", {"router"}, 9001));
  cfg.nodes.push_back(node("p", {"prefill", "cache", "worker"}, 9002));
  cfg.nodes.push_back(node("d", {"decode", "cache", "worker"}, 9003));
  cfg.nodes[1].page_size = 8;
  cfg.nodes[1].cache.host_ratio = 2;

  const node_spec p = spec_of(cfg, cfg.nodes[1]);
  CHECK(p.lim.page_size == 8);
  CHECK(p.cache.host_ratio == 2);
  CHECK(p.node_name == "p");
  CHECK(p.roles == std::vector<node_role>{node_role::prefill, node_role::cache, node_role::worker});
  CHECK(p.cluster_host == "10.0.0.2");
  CHECK(p.cluster_port == 9002);
  REQUIRE(p.remote_nodes.size() == 2);
  CHECK(p.remote_nodes[0].name == "r");
  CHECK(p.remote_nodes[1].name == "d");
  CHECK(p.policy.kind == route_policy_kind::cache_aware);
  CHECK(p.policy.balance_abs_tokens == 99);
  CHECK(p.transfer_failure_policy == kv_failure_policy::fail);

  const node_plan pp = plan_node(p, one_pool(), 0);
  CHECK(pp.remote_decode_node() == "d");
  const auto pso = scheduler_options_of(pp);
  CHECK(pso.remote_decode_node == "d");
  CHECK_FALSE(pso.shares_worker);
  CHECK(pso.lim.prefix_cache);
  CHECK(pso.transfer_failure_policy == kv_failure_policy::fail);

  const node_plan dp = plan_node(spec_of(cfg, cfg.nodes[2]), one_pool(), 0);
  CHECK(dp.spec.lim.page_size == 16);
  CHECK(dp.remote_decode_node().empty());
  CHECK_FALSE(scheduler_options_of(dp).lim.prefix_cache);  // nothing acquires prefixes on a decode-only node
  CHECK(cache_tier_options_of(dp).prefix_cache);

  // A node with every role is an embedded cluster: no roles list, no links.
  cfg.nodes.push_back(node("all", {"router", "prefill", "decode", "cache", "worker"}, 9004));
  const node_spec all = spec_of(cfg, cfg.nodes.back());
  CHECK(all.roles.empty());
  CHECK(all.remote_nodes.empty());
  CHECK(all.transfer_failure_policy == kv_failure_policy::recompute);
  CHECK(all.policy.kind == route_policy_kind::cache_aware);
}

TEST_CASE("node_plan: the pools check-config prints are the pools the actor cluster allocates") {
  e2e::temp_dir dir;
  const std::string model_path = (dir.path / "gemma2.gguf").string();
  make_model_options mo;
  mo.preset = "micro";
  mo.arch = "gemma2";
  mo.sliding_window = 32;
  write_random_llama(mo, model_path);
  const std::string text = "[limits]\nkv_cache_mb = 2\nscheduler_threads = 2\n[model]\npath = \"" + model_path +
                           "\"\n[cache]\nhost_ratio = 1\n[[node]]\nname = \"all\"\nhost = \"127.0.0.1\"\n"
                           "page_size = 8\nroles = [\"router\", \"prefill\", \"decode\", \"cache\", \"worker\"]\n";
  machine_info m;
  m.mem_total_bytes = 16ull << 30;
  const config_check c = check_cluster_config(text, "t.toml", m);
  const std::string first_error = c.errors.empty() ? "" : c.errors.front();
  INFO(first_error);
  REQUIRE(c.ok());
  REQUIRE(c.plans.size() == 1);
  const node_kv_plan& printed = c.plans.front();
  REQUIRE(printed.pools.size() == 2);

  gguf::file f = gguf::file::open(model_path);
  actor_cluster_options o;
  static_cast<node_spec&>(o) = spec_of(c.cfg, c.cfg.nodes.front());
  o.sink = std::make_shared<spdlog::sinks::null_sink_mt>();
  actor_cluster cluster(llama_model::load(f), o);
  const node_plan& run = cluster.plan();
  CHECK(run.spec.lim.page_size == 8);
  CHECK(run.pools.page_size() == 8);
  CHECK(int64_t(run.n_pages) == printed.pools[0].pages);
  REQUIRE(run.extra_pages.size() == 1);
  CHECK(int64_t(run.extra_pages[0]) == printed.pools[1].pages);
  CHECK(int64_t(run.host_pages) == printed.pools[0].host_pages);
  REQUIRE(run.extra_host_pages.size() == 1);
  CHECK(int64_t(run.extra_host_pages[0]) == printed.pools[1].host_pages);
  CHECK(cluster.n_pages() == run.n_pages);
  cluster.shutdown();
}

TEST_CASE("node_plan: spec_of carries the node's listen ports, embedded or not") {
  cluster_config cfg;
  cfg.nodes.push_back(node("p", {"prefill", "cache", "worker"}, 9002));
  cfg.nodes.push_back(node("all", {"router", "prefill", "decode", "cache", "worker"}, 9004));
  for (auto& n : cfg.nodes) {
    n.http_port = 7001;
    n.rpc_port = 7002;
    n.admin_port = 7003;
    n.kv_port = 7004;
  }
  for (const auto& n : cfg.nodes) {
    const node_ports ports = spec_of(cfg, n).ports;
    CHECK(ports.host == n.host);
    CHECK(ports.http == 7001);
    CHECK(ports.rpc == 7002);
    CHECK(ports.admin == 7003);
    CHECK(ports.kv == 7004);
  }
  CHECK(node_spec{}.ports.admin == -1);  // serve without --admin-port: none
}
