#include "actors/runtime/node_plan_views.h"

namespace tandem {

worker_options worker_options_of(const node_plan& plan) {
  worker_options wo;
  wo.pool_id = plan.pool_id();
  wo.n_pages = plan.n_pages;
  wo.pools = plan.pools;
  wo.extra_pages = plan.extra_pages;
  wo.mailbox_bound = plan.spec.lim.worker_mailbox;
  wo.kv_transfer_max_live = plan.spec.lim.kv_transfer_max_live;
  wo.host_pages = plan.host_pages;
  wo.extra_host_pages = plan.extra_host_pages;
  if (plan.disk_pages > 0) wo.disk_dir = plan.spec.cache.disk_dir;
  return wo;
}

cache_tier_options cache_tier_options_of(const node_plan& plan) {
  const limits& lim = plan.spec.lim;
  cache_tier_options co;
  co.n_pages = plan.n_pages;
  co.prefix_cache = plan.prefix_cache;
  co.mailbox_bound = lim.cache_tier_mailbox;
  co.cache = plan.spec.cache;
  co.layout = plan.layout;
  co.pools = plan.pools;
  co.extra_pages = plan.extra_pages;
  co.chunk_tokens = lim.prefill_chunk_tokens;
  co.max_background_copies = lim.cache_max_background_copies;
  co.host_pages = plan.host_pages;
  co.extra_host_pages = plan.extra_host_pages;
  co.disk_pages = plan.disk_pages;
  return co;
}

scheduler_options scheduler_options_of(const node_plan& plan) {
  scheduler_options so;
  so.lim = plan.spec.lim;
  // Nothing acquires prefixes on a decode-only node.
  so.lim.prefix_cache = plan.prefix_cache && plan.has(node_role::prefill);
  so.model = plan.model;
  so.layout = plan.layout;
  so.pools = plan.pools;
  so.pool_id = plan.pool_id();
  so.node = plan.spec.node_name;
  so.transfer_failure_policy = plan.spec.transfer_failure_policy;
  so.shares_worker = plan.has(node_role::prefill) && plan.has(node_role::decode);
  so.remote_decode_node = plan.remote_decode_node();
  return so;
}

router_options router_options_of(const node_plan& plan) {
  router_options ro;
  ro.lim = plan.spec.lim;
  ro.model = plan.model;
  ro.tick_ms = plan.spec.router_tick_ms;
  ro.policy = plan.spec.policy;
  return ro;
}

}  // namespace tandem
