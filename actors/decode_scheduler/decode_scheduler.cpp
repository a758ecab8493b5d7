#include "actors/decode_scheduler/decode_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "actors/common/drain_mode.h"
#include "actors/common/kv_layout_wire.h"
#include "actors/common/pool_pages_wire.h"
#include "actors/common/logprobs_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "actors/worker/kv_port.h"

namespace tandem {

namespace {

struct dseq {
  seq_request req;
  std::vector<int32_t> pages;
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
  int32_t total_len() const { return req.total_len(); }
};

struct decode_state {
  scheduler_options opt;
  peer_set peers;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
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
    return (d.kv_len + 1 + page_size() - 1) / page_size() - static_cast<int32_t>(d.pages.size());
  }
  void emit(const dseq& d, const std::vector<int32_t>& toks, finish_reason reason, const tandem::error* err,
            const char* state, std::span<const token_logprobs> lps = {}) {
    peers.router.gate->enter_control();
    caf::anon_send(peers.router.handle, wire_atom::value,
                   make_event(d.req.id, toks, reason, err, static_cast<int32_t>(d.req.prompt.size()),
                              d.req.cached_tokens, state,
                              static_cast<int32_t>(d.req.generated.size() - toks.size()), lps));
  }
  void free_pages(const std::string& id, std::vector<int32_t>& pages) {
    if (pages.empty()) return;
    peers.cache.gate->enter_control();
    caf::anon_send(peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                     auto f = env.initFree();
                     f.setId(id);
                     fill_list([&](unsigned n) { return f.initPages(n); }, pages);
                   }));
    pages.clear();
  }
  void fail(dseq& d, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", d.req.id, e.what());
    if (!d.pages.empty()) page_retry_due = true;
    free_pages(d.req.id, d.pages);
    emit(d, {}, finish_reason::error, &e, "decode");
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
    auto w = make_wire([&](schema::Envelope::Builder env) {
      auto c = env.initCredit();
      c.setTarget(opt.node + "/decode");
      c.setRole("decode");
      c.setSeq(++credit_seq);
      c.setFreePages(pool_free_pages);
      c.setRunningSeqs(static_cast<int32_t>(running.size()));
      c.setWaitingSeqs(static_cast<int32_t>(waiting.size() + page_waiting.size()));
      c.setMaxRunningSeqs(opt.lim.max_running_seqs);
      c.setReceived(local_handoffs);
      c.setDraining(drain.draining());
    });
    if (to_prefill) {
      prefill_told_handoffs = local_handoffs;
      peers.prefill.gate->enter_control();
      caf::anon_send(peers.prefill.handle, wire_atom::value, w);
    }
    if (peers.router && changed) {
      peers.router.gate->enter_control();
      caf::anon_send(peers.router.handle, wire_atom::value, std::move(w));
    }
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

/// Sends `d` back for recompute (prompt ++ generated) through the router, after its
/// "preempted" event. The router places it on a prefill target it knows to be alive: this
/// node may not know yet that a prefill node died (a failed KV transfer from it is often the
/// first sign here), and a requeue sent to a dead node would be lost with nobody to end it.
void requeue(decode_actor_t* self, const dseq& d) {
  auto& s = self->state;
  s.peers.router.gate->enter_control();  // already admitted: must not be dropped
  self->send(s.peers.router.handle, wire_atom::value,
             make_wire([&](schema::Envelope::Builder env) { d.req.write(env.initRequeue()); }));
}

/// A cross-node handoff whose KV transfer failed (or could not start): the configured policy.
void transfer_failed(decode_actor_t* self, dseq d, const std::string& why) {
  auto& s = self->state;
  s.transfers_failed += 1;
  s.free_pages(d.req.id, d.pages);
  if (d.aborted) return;
  if (s.opt.transfer_failure_policy == "recompute" && d.req.transfer_retries < s.opt.max_transfer_retries) {
    s.transfer_recomputes += 1;
    d.req.transfer_retries += 1;
    s.log->info("request {}: KV transfer from node {} failed ({}); re-prefilling (retry {} of {})", d.req.id,
                d.source_node, why, d.req.transfer_retries, s.opt.max_transfer_retries);
    // Like a preemption: the tokens so far were emitted; prefill recomputes prompt ++ generated.
    s.emit(d, {}, finish_reason::none, nullptr, "preempted");
    requeue(self, d);
    return;
  }
  s.rejected["kv_transfer"] += 1;
  s.fail(d,
         tandem::error(error_kind::disconnected,
                       fmt::format("KV transfer of request {} from prefill node {} to decode node {} failed: {}{}; "
                                   "retry the request",
                                   d.req.id, d.source_node, s.opt.node, why,
                                   s.opt.transfer_failure_policy == "recompute"
                                       ? fmt::format(" (after {} re-prefills)", d.req.transfer_retries)
                                       : std::string(" (transfer.failure_policy = fail)"))),
         "kv_transfer");
}

/// Destination pages for a cross-node handoff, then the transfer order to the worker.
void start_remote_handoff(decode_actor_t* self, dseq d, uint64_t tid, std::string source, const kv_layout& got) {
  auto& s = self->state;
  d.transfer_id = tid;
  d.source_node = std::move(source);
  d.source_pages = static_cast<int32_t>(d.pages.size());
  d.pages.clear();  // the source's page ids: not ours
  if (!(got == s.opt.layout)) {
    transfer_failed(self, std::move(d),
                    fmt::format("layout {} of the source differs from {} here", got.describe(), s.opt.layout.describe()));
    return;
  }
  const int32_t need = (d.kv_len + s.page_size() - 1) / s.page_size();
  if (d.kv_len != d.total_len() - 1 || need != d.source_pages || s.allocating.count(d.req.id)) {
    transfer_failed(self, std::move(d),
                    fmt::format("handoff with {} valid tokens in {} pages for {} tokens of sequence", d.kv_len,
                                d.source_pages, d.total_len()));
    return;
  }
  request_handoff_pages(self, std::move(d));
}

/// Tells the source node to let go of a handoff's pages (its transfer will not happen).
void release_source(decode_actor_t* self, const dseq& q) {
  auto& st = self->state;
  st.peers.prefill.gate->enter_control();
  self->send(st.peers.prefill.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
               auto a = env.initAbort();
               a.setId(q.req.id);
               a.setHops(8);  // only the prefill's transfer: do not chase it back here
             }));
}

/// Destination pages for a validated handoff; a full pool parks it (see page_waiting).
void request_handoff_pages(decode_actor_t* self, dseq d) {
  auto& s = self->state;
  const int32_t need = d.source_pages;
  if (!s.peers.cache.gate->try_enter()) {
    release_source(self, d);
    transfer_failed(self, std::move(d), "the cache tier's mailbox is full");
    return;
  }
  std::string id = d.req.id;
  s.allocating.emplace(id, std::move(d));
  auto w = make_wire([&](schema::Envelope::Builder env) {
    auto a = env.initAlloc();
    a.setId(id);
    a.setCount(need);
  });
  self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
      .then(
          [self, id](const wire& r) {
            auto& st = self->state;
            auto it = st.allocating.find(id);
            if (it == st.allocating.end()) return;
            dseq q = std::move(it->second);
            st.allocating.erase(it);
            const bool retry = q.parked;
            if (retry) st.page_retry_in_flight = false;
            std::string why = "no free KV pages on the decode node";
            bool exhausted = false;
            try {
              wire_reader rd(r);
              auto env = rd.root();
              if (env.isAllocReply()) st.pool_free_pages = env.getAllocReply().getFree();
              if (env.isAllocReply() && env.getAllocReply().getOk()) {
                q.pages = to_vector(env.getAllocReply().getPages());
                why.clear();
              } else if (env.isAllocReply()) {
                auto e = read_error(env.getAllocReply().getError());
                why = e.what();
                exhausted = e.kind() == error_kind::overloaded;
              }
            } catch (const tandem::error& e) {
              why = e.what();
            }
            if (q.aborted) {
              st.free_pages(q.req.id, q.pages);
              release_source(self, q);
              pump(self);
              return;
            }
            // A full pool while sequences here will end and free pages: wait for them instead
            // of failing (a preempted sequence's recompute lands here while its batch is busy,
            // or while the pages are held by handoffs whose KV is still arriving).
            const bool can_free = st.pages_will_free();
            if (!why.empty() && exhausted && can_free &&
                (retry || static_cast<int32_t>(st.page_waiting.size()) < st.opt.lim.max_running_seqs)) {
              if (!q.parked) {
                st.handoffs_parked += 1;
                st.log->info("request {}: no KV pages for its handoff yet ({}); it waits for a sequence to end",
                             q.req.id, why);
              }
              q.parked = true;
              if (retry)
                st.page_waiting.push_front(std::move(q));
              else
                st.page_waiting.push_back(std::move(q));
              st.send_credit(false);
              return;
            }
            if (!why.empty()) {
              release_source(self, q);
              transfer_failed(self, std::move(q), why);
              pump(self);
              return;
            }
            const uint64_t tid = q.transfer_id;
            self->send(st.peers.worker.handle, kv_atom::value, make_wire([&](schema::Envelope::Builder env) {
                         auto o = env.initKvReceive();
                         o.setTransferId(tid);
                         o.setId(q.req.id);
                         o.setPeerNode(q.source_node);
                         write_pool_pages(o, pool_pages{q.pages});
                       }));
            st.receiving.emplace(tid, std::move(q));
            if (retry) pump(self);  // the next parked one may fit too
          },
          [self, id](caf::error& e) {
            auto& st = self->state;
            auto it = st.allocating.find(id);
            if (it == st.allocating.end()) return;
            dseq q = std::move(it->second);
            st.allocating.erase(it);
            if (q.parked) st.page_retry_in_flight = false;
            release_source(self, q);
            transfer_failed(self, std::move(q), fmt::format("cache tier unreachable: {}", self->system().render(e)));
          });
}

/// The worker's answer for a transfer: the KV is in the pages (join the batch) or it failed.
void on_kv_done(decode_actor_t* self, const wire& w) {
  auto& s = self->state;
  wire_reader rd(w);
  auto env = rd.root();
  if (!env.isKvDone()) return;
  auto k = env.getKvDone();
  auto it = s.receiving.find(k.getTransferId());
  if (it == s.receiving.end()) {
    s.log->warn("kv transfer {:#x}: completion for no handoff of this scheduler ignored", k.getTransferId());
    return;
  }
  dseq d = std::move(it->second);
  s.receiving.erase(it);
  d.pages = read_pool_pages(k).front();
  if (d.aborted || !k.getDelivered()) {
    // Its pages come back: a parked handoff may fit now (it waited for them).
    if (d.aborted) s.free_pages(d.req.id, d.pages);
    else transfer_failed(self, std::move(d), k.getError().cStr());
    s.page_retry_due = true;
    pump(self);
    return;
  }
  s.transfers_done += 1;
  s.waiting.push_back(std::move(d));
  pump(self);
}

void on_handoff(decode_actor_t* self, schema::KvHandoff::Reader h) {
  auto& s = self->state;
  dseq d;
  d.req = seq_request::read(h.getRequest());
  // A link that delivers twice (a retry across nodes) must not make two sequences share the
  // pages. A copy of a handoff already taken (even one whose sequence has ended since) is
  // ignored; a second computation of a sequence held here (a duplicated submission) is freed.
  const std::string key = fmt::format("{}/{}", h.getKv().getNode().cStr(), h.getHandoffSeq());
  if (s.taken_handoffs.count(key)) {
    s.rejected["duplicate_handoff"] += 1;
    s.log->warn("request {}: copy of KV handoff {} ignored", d.req.id, key);
    return;
  }
  s.taken_handoffs.insert(key);
  s.taken_order.push_back(key);
  if (s.taken_order.size() > decode_state::handoff_window) {
    s.taken_handoffs.erase(s.taken_order.front());
    s.taken_order.pop_front();
  }
  bool held = s.find(d.req.id) != nullptr;
  for (const auto& x : s.waiting) held = held || x.req.id == d.req.id;
  if (held) {
    s.rejected["duplicate_handoff"] += 1;
    s.log->warn("request {}: second KV handoff of a running sequence; its pages are freed", d.req.id);
    auto pages = to_vector(h.getKv().getPageIds());
    s.free_pages(d.req.id, pages);
    return;
  }
  auto kv = h.getKv();
  d.pages = to_vector(kv.getPageIds());
  d.kv_len = kv.getValidTokens();
  kv_layout got;  // a malformed layout stays empty: refused below as differing from ours
  try {
    got = read_kv_layout(kv.getLayout());
  } catch (const tandem::error& e) {
    s.log->warn("request {}: KV handoff with a malformed layout: {}", d.req.id, e.what());
  }
  if (h.getTransferId() != 0) {
    start_remote_handoff(self, std::move(d), h.getTransferId(), kv.getNode().cStr(), got);
    return;
  }
  if (std::string(kv.getPoolId().cStr()) != s.opt.pool_id || !(got == s.opt.layout)) {
    // Cross-pool handoff needs a KV transfer this build does not do; the pages stay where they are.
    tandem::error e(
        error_kind::unimplemented,
        fmt::format("KV handoff from pool {} ({}) to pool {} ({}) needs a page transfer, which is not "
                    "implemented; run prefill and decode on the same worker",
                    kv.getPoolId().cStr(), got.describe(), s.opt.pool_id, s.opt.layout.describe()));
    d.pages.clear();
    s.fail(d, e, "handoff");
    return;
  }
  if (d.kv_len != d.total_len() - 1) {
    s.fail(d,
           tandem::error(error_kind::failed,
                         fmt::format("handoff with {} valid tokens for {} tokens of sequence", d.kv_len,
                                     d.total_len())),
           "handoff");
    return;
  }
  s.waiting.push_back(std::move(d));
  pump(self);
}

/// Frees the pages of the youngest sequence and sends it back for recompute; false if
/// `needy` is the only candidate (then it fails instead).
void preempt_or_fail(decode_actor_t* self) {
  auto& s = self->state;
  const size_t candidates = s.running.size() + s.waiting.size();
  if (candidates == 1) {
    // Alone here, but if it fits in the pool, the pages it lacks are held elsewhere (a
    // prefill, a transfer): they come back, or arrive here as a sequence that can be
    // preempted. Retry after opt.retry_ms rather than fail a request that fits (its deadline
    // still bounds the wait). Only a sequence larger than the whole pool fails now.
    const dseq& d = s.running.empty() ? s.waiting.front() : s.running.front();
    const int64_t need = int64_t(d.pages.size()) + std::max(0, s.pages_needed(d));
    if (s.pool_total_pages > 0 && need <= s.pool_total_pages) {
      if (!s.page_stall) {
        s.page_stall = true;
        s.page_stalls += 1;
        self->delayed_send(self, std::chrono::milliseconds(std::max(1, s.opt.retry_ms)), tick_atom::value);
      }
      return;
    }
  }
  // The youngest across running and waiting sequences.
  uint64_t best = 0;
  bool in_waiting = false;
  size_t idx = 0;
  for (size_t i = 0; i < s.running.size(); ++i)
    if (s.running[i].req.admit_order >= best)
      best = s.running[i].req.admit_order, idx = i, in_waiting = false;
  for (size_t i = 0; i < s.waiting.size(); ++i)
    if (s.waiting[i].req.admit_order >= best) best = s.waiting[i].req.admit_order, idx = i, in_waiting = true;
  if (candidates == 0) return;
  dseq victim = in_waiting ? std::move(s.waiting[idx]) : std::move(s.running[idx]);
  if (in_waiting)
    s.waiting.erase(s.waiting.begin() + static_cast<std::ptrdiff_t>(idx));
  else
    s.running.erase(s.running.begin() + static_cast<std::ptrdiff_t>(idx));
  if (candidates == 1) {
    s.fail(
        victim,
        tandem::error(error_kind::overloaded,
                      fmt::format("request {}: KV cache exhausted at {} tokens and no other sequence can be "
                                  "preempted; lower max_tokens or raise limits.kv_cache_mb / device_pages",
                                  victim.req.id, victim.total_len())),
        "kv_pages");
    return;
  }
  s.preemptions += 1;
  s.log->info("request {}: preempted at {} tokens (KV cache full), requeued for recompute", victim.req.id,
              victim.total_len());
  s.free_pages(victim.req.id, victim.pages);
  s.emit(victim, {}, finish_reason::none, nullptr, "preempted");
  requeue(self, victim);
}

void on_step_done(decode_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  const std::vector<token_logprobs> lps = w && !err ? read_forward_logprobs(*w) : std::vector<token_logprobs>{};
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it = std::find_if(s.running.begin(), s.running.end(),
                           [&](const dseq& d) { return d.req.id == batch[i].first; });
    if (it == s.running.end()) continue;
    if (it->aborted) {
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      s.running.erase(it);
      continue;
    }
    if (err || i >= sampled.size()) {
      s.fail(*it, err ? *err : tandem::error(error_kind::failed, "worker returned too few tokens"),
             "worker_error");
      s.running.erase(it);
      continue;
    }
    it->kv_len += batch[i].second;
    if (it->prefilling) {
      s.local_prefill_tokens += batch[i].second;
      if (it->kv_len < static_cast<int32_t>(it->fill.size())) continue;  // more chunks to go
      it->prefilling = false;  // the prompt is in; this step sampled the first token
      it->fill.clear();
    } else {
      s.tokens += 1;
    }
    const int32_t tok = sampled[i];
    auto reason = apply_token(it->req, tok, s.opt.model);
    std::vector<int32_t> out;
    if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(tok);
    // The token's log-probabilities travel with it (none for a stop token, which is not emitted).
    std::span<const token_logprobs> lp;
    if (!out.empty() && it->req.logprobs >= 0 && i < lps.size()) lp = std::span<const token_logprobs>(&lps[i], 1);
    s.emit(*it, out, reason, nullptr, "decode", lp);
    if (reason != finish_reason::none) {
      // Cache prompt ++ generated (the next turn of a conversation starts with them) before
      // the pages go back; the cache takes its own references.
      if (s.opt.lim.prefix_cache) {
        auto all = it->req.all_tokens();
        all.resize(static_cast<size_t>(std::min<int64_t>(int64_t(all.size()), it->kv_len)));
        s.peers.cache.gate->enter_control();
        caf::anon_send(s.peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                         auto ins = env.initInsert();
                         ins.setId(it->req.id);
                         fill_list([&](unsigned n) { return ins.initTokens(n); }, all);
                         fill_list([&](unsigned n) { return ins.initPages(n); }, it->pages);
                       }));
      }
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      s.running.erase(it);
    }
  }
  pump(self);
}

void start_step(decode_actor_t* self) {
  auto& s = self->state;
  capnp::MallocMessageBuilder mb;
  auto fb = mb.initRoot<schema::Envelope>().initForward();
  fb.setPhase("decode");
  // Local prefills take chunks of at most prefill_chunk_tokens per step in all, so the decode
  // sequences beside them are not held up by a long prompt.
  int32_t budget = std::max(1, s.opt.lim.prefill_chunk_tokens);
  std::vector<std::pair<dseq*, int32_t>> chosen;
  for (auto& d : s.running) {
    if (!d.prefilling) {
      chosen.emplace_back(&d, 1);
      continue;
    }
    const int32_t n = std::min(budget, static_cast<int32_t>(d.fill.size()) - d.kv_len);
    if (n <= 0) continue;
    chosen.emplace_back(&d, n);
    budget -= n;
  }
  auto seqs = fb.initSeqs(static_cast<unsigned>(chosen.size()));
  for (unsigned i = 0; i < chosen.size(); ++i) {
    auto& d = *chosen[i].first;
    const int32_t n = chosen[i].second;
    auto st = seqs[i];
    st.setId(d.req.id);
    const int32_t last = d.req.generated.empty() ? 0 : d.req.generated.back();
    std::span<const int32_t> toks = d.prefilling ? std::span<const int32_t>(d.fill.data() + d.kv_len, size_t(n))
                                                 : std::span<const int32_t>(&last, 1);
    fill_list([&](unsigned k) { return st.initTokens(k); }, toks);
    st.setPos(d.kv_len);
    fill_list([&](unsigned k) { return st.initPages(k); }, d.pages);
    st.setSample(!d.prefilling || d.kv_len + n == static_cast<int32_t>(d.fill.size()));
    write_step_sampling(st, d.req);
    s.in_flight.emplace_back(d.req.id, n);
  }
  if (!s.peers.worker.gate->try_enter()) {
    auto e = s.peers.worker.gate->overloaded_error();
    on_step_done(self, nullptr, &e);
    return;
  }
  s.busy = true;
  s.steps += 1;
  self->request(s.peers.worker.handle, caf::infinite, call_atom::value, make_wire(mb))
      .then([self](const wire& r) { on_step_done(self, &r, nullptr); },
            [self](caf::error& e) {
              tandem::error te(error_kind::disconnected,
                               fmt::format("worker unreachable: {}", self->system().render(e)));
              on_step_done(self, nullptr, &te);
            });
}

void on_alloc(decode_actor_t* self, const wire& w,
              const std::vector<std::pair<std::string, int32_t>>& wants) {
  auto& s = self->state;
  s.busy = false;
  std::vector<int32_t> pages;
  bool ok = false;
  try {
    wire_reader rd(w);
    auto env = rd.root();
    if (env.isAllocReply()) {
      s.pool_free_pages = env.getAllocReply().getFree();
      if (env.getAllocReply().getTotal() > 0) s.pool_total_pages = env.getAllocReply().getTotal();
    }
    if (env.isAllocReply() && env.getAllocReply().getOk()) {
      pages = to_vector(env.getAllocReply().getPages());
      ok = true;
    }
  } catch (const tandem::error& e) {
    s.log->error("decode: bad allocation reply: {}", e.what());
  }
  if (!ok) {
    preempt_or_fail(self);
    pump(self);
    return;
  }
  size_t next = 0;
  std::vector<int32_t> spare;
  for (const auto& [id, n] : wants) {
    dseq* d = s.find(id);
    for (int32_t k = 0; k < n && next < pages.size(); ++k, ++next) {
      if (d && !d->aborted)
        d->pages.push_back(pages[next]);
      else
        spare.push_back(pages[next]);
    }
  }
  s.free_pages("decode", spare);
  pump(self);
}

void pump_once(decode_actor_t* self);

void pump(decode_actor_t* self) {
  pump_once(self);
  self->state.send_credit(false);
}

void pump_once(decode_actor_t* self) {
  auto& s = self->state;
  if (s.busy || s.page_stall) return;
  // Aborted sequences not in a batch leave now.
  for (auto it = s.running.begin(); it != s.running.end();) {
    if (it->aborted) {
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      it = s.running.erase(it);
    } else {
      ++it;
    }
  }
  // A parked handoff asks again once a sequence has ended (not on preemptions: pages freed to
  // make room for the batch are not for newcomers), or when nothing is left that could free any.
  if (!s.page_waiting.empty() && !s.page_retry_in_flight && (s.page_retry_due || !s.pages_will_free())) {
    s.page_retry_due = false;
    s.page_retry_in_flight = true;
    dseq q = std::move(s.page_waiting.front());
    s.page_waiting.pop_front();
    request_handoff_pages(self, std::move(q));
  }
  while (!s.waiting.empty() && static_cast<int32_t>(s.running.size()) < s.opt.lim.max_running_seqs) {
    s.running.push_back(std::move(s.waiting.front()));
    s.waiting.pop_front();
    s.joined += 1;
  }
  if (s.running.empty()) return;
  std::vector<std::pair<std::string, int32_t>> wants;
  int32_t total = 0;
  for (const auto& d : s.running) {
    const int32_t n = s.pages_needed(d);
    if (n > 0) {
      wants.emplace_back(d.req.id, n);
      total += n;
    }
  }
  if (total == 0) {
    start_step(self);
    return;
  }
  if (!s.peers.cache.gate->try_enter()) {
    // Treat a full cache-tier mailbox like an empty pool: shed the youngest.
    preempt_or_fail(self);
    pump(self);
    return;
  }
  s.busy = true;
  auto w = make_wire([&](schema::Envelope::Builder env) {
    auto a = env.initAlloc();
    a.setId(wants.front().first);
    a.setCount(total);
  });
  self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
      .then([self, wants](const wire& r) { on_alloc(self, r, wants); },
            [self](caf::error& e) {
              auto& st = self->state;
              st.busy = false;
              st.log->error("decode: cache tier unreachable: {}", self->system().render(e));
              tandem::error te(error_kind::disconnected, "cache tier unreachable");
              for (auto& d : st.running) st.fail(d, te, "cache_error");
              st.running.clear();
            });
}

/// Conditional disaggregation: the router sent a short prompt here to be prefilled in the
/// decode batch (no prefill queue, no KV transfer). Its pages come from this node's pool; it
/// joins the batch like a handoff and runs as prefill chunks until its first token.
void on_local_submit(decode_actor_t* self, seq_request r) {
  auto& s = self->state;
  bool held = s.find(r.id) != nullptr || s.local_acquiring.count(r.id) > 0;
  for (const auto& x : s.waiting) held = held || x.req.id == r.id;
  if (held) {
    s.rejected["duplicate_submit"] += 1;
    s.log->warn("request {}: duplicate local prefill ignored", r.id);
    return;
  }
  dseq d;
  d.req = std::move(r);
  const int64_t taken = int64_t(s.running.size() + s.waiting.size() + s.local_acquiring.size());
  if (taken >= s.opt.lim.max_running_seqs) {
    // Bounded like the batch it joins; the router retries it on the prefill path.
    s.fail(d,
           tandem::error(error_kind::overloaded,
                         fmt::format("decode node {} has no free batch slot for a local prefill ({} sequences, "
                                     "limits.max_running_seqs = {}); retry on a prefill node",
                                     s.opt.node, taken, s.opt.lim.max_running_seqs)),
           "local_prefill_slots");
    return;
  }
  if (!s.peers.cache.gate->try_enter()) {
    s.fail(d, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    return;
  }
  d.fill = d.req.all_tokens();
  const std::string id = d.req.id;
  s.local_acquiring[id] = false;
  auto w = make_wire([&](schema::Envelope::Builder env) {
    auto a = env.initAcquire();
    a.setId(id);
    fill_list([&](unsigned n) { return a.initTokens(n); }, d.fill);
    a.setUsePrefixCache(s.opt.lim.prefix_cache);
  });
  self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
      .then(
          [self, d](const wire& reply) mutable {
            auto& st = self->state;
            auto it = st.local_acquiring.find(d.req.id);
            const bool aborted = it != st.local_acquiring.end() && it->second;
            if (it != st.local_acquiring.end()) st.local_acquiring.erase(it);
            std::string why = "the cache tier sent an unexpected reply";
            int32_t cached = 0;
            try {
              wire_reader rd(reply);
              auto env = rd.root();
              if (env.isAcquireReply() && env.getAcquireReply().getOk()) {
                d.pages = to_vector(env.getAcquireReply().getPages());
                cached = env.getAcquireReply().getCachedTokens();
                why.clear();
              } else if (env.isAcquireReply()) {
                why = read_error(env.getAcquireReply().getError()).what();
              } else if (env.isError()) {
                why = read_error(env.getError()).what();
              }
            } catch (const tandem::error& e) {
              why = e.what();
            }
            if (aborted) {
              st.free_pages(d.req.id, d.pages);
              return;
            }
            if (!why.empty()) {
              st.fail(d,
                      tandem::error(error_kind::overloaded,
                                    fmt::format("no KV pages on decode node {} for a local prefill of {} tokens: {}; "
                                                "retry on a prefill node",
                                                st.opt.node, d.fill.size(), why)),
                      "kv_pages");
              return;
            }
            // At least the last token is computed: its step samples the first completion token.
            d.kv_len = std::clamp(cached, 0, static_cast<int32_t>(d.fill.size()) - 1);
            d.req.cached_tokens = d.kv_len;
            d.prefilling = true;
            st.local_prefills += 1;
            st.log->debug("request {}: local prefill ({} tokens, {} cached)", d.req.id, d.fill.size(), d.kv_len);
            st.emit(d, {}, finish_reason::none, nullptr, "prefill");
            st.waiting.push_back(std::move(d));
            pump(self);
          },
          [self, d](caf::error& e) mutable {
            auto& st = self->state;
            st.local_acquiring.erase(d.req.id);
            st.fail(d,
                    tandem::error(error_kind::disconnected,
                                  fmt::format("cache tier unreachable: {}", self->system().render(e))),
                    "cache_error");
          });
}

void on_abort(decode_actor_t* self, const std::string& id, int32_t hops) {
  auto& s = self->state;
  if (auto it = s.local_acquiring.find(id); it != s.local_acquiring.end()) {
    it->second = true;  // its pages are freed when the acquisition returns
    return;
  }
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->req.id != id) continue;
    s.page_retry_due = true;
    s.free_pages(id, it->pages);
    s.waiting.erase(it);
    pump(self);
    return;
  }
  for (auto it = s.page_waiting.begin(); it != s.page_waiting.end(); ++it) {
    if (it->req.id != id) continue;
    release_source(self, *it);  // its KV pages are still on the source node
    s.page_waiting.erase(it);
    s.send_credit(false);
    return;
  }
  if (auto it = s.allocating.find(id); it != s.allocating.end()) {
    it->second.aborted = true;  // its pages are freed when the allocation returns
    return;
  }
  for (auto& [tid, d] : s.receiving) {
    if (d.req.id != id) continue;
    if (!d.aborted) {
      d.aborted = true;  // pages come back by kvDone (after quarantine if a put may still land)
      const uint64_t t = tid;
      self->send(s.peers.worker.handle, kv_atom::value,
                 make_wire([&](schema::Envelope::Builder env) { env.initKvAbort().setTransferId(t); }));
    }
    return;
  }
  if (dseq* d = s.find(id)) {
    s.log->info("request {}: decode aborted after {} tokens", id, d->req.generated.size());
    d->aborted = true;  // leaves at the next pump (after the batch in flight, if any)
    pump(self);
    return;
  }
  if (hops < 8) {  // on its way back to prefill (preempted): follow it
    s.peers.prefill.gate->enter_control();
    self->send(s.peers.prefill.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto a = env.initAbort();
                 a.setId(id);
                 a.setHops(hops + 1);
               }));
  }
}

/// A prefill node went down (this node's prefill proxy saw it): the handoffs whose KV is still
/// there (parked for pages, or arriving) fail now by the transfer policy (recompute through the
/// router, or an error), at node-down instead of when their transfer times out.
void on_source_down(decode_actor_t* self, const std::string& node, const std::string& why) {
  auto& s = self->state;
  for (auto it = s.page_waiting.begin(); it != s.page_waiting.end();) {
    if (it->source_node != node) {
      ++it;
      continue;
    }
    dseq d = std::move(*it);
    it = s.page_waiting.erase(it);
    transfer_failed(self, std::move(d), why);
  }
  for (auto& [tid, d] : s.receiving) {
    if (d.source_node != node || d.aborted) continue;
    const uint64_t t = tid;  // the worker answers with a failed kvDone: the policy applies there
    self->send(s.peers.worker.handle, kv_atom::value,
               make_wire([&](schema::Envelope::Builder env) { env.initKvAbort().setTransferId(t); }));
  }
  s.send_credit(false);
}

caf::behavior decode_actor(decode_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  return {
      [self](peers_atom, const peer_set& p) {
        self->state.peers = p;
        self->state.send_credit(true);
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isHandoff()) {
            // The prefill scheduler sharing the worker counts this handoff as on its way
            // until a credit counts it taken, changed or not (a refused one changes nothing).
            if (env.getHandoff().getTransferId() == 0) s.local_handoffs += 1;
            on_handoff(self, env.getHandoff());
            s.send_credit(false);
          } else if (env.isSubmit())
            on_local_submit(self, seq_request::read(env.getSubmit()));
          else if (env.isAbort())
            on_abort(self, env.getAbort().getId().cStr(), env.getAbort().getHops());
          else if (env.isCreditQuery()) {
            s.drain.on_query(env.getCreditQuery().getHolds());
            s.send_credit(true);
          } else
            s.log->error("decode: unexpected message dropped");
        } catch (const tandem::error& e) {
          s.log->error("decode: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("decode: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](tick_atom) {
        self->state.page_stall = false;
        pump(self);
      },
      [self](kv_atom, const wire& w) {
        try {
          on_kv_done(self, w);
        } catch (const std::exception& e) {
          self->state.log->error("decode: bad KV transfer answer: {}", e.what());
        }
      },
      [self](node_down_atom, const std::string& role, const std::string& target, const std::string& why) {
        if (role == "prefill") on_source_down(self, target.substr(0, target.rfind('/')), why);
      },
      [self](node_up_atom, const std::string&, const std::string&) {},
      [self](drain_atom, bool on) -> bool {
        self->state.drain.set(on);
        self->state.send_credit(true);  // the router stops (or resumes) routing here
        return true;
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"drain_router_clear", "actor=\"decode\"", s.drain.router_clear() ? 1.0 : 0.0, "gauge",
             "1 while draining once the router routes nothing here any more, else 0"},
            {"decode_running_requests", "", double(s.running.size()), "gauge",
             "Sequences in the decode batch"},
            {"decode_running_tokens", "", double(s.running_tokens()), "gauge",
             "Context tokens (with KV) of the sequences in the decode batch"},
            {"decode_running_bound", "", double(s.opt.lim.max_running_seqs), "gauge",
             "limits.max_running_seqs"},
            {"decode_waiting_requests", "", double(s.waiting.size()), "gauge",
             "Handed-off sequences waiting for a batch slot"},
            {"decode_waiting_requests_high_water", "", double(s.waiting_high_water), "gauge",
             "Most sequences ever waiting for a decode batch slot (limits.max_decode_waiting_seqs refuses beyond)"},
            {"decode_steps_total", "", double(s.steps), "counter", "Decode forward steps"},
            {"decode_tokens_total", "", double(s.tokens), "counter", "Tokens sampled by decode steps"},
            {"decode_preemptions_total", "", double(s.preemptions), "counter",
             "Sequences preempted on KV page exhaustion (requeued for recompute)"},
            {"decode_page_stalls_total", "", double(s.page_stalls), "counter",
             "Allocations retried later: the lone sequence fits the pool but others held the pages"},
            {"decode_kv_receiving_requests", "", double(s.receiving.size() + s.allocating.size()), "gauge",
             "Cross-node handoffs waiting for their KV pages (allocation or transfer)"},
            {"decode_kv_page_waiting_requests", "", double(s.page_waiting.size()), "gauge",
             "Cross-node handoffs waiting for a sequence here to end and free KV pages (bound: "
             "limits.max_running_seqs)"},
            {"decode_kv_handoffs_parked_total", "", double(s.handoffs_parked), "counter",
             "Cross-node handoffs that found the KV pool full and waited for pages"},
            {"decode_kv_receives_total", "", double(s.transfers_done), "counter",
             "Cross-node handoffs whose KV pages arrived"},
            {"decode_kv_receive_failures_total", "", double(s.transfers_failed), "counter",
             "Cross-node handoffs whose KV transfer failed (then recomputed or failed by policy)"},
            {"decode_kv_recomputes_total", "", double(s.transfer_recomputes), "counter",
             "Requests re-prefilled after a failed KV transfer (transfer.failure_policy = recompute)"},
            {"decode_local_prefills_total", "", double(s.local_prefills), "counter",
             "Requests prefilled in the decode batch (conditional disaggregation)"},
            {"decode_local_prefill_tokens_total", "", double(s.local_prefill_tokens), "counter",
             "Prompt tokens computed by local prefill chunks in decode steps"},
            {"decode_credits_sent_total", "", double(s.credits_sent), "counter",
             "Credits sent to the router and a prefill scheduler sharing the worker (batch/page changes, handoffs taken, heartbeat answers)"},
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"decode\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("decode", m, {});
      },
  };
}

}  // namespace

bounded_actor spawn_decode_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                     std::shared_ptr<const cluster_clock> clk,
                                     std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("decode", opt.lim.decode_mailbox);
  auto h = sys.spawn(decode_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
