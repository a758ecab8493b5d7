#pragma once
/// The decode scheduler's state and the functions its parts share (decode_scheduler.cpp: the
/// actor, aborts, local prefills; decode_handoff.cpp: KV handoffs and transfers;
/// decode_batch.cpp: the continuous batch, page growth, preemption). Internal to the actor.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "actors/common/drain_mode.h"
#include "actors/common/kv_layout_wire.h"
#include "actors/common/logprobs_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/protocol.h"
#include "actors/common/receive.h"
#include "actors/common/seq_pages.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "actors/worker/forward_call.h"
#include "actors/worker/kv_port.h"

#include "actors/decode_scheduler/decode_scheduler.h"

namespace tandem::decode_detail {

struct dseq {
  seq_request req;
  pool_pages pages;        ///< per pool, by block (seq_pages.h)
  pool_pages source;       ///< cross-node handoff: the source's tables (which window blocks live)
  int32_t owned_from = 0;  ///< local prefill: blocks before this came from the prefix cache
  int32_t kv_len = 0;  ///< positions with KV; the last token (tokens.back()) is the next input
  bool aborted = false;
  uint64_t transfer_id = 0;  ///< cross-node handoff: the KV transfer that fills `pages`
  std::string source_node;
  int32_t source_pages = 0;
  /// Conditional disaggregation: a request the router sent here to be prefilled next to its
  /// decode batch. `fill` is prompt ++ generated; chunks of it run in the batch's steps until
  /// kv_len reaches its end, whose step samples the first token.
  bool prefilling = false;
  bool parked = false;  ///< a handoff that waited in page_waiting (its allocation is a retry)
  std::vector<int32_t> fill;
  /// n > 1 (decode_fork.cpp): the request's id on the wire (events, aborts) for the sequence
  /// and its forks, whose own ids are `group#cK`; empty for a request with one choice.
  std::string group;
  bool fork_first = false;  ///< a fork recomputing the last prompt position (not a local prefill)
  const std::string& wire_id() const { return group.empty() ? req.id : group; }
  int32_t total_len() const { return req.total_len(); }
};

struct decode_state {
  scheduler_options opt;
  peer_set peers;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  inbox box;  ///< the receive side (gate, log, unexpected-message counters)
  std::vector<dseq> running;
  std::deque<dseq> waiting;  ///< handed off, holding pages, waiting for a batch slot
  bool busy = false;         ///< an allocation or a forward is outstanding
  std::vector<std::pair<std::string, int32_t>> in_flight;  ///< (id, tokens) of the step at the worker
  /// Local prefills whose pages are being acquired: id -> aborted meanwhile.
  std::unordered_map<std::string, bool> local_acquiring;
  int64_t local_prefills = 0, local_prefill_tokens = 0;
  /// Cross-node handoffs: waiting for destination pages (by request id), then for the KV
  /// transfer (by transfer id). Bounded by the decode mailbox and the worker's transfer table.
  std::unordered_map<std::string, dseq> allocating;
  std::unordered_map<uint64_t, dseq> receiving;
  /// Handoffs that found the pool full: their KV stays on the source node (its pages are the
  /// backpressure) until a sequence here ends and frees pages. Bounded by max_running_seqs;
  /// beyond that, or with nothing here that could free pages, the transfer fails by policy.
  std::deque<dseq> page_waiting;
  bool page_retry_due = false;        ///< a sequence ended since the last retry
  bool page_retry_in_flight = false;  ///< one parked handoff is asking for pages
  int64_t handoffs_parked = 0;
  int64_t transfers_done = 0, transfers_failed = 0, transfer_recomputes = 0;
  int64_t steps = 0, tokens = 0, preemptions = 0, joined = 0;
  /// n > 1: sequences whose forks' pages are being taken and copied (by request id); bounded
  /// by the batch (each came from `waiting`).
  std::unordered_map<std::string, dseq> forking;
  int64_t forks = 0, fork_failures = 0, fork_tokens = 0;
  int32_t pool_free_pages = -1;  ///< KV pages free at the last allocation reply (-1 = none yet)
  int32_t pool_total_pages = 0;  ///< pages in the pool, from the allocation replies (0 = unknown)
  /// The lone sequence here found no page while others (prefills, transfers) hold the rest:
  /// allocation waits for a retry tick instead of failing it.
  bool page_stall = false;
  int64_t page_stalls = 0;
  uint64_t credit_seq = 0;
  int64_t last_credit_key[3] = {-2, -2, -2};
  /// Some sequence here holds pages it will give back: running, waiting for a slot, or whose
  /// KV is arriving (a handoff that got pages joins the batch when its transfer lands).
  bool pages_will_free() const { return !running.empty() || !waiting.empty() || !receiving.empty(); }
  int64_t credits_sent = 0;
  int64_t waiting_high_water = 0;      ///< most sequences ever waiting for a batch slot (seen at a credit)
  uint64_t local_handoffs = 0;         ///< handoffs taken from this node's prefill (no transfer)
  uint64_t prefill_told_handoffs = 0;  ///< local_handoffs as last sent to that prefill
  std::unordered_map<std::string, int64_t> rejected;
  drain_mode drain;  ///< tandem inspect --drain: no new work routed here; finish what is held
  /// The last `handoff_window` handoffs taken ("node/seq"), to recognize a link's late copies.
  static constexpr size_t handoff_window = 4096;
  std::unordered_set<std::string> taken_handoffs;
  std::deque<std::string> taken_order;
  static inline const char* name = "decode";

  int32_t page_size() const { return opt.layout.page_size; }
  int64_t running_tokens() const {
    int64_t t = 0;
    for (const auto& d : running) t += d.kv_len;
    return t;
  }
  int32_t pages_needed(const dseq& d) const {
    return (d.kv_len + 1 + page_size() - 1) / page_size() - static_cast<int32_t>(blocks_of(d.pages));
  }
  /// Pages per pool the next step of `d` lacks (pool 0's is pages_needed).
  std::vector<int32_t> pool_pages_needed(const dseq& d) const {
    if (!d.pages.empty()) return pages_lacking(d.pages, d.kv_len + 1, page_size());
    return pages_lacking(pool_pages(opt.pools.pools.size()), d.kv_len + 1, page_size());
  }
  void emit(const dseq& d, const std::vector<int32_t>& toks, finish_reason reason, const tandem::error* err,
            request_stage state, std::span<const token_logprobs> lps = {}) {
    peers.router.send_anon(make_event(d.wire_id(), toks, reason, err, static_cast<int32_t>(d.req.prompt.size()),
                              d.req.cached_tokens, state,
                              static_cast<int32_t>(d.req.generated.size() - toks.size()), lps, d.req.choice));
  }
  void free_pages(const std::string& id, pool_pages& pages) { send_free_pages(peers.cache, id, pages); }
  void fail(dseq& d, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", d.req.id, e.what());
    if (holds_pages(d.pages)) page_retry_due = true;
    free_pages(d.req.id, d.pages);
    emit(d, {}, finish_reason::error, &e, request_stage::decode);
  }
  /// Sends the router a credit if the batch, the waiting list or the free pages changed
  /// (or `force`: a heartbeat answer).
  /// The same credit goes to the prefill scheduler sharing this node's worker, which pauses
  /// while decode is backed up (limits.prefill_pause_decode_waiting_seqs).
  void send_credit(bool force) {
    waiting_high_water = std::max<int64_t>(waiting_high_water, int64_t(waiting.size() + page_waiting.size()));
    const bool to_prefill = opt.shares_worker && peers.prefill;
    if (!peers.router && !to_prefill) return;
    const int64_t key[3] = {int64_t(running.size()), int64_t(waiting.size() + page_waiting.size()),
                            pool_free_pages};
    const bool changed = force || !std::equal(key, key + 3, last_credit_key);
    if (!changed && !(to_prefill && prefill_told_handoffs != local_handoffs)) return;
    std::copy(key, key + 3, last_credit_key);
    credits_sent += 1;
    auto fill = [&](schema::Credit::Builder c) {
      c.setTarget(opt.node + "/decode");
      c.setRole(schema::StageRole::DECODE);
      c.setSeq(credit_seq);
      c.setFreePages(pool_free_pages);
      c.setRunningSeqs(static_cast<int32_t>(running.size()));
      c.setWaitingSeqs(static_cast<int32_t>(waiting.size() + page_waiting.size()));
      c.setMaxRunningSeqs(opt.lim.max_running_seqs);
      c.setReceived(local_handoffs);
      c.setDraining(drain.draining());
    };
    ++credit_seq;
    if (to_prefill) {
      prefill_told_handoffs = local_handoffs;
      peers.prefill.send_anon<msg::credit>(fill);
    }
    if (peers.router && changed) peers.router.send_anon<msg::credit>(fill);
  }
  dseq* find(const std::string& id) {
    for (auto& d : running)
      if (d.req.id == id) return &d;
    return nullptr;
  }
};

using decode_actor_t = caf::stateful_actor<decode_state>;

void pump(decode_actor_t* self);
void request_handoff_pages(decode_actor_t* self, dseq d);
/// Sends `d` back for recompute through the router (decode_handoff.cpp).
void requeue(decode_actor_t* self, const dseq& d);
/// A cross-node handoff's transfer failed: recompute or fail by the transfer policy.
void transfer_failed(decode_actor_t* self, dseq d, const std::string& why);
/// Tells the source node to let go of a handoff's pages.
void release_source(decode_actor_t* self, const dseq& q);
void on_kv_done(decode_actor_t* self, schema::KvTransferDone::Reader k);
void on_handoff(decode_actor_t* self, schema::KvHandoff::Reader h);
void preempt_or_fail(decode_actor_t* self);
/// n > 1: forks the waiting sequences that have their prompt's KV and first token and were not
/// forked yet (decode_fork.cpp); true if one is being forked now.
void start_forks(decode_actor_t* self);
/// Aborts the forks of request `id` (every choice, or only `choice` >= 0); true if any was here.
bool abort_forks(decode_actor_t* self, const std::string& id, int32_t choice);

}  // namespace tandem::decode_detail
