// [router] balance_abs_tokens / balance_rel (cache_aware's balance thresholds): parsed into
// the config, defaults unchanged, and every wrong value reported with its line and the fix.
#include <doctest/doctest.h>

#include <string>

#include "actors/config/cluster_config.h"
#include "actors/router/router_policy.h"

using namespace tandem;

namespace {

machine_info no_machine() { return machine_info{}; }

std::string node_with(const std::string& router) {
  return "[limits]\npage_size = 16\nkv_cache_mb = 64\n" + router +
         "[[node]]\nname = \"a\"\nroles = [\"router\", \"prefill\", \"decode\", \"cache\", \"worker\"]\n";
}

std::string errors(const config_check& c) {
  std::string out;
  for (const auto& e : c.errors) out += e + "\n";
  return out;
}

}  // namespace

TEST_CASE("router config: balance thresholds default to the policy's and are read from [router]") {
  route_policy_options defaults;
  auto d = check_cluster_config(node_with(""), "t.toml", no_machine());
  INFO(errors(d));
  REQUIRE(d.errors.empty());
  CHECK(d.cfg.router_balance_abs_tokens == defaults.balance_abs_tokens);
  CHECK(d.cfg.router_balance_rel == defaults.balance_rel);
  auto c = check_cluster_config(
      node_with("[router]\npolicy = \"cache_aware\"\nbalance_abs_tokens = 512\nbalance_rel = 2.25\n"), "t.toml",
      no_machine());
  INFO(errors(c));
  REQUIRE(c.errors.empty());
  CHECK(c.cfg.router_policy == "cache_aware");
  CHECK(c.cfg.router_balance_abs_tokens == 512);
  CHECK(c.cfg.router_balance_rel == 2.25);
  // An integer is a number too.
  auto i = check_cluster_config(node_with("[router]\nbalance_rel = 3\nbalance_abs_tokens = 0\n"), "t.toml", no_machine());
  REQUIRE(i.errors.empty());
  CHECK(i.cfg.router_balance_rel == 3.0);
  CHECK(i.cfg.router_balance_abs_tokens == 0);
}

TEST_CASE("router config: wrong balance thresholds are rejected with the fix") {
  struct bad {
    const char* router;
    const char* message;
  } cases[] = {
      {"[router]\nbalance_rel = 0.5\n", "t.toml:5:15: router.balance_rel = 0.5: out of range 1 .. 1000000; use e.g. 1.5"},
      {"[router]\nbalance_rel = \"1.5\"\n", "router.balance_rel = \"1.5\": expected a number, got a string"},
      {"[router]\nbalance_abs_tokens = -1\n", "router.balance_abs_tokens = -1: out of range 0 .. 1099511627776; use e.g. 2048"},
      {"[router]\nbalance_abs_tokens = 1.5\n", "router.balance_abs_tokens = 1.5: expected an integer"},
      {"[router]\nbalance_tokens = 10\n", "router.balance_tokens: unknown key; did you mean 'balance_abs_tokens'?"},
  };
  for (const auto& b : cases) {
    auto c = check_cluster_config(node_with(b.router), "t.toml", no_machine());
    INFO(b.router << "->\n" << errors(c));
    CHECK(c.errors.size() == 1);
    CHECK(errors(c).find(b.message) != std::string::npos);
  }
}

TEST_CASE("router config: the thresholds change cache_aware's choice") {
  // Target 0 has the prompt's prefix cached and 1000 tokens queued; target 1 is empty.
  std::vector<int32_t> prompt(64);
  for (int i = 0; i < 64; ++i) prompt[size_t(i)] = i;
  auto choose = [&](const std::string& router) {
    auto c = check_cluster_config(node_with(router), "t.toml", no_machine());
    REQUIRE(c.errors.empty());
    route_policy_options o;
    o.kind = route_policy_kind::cache_aware;
    o.balance_abs_tokens = c.cfg.router_balance_abs_tokens;
    o.balance_rel = c.cfg.router_balance_rel;
    route_policy p(o, 1);
    p.on_routed(prompt, 0);
    std::vector<target_load> loads(2);
    loads[0].queued_tokens = 1000;
    return p.choose_prefill(prompt, loads, {true, true});
  };
  CHECK(choose("[router]\npolicy = \"cache_aware\"\n") == 0);  // 1000 < 2048: stays with its cache
  CHECK(choose("[router]\npolicy = \"cache_aware\"\nbalance_abs_tokens = 500\n") == 1);
}
