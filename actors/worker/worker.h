#pragma once
/// Worker actor: owns the llama_model and the device KV pool, runs forward batches and
/// samples. Replies with sampled token ids only (logits never leave the worker).
/// Runs detached (its own thread) because a forward pass blocks for milliseconds.
/// Also owns the host pool (L2) and the disk tier's files (L3) and runs the cache tier's
/// CacheCopy requests (page copies between the tiers) in mailbox order with the forward
/// batches, so a copy never races a forward over the same page.
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <memory>
#include <string>

#include "actors/common/bounded_mailbox.h"
#include "actors/common/limits.h"
#include "actors/worker/kv_port.h"
#include "kernels/backend/device.h"
#include "kernels/grammar/sessions.h"
#include "kernels/model/llama.h"

namespace tandem {

struct worker_options {
  std::string pool_id = "local/worker0";  ///< names the pool in page descriptors
  int32_t n_pages = 0;      ///< pages of pool 0
  /// The KV layout set (kernels/model/kv_pools.h), required: its page size is the worker's (one
  /// pool: the model's layout() at that page size).
  kv_pools_layout pools;
  std::vector<int32_t> extra_pages;  ///< pages of pools 1..
  /// A device backend (kernels/backend/device.h): the KV pools in its memory, the host tier's
  /// copies through its copy function. The model must run on the same device. Empty = host memory.
  backend::device device;
  int32_t mailbox_bound = 256;
  /// Host (L2) pool of the hierarchical KV cache: same page layout, host memory; 0 = none.
  int32_t host_pages = 0;
  /// Host pages of pools 1.. (each pool has its own); empty = host_pages each.
  std::vector<int32_t> extra_host_pages;
  /// Directory of the disk (L3) tier; empty = none. The worker reads and writes its files.
  std::string disk_dir;
  /// Cross-node KV transfers: when set, the device pool comes from the port (registered
  /// transport memory) and the worker takes (kv_atom, wire{kvSend|kvReceive|kvAbort}) orders
  /// (worker_kv.h): an ended send's pages go back to the cache tier, a receive's end is
  /// answered with (kv_atom, wire{kvDone}) to the decode scheduler (both from its peer_set).
  kv_port_factory kv_transfer;
  /// limits.kv_transfer_max_live: live sends, and live receives, at most (more are refused).
  int32_t kv_transfer_max_live = 1024;
  /// Own thread (a forward pass blocks). The deterministic simulation (tests/sim) sets false
  /// so the worker runs on its single-threaded test scheduler like every other actor.
  bool detached = true;
  /// Test hook: the worker throws as it starts (tests/e2e/test_faults.cpp: supervision of a
  /// worker that crashes at start).
  bool fail_at_start = false;
  /// The model's vocabulary for grammar-constrained sampling (response_format); without it a
  /// request with a grammar fails naming the missing vocabulary.
  std::shared_ptr<const grammar::token_trie> grammar_vocab;
  grammar::session_limits grammar_limits;
};

/// Seed of the sampler of one token: depends only on the request seed and the token's index
/// in the completion, so any node can sample any token without shared state.
uint64_t token_seed(uint64_t request_seed, int32_t token_index);

/// Spawns the worker; the model moves into the actor. Messages: (peers_atom, peer_set) first
/// when it has a kv_transfer port; its protocol, `WorkerIn` (call_atom and kv_atom); (stats_atom) -> wire.
bounded_actor spawn_worker(caf::actor_system& sys, std::shared_ptr<llama_model> model,
                           const worker_options& opt, std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
