#pragma once
/// Decode scheduler actor: continuous batching. Sequences arrive by KvHandoff and join the
/// running batch at any step (up to max_running_seqs); each step is one worker forward over
/// every running sequence; finished sequences leave and free their pages. Pages are
/// allocated from the cache tier as sequences grow. On page exhaustion the youngest
/// sequence (latest arrival) is preempted: its pages are freed and it goes back to the
/// prefill scheduler for recompute (sampling is seeded per token, so the output is the
/// same). If the sequence that needs the page is the only one left, it fails with
/// `overloaded`.
#include <spdlog/logger.h>

#include <caf/actor_system.hpp>
#include <memory>

#include "actors/common/bounded_mailbox.h"
#include "kernels/base/clock.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"

namespace tandem {

/// Messages: (peers_atom, peer_set) first; its protocol, `DecodeIn` (actors/common/protocol.h:
/// wire_atom and kv_atom); (stats_atom) -> wire.
bounded_actor spawn_decode_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                     std::shared_ptr<const cluster_clock> clk,
                                     std::shared_ptr<spdlog::logger> log);

}  // namespace tandem
