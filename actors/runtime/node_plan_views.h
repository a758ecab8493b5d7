#pragma once
/// Each role's options as a view of the node plan (actors/runtime/node_plan.h): the one place
/// where a plan value (page size, pool sizes, bounds, names) reaches an actor. What only the
/// running process has (the KV transfer port, the device, the grammar vocabulary, test hooks)
/// the wiring (actor_cluster_wiring.cpp) adds.
#include "actors/cache_tier/cache_tier.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/runtime/node_plan.h"
#include "actors/worker/worker.h"

namespace tandem {

/// The worker's pools (device pages, host pages, disk directory), page size and mailbox bound.
worker_options worker_options_of(const node_plan& plan);
/// The cache tier's pools and tiers, as the worker's, and its prefix cache switch.
cache_tier_options cache_tier_options_of(const node_plan& plan);
/// The prefill and decode schedulers' options (one struct for both).
scheduler_options scheduler_options_of(const node_plan& plan);
/// The router's limits, model facts, tick and policy.
router_options router_options_of(const node_plan& plan);

}  // namespace tandem
