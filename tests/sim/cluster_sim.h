#pragma once
// Deterministic simulation of a multi-node cluster in one process under one seed: a router
// node, prefill nodes and decode nodes, each with its own actors, ingress and remote proxies
// (actors/runtime/remote_link, the production code), on CAF's test scheduler and simulated
// clock. What stands in for the CAF middleman is a link actor per direction between two nodes:
// it round-trips every message through CAF's binary serializer (what BASP sends), keeps TCP's
// order, delays by a seeded latency, and loses what it holds when the link goes down. The
// proxies monitor the link as they monitor a remote ingress, and redial through a dialer actor
// that answers the middleman's connect request (spawn_remote_proxy's `dialer` hook). KV pages
// move through the real transfer_table over a fake fabric (tests/sim/kv_fabric.h).
// Faults: node loss (and restart), link flaps, mailbox refusals, and the fabric's drops,
// delays, duplicates and corruption.
#include <cstdint>
#include <string>

#include "tests/sim/sim.h"

namespace tandem::sim {

/// The faults of one cluster run (from the seed unless given).
struct cluster_menu {
  int32_t prefill_nodes = 1, decode_nodes = 1;
  double gate_reject = 0;
  double link_delay = 0;  ///< a message waits 1..max_link_delay_ms on its link
  int32_t max_link_delay_ms = 1;
  int32_t node_losses = 0;  ///< prefill/decode nodes lost in the busy period
  bool restart_lost = false;  ///< a lost node comes back (a new process) after a while
  int32_t link_flaps = 0;     ///< links down then up again
  int32_t max_flap_ms = 1;
  double time_step = 0.05;    ///< before a step, simulated time moves 1..max_time_step_ms
  int32_t max_time_step_ms = 1;
  double kv_drop = 0, kv_delay = 0, kv_duplicate = 0, kv_corrupt = 0, kv_put_fail = 0;
  int32_t kv_max_delay_ms = 1;
  std::string failure_policy = "recompute";
};

/// Runs one seed of the cluster to quiescence and checks the invariants.
sim_result run_cluster_seed(uint64_t seed, const cluster_menu* menu = nullptr);

}  // namespace tandem::sim
