#pragma once
/// Prefill scheduler actor: admission (bounded queue of requests and of prompt tokens,
/// explicit `overloaded` beyond), prefix-cache lookup and page acquisition through the
/// cache tier, chunked prefill (prefill_chunk_tokens per forward step, up to
/// max_prefill_batch_seqs sequences per batch), first-token sampling, then a KvHandoff to
/// the decode scheduler. Also takes back preempted sequences for recompute.
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <memory>
#include <string>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/kv_failure_policy.h"
#include "kernels/base/clock.h"
#include "actors/common/limits.h"
#include "actors/common/request.h"
#include "kernels/model/kv_pool.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

struct scheduler_options {
  limits lim;
  model_facts model;
  kv_layout layout;
  /// The KV layout set of the node's pool (kernels/model/kv_pools.h); empty or one pool: every
  /// table is pool 0's. Window pools: the schedulers release the blocks no step reads again.
  kv_pools_layout pools;
  std::string pool_id = "local/worker0";
  std::string node = "local";
  /// Non-empty: the decode scheduler runs on other nodes, this one the first of them. Handoffs
  /// then carry a transfer id and the worker writes the pages to the pool of the decode node
  /// the router chose (the request's decode_target, "node/decode"; empty = this node).
  std::string remote_decode_node;
  /// Decode side of a cross-node handoff: a failed KV transfer re-prefills the request
  /// ("recompute", at most max_transfer_retries times) or ends it with an error ("fail").
  kv_failure_policy transfer_failure_policy = kv_failure_policy::recompute;
  int32_t max_transfer_retries = 2;
  int32_t retry_ms = 2;  ///< real-time wait before retrying an allocation that found no pages
  /// Prefill and decode share this node's worker: the decode scheduler sends its credits to
  /// the prefill scheduler too, which pauses while decode is backed up
  /// (limits.prefill_pause_decode_waiting_seqs).
  bool shares_worker = false;
};

/// Messages: (peers_atom, peer_set) first; its protocol, `PrefillIn` (actors/common/protocol.h:
/// wire_atom and kv_atom); (stats_atom) -> wire.
bounded_actor spawn_prefill_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                      std::shared_ptr<const cluster_clock> clk,
                                      std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
