#pragma once
/// The prefill scheduler's state and the functions its parts share (prefill_scheduler.cpp: the
/// actor, admission, the queue, aborts; prefill_batch.cpp: page acquisition, the chunked batch,
/// the handoff to decode). Internal to the actor.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <deque>
#include <set>
#include <unordered_map>

#include "actors/common/drain_mode.h"
#include "actors/common/kv_layout_wire.h"
#include "actors/common/logprobs_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/protocol.h"
#include "actors/common/receive.h"
#include "actors/common/seq_pages.h"
#include "actors/common/wire.h"
#include "actors/prefill_scheduler/drain_meter.h"
#include "actors/router/router.h"
#include "actors/worker/forward_call.h"
#include "actors/worker/kv_handoff.h"
#include "actors/worker/kv_port.h"

#include "actors/prefill_scheduler/prefill_scheduler.h"

namespace tandem::prefill_detail {

struct pseq {
  seq_request req;
  std::vector<int32_t> tokens;  ///< prompt ++ generated: everything to compute
  pool_pages pages;        ///< per pool, by block (seq_pages.h)
  int32_t owned_from = 0;  ///< blocks before this came from the prefix cache (shared)
  int32_t computed = 0;  ///< tokens whose KV is in the pages
  bool aborted = false;
  bool requeued = false;  ///< came back from decode (already admitted)
  int64_t arrival_ms = 0;  ///< taken off the mailbox (queued from here)
  int64_t start_ms = -1;   ///< its pages acquired: prefill started
};

struct prefill_state {
  scheduler_options opt;
  peer_set peers;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  inbox box;  ///< the receive side (gate, log, unexpected-message counters)
  /// Where a new request's time to first token goes on this node: waiting for prefill to start
  /// (the queue, and the page acquisition), then the prefill itself (its batches, sharing the
  /// worker with decode steps).
  histogram queue_wait_ms{"prefill_queue_wait_ms",
                          "Time from arrival at the prefill scheduler to the start of its prefill (ms)",
                          histogram::latency_ms_buckets()};
  histogram compute_ms{"prefill_compute_ms", "Time from the start of a prefill to its first token (ms)",
                       histogram::latency_ms_buckets()};
  std::deque<pseq> waiting;
  int64_t queued_tokens = 0;      ///< tokens of `waiting` that count against max_queued_tokens
  std::optional<pseq> acquiring;  ///< the one request whose pages are being acquired
  std::vector<pseq> active;       ///< holding pages, being prefilled
  bool busy = false;              ///< a forward batch is at the worker
  std::vector<std::pair<std::string, int32_t>> in_flight;  ///< (id, tokens) of that batch
  bool retry_wait = false;
  /// The transfer ids of cross-node handoffs (the KvHandoff and the worker's kvSend carry the
  /// same); they start at the spawn time (64 per ms) so a restarted prefill node does not reuse
  /// the ids its predecessor left live at a decode node. The worker owns the sends themselves.
  std::optional<kv_transfer_ids> transfer_ids;
  /// Numbers the handoffs; starts at the spawn time (ms << 20) so a restarted prefill does not
  /// reuse the numbers of its predecessor.
  uint64_t next_handoff = 0;
  int64_t admitted = 0, requeues = 0, prompt_tokens_computed = 0, handoffs = 0, batches = 0;
  // --- credits to the router (what this scheduler can still take) and the drain rate they carry
  uint64_t received = 0;      ///< submissions taken off the mailbox (admitted or refused)
  uint64_t credit_seq = 0;
  int64_t last_credit_key[5] = {-1, -1, -1, -1, -1};
  drain_meter drain;               ///< the drain rate the credits carry
  int64_t drain_pending_tokens = 0;  ///< computed since the meter's last observation
  double tokens_per_s = 0;           ///< drain.tokens_per_s() as last reported
  int64_t queued_tokens_high_water = 0;
  int32_t queued_requests_high_water = 0;
  int64_t credits_sent = 0;
  drain_mode drain_ctl;  ///< tandem inspect --drain (not the queue's drain rate above)
  std::set<std::string> unreachable_decode;  ///< decode targets the node's decode proxy cannot reach
  std::unordered_map<std::string, int64_t> rejected;
  // --- the decode scheduler sharing the worker (opt.shares_worker), from its credits
  int32_t decode_running = 0, decode_waiting = 0, decode_max_running = 0;
  uint64_t local_handoffs = 0;          ///< handed to this node's decode scheduler (no transfer)
  uint64_t decode_took_handoffs = 0;    ///< of those, taken as of its last credit
  /// Handoffs on their way to decode: not in decode_waiting yet (the credit counts exactly
  /// which it has taken, so a credit sent before a step's handoffs arrived undercounts nothing).
  int64_t handoffs_in_transit() const { return int64_t(local_handoffs - std::min(decode_took_handoffs, local_handoffs)); }
  bool paused = false;            ///< a step was due but decode is backed up
  int64_t pause_start_ms = 0;
  int64_t pauses = 0, paused_ms = 0;
  static inline const char* name = "prefill";

  /// Decode, on the same worker, has a running batch and a full batch waiting for a slot:
  /// another prefill step would only add to that backlog and take the worker from it.
  bool decode_backed_up() const {
    const int32_t bound = opt.lim.prefill_pause_decode_waiting_seqs;
    // An idle decode batch uses no worker time: nothing to yield to (and sequences waiting
    // there for pages must not wait on prefill's). Handoffs on their way will join the batch.
    const int64_t transit = handoffs_in_transit();
    if (!opt.shares_worker || bound < 0 || decode_running + transit <= 0) return false;
    const int32_t at = bound > 0 ? bound : (decode_max_running > 0 ? decode_max_running : opt.lim.max_running_seqs);
    return decode_waiting + transit >= std::max(at, 1);
  }

  int32_t page_size() const { return opt.layout.page_size; }

  /// Prompt tokens admitted past the queue (acquiring pages or being prefilled) not computed yet.
  int64_t active_tokens() const {
    int64_t t = acquiring ? int64_t(acquiring->tokens.size()) : 0;
    for (const auto& q : active) t += int64_t(q.tokens.size()) - q.computed;
    return t;
  }

  /// Sends the router a credit if what it says changed (or `force`: a heartbeat answer).
  void send_credit(bool force) {
    if (!peers.router) return;
    const int64_t key[5] = {int64_t(waiting.size()), queued_tokens, active_tokens(), int64_t(tokens_per_s),
                            int64_t(received)};
    if (!force && std::equal(key, key + 5, last_credit_key)) return;
    std::copy(key, key + 5, last_credit_key);
    credits_sent += 1;
    peers.router.send_anon<msg::credit>([&](schema::Credit::Builder c) {
      c.setTarget(opt.node + "/prefill");
      c.setRole(schema::StageRole::PREFILL);
      c.setSeq(++credit_seq);
      c.setReceived(received);
      c.setQueuedRequests(static_cast<int32_t>(waiting.size()));
      c.setQueuedTokens(queued_tokens);
      c.setActiveTokens(key[2]);
      c.setFreeRequests(std::max<int32_t>(0, opt.lim.max_queued_requests - static_cast<int32_t>(waiting.size())));
      c.setFreeTokens(std::max<int64_t>(0, opt.lim.max_queued_tokens - queued_tokens));
      c.setTokensPerS(tokens_per_s);
      c.setFreePages(-1);
      c.setDraining(drain_ctl.draining());
      auto u = c.initUnreachable(static_cast<unsigned>(unreachable_decode.size()));
      unsigned i = 0;
      for (const auto& d : unreachable_decode) u.set(i++, d);
    });
  }

  /// Tells the drain meter the state the scheduler is in from now on (see drain_meter.h).
  void observe_drain() {
    // A step held for decode (paused) is a queue too: its sequences wait, and the rate the
    // router estimates waits from must count that time even when nothing else is waiting.
    const auto st = drain_state(!waiting.empty() || (paused && !active.empty()), queued_tokens + active_tokens(),
                                acquiring || !active.empty(),
                                opt.lim.prefill_chunk_tokens);
    drain.observe(clk->now_ms(), st, drain_pending_tokens);
    drain_pending_tokens = 0;
    tokens_per_s = drain.tokens_per_s();
  }

  void emit_event(const pseq& s, const std::vector<int32_t>& toks, finish_reason reason,
                  const tandem::error* err, request_stage state, std::span<const token_logprobs> lps = {}) {
    peers.router.send_anon(make_event(s.req.id, toks, reason, err, static_cast<int32_t>(s.req.prompt.size()),
                    s.req.cached_tokens, state, static_cast<int32_t>(s.req.generated.size() - toks.size()), lps));
  }
  void free_pages(const std::string& id, pool_pages& pages) { send_free_pages(peers.cache, id, pages); }
  void fail(pseq& s, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", s.req.id, e.what());
    free_pages(s.req.id, s.pages);
    emit_event(s, {}, finish_reason::error, &e, request_stage::prefill);
  }
};

using prefill_actor_t = caf::stateful_actor<prefill_state>;

void pump(prefill_actor_t* self);
void schedule_retry(prefill_actor_t* self);
/// The cache tier's answer to the head request's acquisition (prefill_batch.cpp).
void on_acquired(prefill_actor_t* self, const wire& w);
/// Sends the next chunked batch of the active sequences to the worker.
void start_batch(prefill_actor_t* self);

}  // namespace tandem::prefill_detail
