#include "actors/prefill_scheduler/prefill_scheduler.h"

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
#include "actors/common/wire.h"
#include "actors/prefill_scheduler/drain_meter.h"
#include "actors/router/router.h"
#include "actors/worker/kv_port.h"

namespace tandem {

namespace {

/// High 32 bits of this node's transfer ids (FNV-1a of the node name): ids of different
/// prefill nodes do not collide at a decode node.
uint64_t transfer_id_base(const std::string& node) {
  uint32_t h = 2166136261u;
  for (unsigned char c : node) h = (h ^ c) * 16777619u;
  return uint64_t(h | 1u) << 32;
}

struct pseq {
  seq_request req;
  std::vector<int32_t> tokens;  ///< prompt ++ generated: everything to compute
  std::vector<int32_t> pages;
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
  /// Cross-node handoffs whose source pages the worker is writing out: transfer id -> request.
  std::unordered_map<uint64_t, std::string> sending;
  std::unordered_map<std::string, uint64_t> sending_by_id;
  /// Low 32 bits of the transfer ids; starts at the spawn time (64 per ms) so a restarted
  /// prefill node does not reuse the ids its predecessor left live at a decode node.
  uint64_t next_transfer = 0;
  int64_t transfers_done = 0, transfers_failed = 0;
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
    emit(make_wire([&](schema::Envelope::Builder env) {
      auto c = env.initCredit();
      c.setTarget(opt.node + "/prefill");
      c.setRole("prefill");
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
    }));
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

  void emit(const wire& w) {
    peers.router.gate->enter_control();
    caf::anon_send(peers.router.handle, wire_atom::value, w);
  }
  void emit_event(const pseq& s, const std::vector<int32_t>& toks, finish_reason reason,
                  const tandem::error* err, const char* state, std::span<const token_logprobs> lps = {}) {
    emit(make_event(s.req.id, toks, reason, err, static_cast<int32_t>(s.req.prompt.size()),
                    s.req.cached_tokens, state, static_cast<int32_t>(s.req.generated.size() - toks.size()), lps));
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
  void fail(pseq& s, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", s.req.id, e.what());
    free_pages(s.req.id, s.pages);
    emit_event(s, {}, finish_reason::error, &e, "prefill");
  }
};

using prefill_actor_t = caf::stateful_actor<prefill_state>;

void pump(prefill_actor_t* self);

void schedule_retry(prefill_actor_t* self) {
  auto& s = self->state;
  if (s.retry_wait) return;
  s.retry_wait = true;
  self->delayed_send(self, std::chrono::milliseconds(s.opt.retry_ms), tick_atom::value);
}

void on_submit(prefill_actor_t* self, seq_request r, bool requeue) {
  auto& s = self->state;
  // A link that delivers twice (a retry across nodes) must not start the request twice.
  auto same = [&](const pseq& x) { return x.req.id == r.id; };
  if ((s.acquiring && same(*s.acquiring)) || std::any_of(s.waiting.begin(), s.waiting.end(), same) ||
      std::any_of(s.active.begin(), s.active.end(), same)) {
    s.rejected["duplicate_submit"] += 1;
    s.log->warn("request {}: duplicate {} ignored", r.id, requeue ? "requeue" : "submission");
    return;
  }
  pseq q;
  q.req = std::move(r);
  q.tokens = q.req.all_tokens();
  q.requeued = requeue;
  q.arrival_ms = s.clk->now_ms();
  if (requeue) {
    // Already admitted: preempted sequences go first (they are older than anything waiting).
    s.requeues += 1;
    s.log->info("request {}: requeued for recompute ({} tokens)", q.req.id, q.tokens.size());
    s.waiting.push_front(std::move(q));
    pump(self);
    return;
  }
  s.received += 1;
  const auto& lim = s.opt.lim;
  const int64_t n = static_cast<int64_t>(q.tokens.size());
  if (static_cast<int32_t>(s.waiting.size()) >= lim.max_queued_requests) {
    s.fail(q,
           tandem::error(
               error_kind::overloaded,
               fmt::format("prefill queue is full ({} requests waiting, limits.max_queued_requests = {}); "
                           "retry later",
                           s.waiting.size(), lim.max_queued_requests)),
           "queue_requests");
    return;
  }
  if (s.queued_tokens + n > lim.max_queued_tokens) {
    s.fail(q,
           tandem::error(error_kind::overloaded,
                         fmt::format("prefill queue holds {} prompt tokens; {} more would exceed "
                                     "limits.max_queued_tokens = {}; retry later",
                                     s.queued_tokens, n, lim.max_queued_tokens)),
           "queue_tokens");
    return;
  }
  s.admitted += 1;
  s.queued_tokens += n;
  s.waiting.push_back(std::move(q));
  s.queued_tokens_high_water = std::max(s.queued_tokens_high_water, s.queued_tokens);
  s.queued_requests_high_water = std::max(s.queued_requests_high_water, static_cast<int32_t>(s.waiting.size()));
  pump(self);
}

void on_acquired(prefill_actor_t* self, const wire& w) {
  auto& s = self->state;
  pseq q = std::move(*s.acquiring);
  s.acquiring.reset();
  try {
    wire_reader rd(w);
    auto env = rd.root();
    if (!env.isAcquireReply()) {
      auto e = env.isError() ? read_error(env.getError())
                             : tandem::error(error_kind::failed, "cache tier sent an unexpected reply");
      s.fail(q, e, "cache_error");
      return;
    }
    auto r = env.getAcquireReply();
    if (r.getOk()) {
      q.pages = to_vector(r.getPages());
      if (q.aborted) {
        s.free_pages(q.req.id, q.pages);
        return;
      }
      q.computed = r.getCachedTokens();
      if (!q.requeued) q.req.cached_tokens = r.getCachedTokens();
      q.start_ms = s.clk->now_ms();
      if (!q.requeued) s.queue_wait_ms.observe(double(q.start_ms - q.arrival_ms));
      s.log->debug("request {}: prefill starts ({} tokens, {} cached)", q.req.id, q.tokens.size(),
                   q.computed);
      s.emit_event(q, {}, finish_reason::none, nullptr, "prefill");
      s.active.push_back(std::move(q));
      return;
    }
    if (q.aborted) return;
    auto err = read_error(r.getError());
    if (r.getRetryable()) {
      // Pages are held by running requests and will come back: wait at the head of the queue
      // (the request's deadline bounds the wait).
      if (!q.requeued) s.queued_tokens += static_cast<int64_t>(q.tokens.size());
      s.waiting.push_front(std::move(q));
      schedule_retry(self);
      return;
    }
    s.fail(q,
           tandem::error(error_kind::overloaded,
                         fmt::format("{}; the prompt needs more pages than the whole pool", err.what())),
           "kv_pages");
  } catch (const tandem::error& e) {
    s.fail(q, e, "cache_error");
  }
}

void finish_prefill(prefill_actor_t* self, pseq& q, int32_t token, const token_logprobs* lp) {
  auto& s = self->state;
  const int32_t computed = q.computed;
  // Cache the full pages of what was computed before ownership moves on.
  if (s.opt.lim.prefix_cache) {
    s.peers.cache.gate->enter_control();
    self->send(s.peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto ins = env.initInsert();
                 ins.setId(q.req.id);
                 fill_list([&](unsigned n) { return ins.initTokens(n); }, q.tokens);
                 fill_list([&](unsigned n) { return ins.initPages(n); }, q.pages);
               }));
  }
  if (!q.requeued && q.start_ms >= 0) s.compute_ms.observe(double(s.clk->now_ms() - q.start_ms));
  auto reason = apply_token(q.req, token, s.opt.model);
  std::vector<int32_t> out;
  if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(token);
  // The token's log-probabilities travel with it (none for a stop token, which is not emitted).
  std::span<const token_logprobs> lps;
  if (lp && !out.empty() && q.req.logprobs >= 0) lps = std::span<const token_logprobs>(lp, 1);
  if (reason != finish_reason::none) {
    s.free_pages(q.req.id, q.pages);
    s.emit_event(q, out, reason, nullptr, "prefill", lps);
    return;
  }
  s.emit_event(q, out, finish_reason::none, nullptr, "decode", lps);
  if (!s.peers.decode.gate->try_enter()) {
    s.fail(q, s.peers.decode.gate->overloaded_error(), "decode_mailbox");
    return;
  }
  s.handoffs += 1;
  uint64_t tid = 0;
  if (!s.opt.remote_decode_node.empty()) {
    // The decode node the router chose ("node/decode"), or the configured first one. The
    // handoff names it too, so the decode proxy delivers it where the pages go.
    auto& dt = q.req.decode_target;
    if (dt.empty()) dt = s.opt.remote_decode_node + "/decode";
    const auto slash = dt.rfind('/');
    const std::string dst = slash == std::string::npos ? dt : dt.substr(0, slash);
    // The pages stay here until the worker has written them to the decode node's pool; the
    // decode scheduler allocates its own pages and pulls the KV with this transfer id.
    tid = transfer_id_base(s.opt.node) | (++s.next_transfer & 0xffffffffull);
    s.sending[tid] = q.req.id;
    s.sending_by_id[q.req.id] = tid;
    self->send(s.peers.worker.handle, kv_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto o = env.initKvSend();
                 o.setTransferId(tid);
                 o.setId(q.req.id);
                 o.setPeerNode(dst);
                 fill_list([&](unsigned n) { return o.initPages(n); }, q.pages);
               }));
  }
  if (tid == 0) s.local_handoffs += 1;
  self->send(s.peers.decode.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
               auto h = env.initHandoff();
               h.setHandoffSeq(s.next_handoff++);
               q.req.write(h.initRequest());
               auto kv = h.initKv();
               kv.setPoolId(s.opt.pool_id);
               kv.setNode(s.opt.node);
               fill_list([&](unsigned n) { return kv.initPageIds(n); }, q.pages);
               write_kv_layout(kv.initLayout(), s.opt.layout);
               kv.setValidTokens(computed);
               h.setTransferId(tid);
             }));
  q.pages.clear();  // ownership moved to the decode scheduler
}

/// The worker finished writing (or gave up on) the pages of a cross-node handoff.
void on_kv_done(prefill_actor_t* self, const wire& w) {
  auto& s = self->state;
  wire_reader rd(w);
  auto env = rd.root();
  if (!env.isKvDone()) return;
  auto d = env.getKvDone();
  auto it = s.sending.find(d.getTransferId());
  if (it == s.sending.end()) {
    s.log->warn("kv transfer {:#x}: completion for no handoff of this scheduler ignored", d.getTransferId());
    return;
  }
  std::string id = it->second;
  s.sending.erase(it);
  s.sending_by_id.erase(id);
  if (d.getDelivered()) {
    s.transfers_done += 1;
  } else {
    s.transfers_failed += 1;
    s.log->info("request {}: KV send ended without delivery: {}", id, d.getError().cStr());
  }
  auto pages = to_vector(d.getPages());
  s.free_pages(id, pages);
}

void on_forward_done(prefill_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  const std::vector<token_logprobs> lps = w && !err ? read_forward_logprobs(*w) : std::vector<token_logprobs>{};
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it = std::find_if(s.active.begin(), s.active.end(),
                           [&](const pseq& q) { return q.req.id == batch[i].first; });
    if (it == s.active.end()) continue;
    if (it->aborted) {
      s.free_pages(it->req.id, it->pages);
      s.active.erase(it);
      continue;
    }
    if (err) {
      s.fail(*it, *err, "worker_error");
      s.active.erase(it);
      continue;
    }
    it->computed += batch[i].second;
    s.prompt_tokens_computed += batch[i].second;
    if (it->computed == static_cast<int32_t>(it->tokens.size())) {
      finish_prefill(self, *it, i < sampled.size() ? sampled[i] : -1, i < lps.size() ? &lps[i] : nullptr);
      s.active.erase(it);
    }
  }
  if (!err)
    for (const auto& b : batch) s.drain_pending_tokens += b.second;
  pump(self);
}

void start_batch(prefill_actor_t* self) {
  auto& s = self->state;
  int32_t budget = s.opt.lim.prefill_chunk_tokens;
  capnp::MallocMessageBuilder mb;
  auto env = mb.initRoot<schema::Envelope>();
  auto fb = env.initForward();
  fb.setPhase("prefill");
  std::vector<pseq*> chosen;
  std::vector<int32_t> counts;
  for (auto& q : s.active) {
    if (budget <= 0) break;
    const int32_t left = static_cast<int32_t>(q.tokens.size()) - q.computed;
    const int32_t n = std::min(left, budget);
    if (n <= 0) continue;
    chosen.push_back(&q);
    counts.push_back(n);
    budget -= n;
  }
  if (chosen.empty()) return;
  auto seqs = fb.initSeqs(static_cast<unsigned>(chosen.size()));
  for (unsigned i = 0; i < chosen.size(); ++i) {
    auto& q = *chosen[i];
    auto st = seqs[i];
    st.setId(q.req.id);
    std::span<const int32_t> toks(q.tokens.data() + q.computed, static_cast<size_t>(counts[i]));
    fill_list([&](unsigned n) { return st.initTokens(n); }, toks);
    st.setPos(q.computed);
    const int32_t end = q.computed + counts[i];
    const size_t n_pages = static_cast<size_t>((end + s.page_size() - 1) / s.page_size());
    fill_list([&](unsigned n) { return st.initPages(n); }, std::span<const int32_t>(q.pages.data(), n_pages));
    const bool last = end == static_cast<int32_t>(q.tokens.size());
    st.setSample(last);
    // Only the sampling step needs the sampling (and the penalties their history).
    if (last) write_step_sampling(st, q.req);
    else st.setTokenIndex(static_cast<int32_t>(q.req.generated.size()));
    s.in_flight.emplace_back(q.req.id, counts[i]);
  }
  if (!s.peers.worker.gate->try_enter()) {
    // The batch's sequences end with the error (on_forward_done takes `in_flight`); clearing it
    // first failed nobody and pump() retried at once, recursing while the mailbox stayed full.
    auto e = s.peers.worker.gate->overloaded_error();
    on_forward_done(self, nullptr, &e);
    return;
  }
  s.busy = true;
  s.batches += 1;
  self->request(s.peers.worker.handle, caf::infinite, call_atom::value, make_wire(mb))
      .then([self](const wire& r) { on_forward_done(self, &r, nullptr); },
            [self](caf::error& e) {
              tandem::error te(error_kind::disconnected,
                               fmt::format("worker unreachable: {}", self->system().render(e)));
              on_forward_done(self, nullptr, &te);
            });
}

void pump(prefill_actor_t* self) {
  auto& s = self->state;
  if (!s.retry_wait && !s.acquiring && !s.waiting.empty() &&
      static_cast<int32_t>(s.active.size()) < s.opt.lim.max_prefill_batch_seqs) {
    s.acquiring = std::move(s.waiting.front());
    s.waiting.pop_front();
    auto& q = *s.acquiring;
    if (!q.requeued) s.queued_tokens -= static_cast<int64_t>(q.tokens.size());
    if (!s.peers.cache.gate->try_enter()) {
      pseq f = std::move(*s.acquiring);
      s.acquiring.reset();
      s.fail(f, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    } else {
      auto w = make_wire([&](schema::Envelope::Builder env) {
        auto a = env.initAcquire();
        a.setId(q.req.id);
        fill_list([&](unsigned n) { return a.initTokens(n); }, q.tokens);
        a.setUsePrefixCache(s.opt.lim.prefix_cache);
      });
      self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
          .then(
              [self](const wire& r) {
                on_acquired(self, r);
                pump(self);
              },
              [self](caf::error& e) {
                auto& st = self->state;
                pseq f = std::move(*st.acquiring);
                st.acquiring.reset();
                st.fail(f,
                        tandem::error(error_kind::disconnected,
                                      fmt::format("cache tier unreachable: {}", self->system().render(e))),
                        "cache_error");
                pump(self);
              });
    }
  }
  if (!s.busy && !s.active.empty()) {
    const bool hold = s.decode_backed_up();
    if (hold && !s.paused) {
      s.paused = true;
      s.pauses += 1;
      s.pause_start_ms = s.clk->now_ms();
    } else if (!hold && s.paused) {
      s.paused = false;
      s.paused_ms += s.clk->now_ms() - s.pause_start_ms;
    }
    if (!hold) start_batch(self);
  }
  s.observe_drain();
  s.send_credit(false);
}

void on_abort(prefill_actor_t* self, const std::string& id, int32_t hops) {
  auto& s = self->state;
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->req.id != id) continue;
    if (!it->requeued) s.queued_tokens -= static_cast<int64_t>(it->tokens.size());
    s.log->info("request {}: dropped from the prefill queue (abort)", id);
    s.waiting.erase(it);
    return;
  }
  if (s.acquiring && s.acquiring->req.id == id) {
    s.acquiring->aborted = true;
    return;
  }
  for (auto it = s.active.begin(); it != s.active.end(); ++it) {
    if (it->req.id != id) continue;
    s.log->info("request {}: prefill aborted at {}/{} tokens", id, it->computed, it->tokens.size());
    const bool running =
        std::any_of(s.in_flight.begin(), s.in_flight.end(), [&](auto& p) { return p.first == id; });
    if (running) {
      it->aborted = true;  // freed when the batch returns
    } else {
      s.free_pages(id, it->pages);
      s.active.erase(it);
    }
    return;
  }
  if (auto it = s.sending_by_id.find(id); it != s.sending_by_id.end()) {
    // The decode side drops its half; this side stops writing (pages come back by kvDone).
    s.log->info("request {}: KV send aborted", id);
    self->send(s.peers.worker.handle, kv_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 env.initKvAbort().setTransferId(it->second);
               }));
  }
  // Not here: it moved on to decode (or is on its way back); follow it.
  if (hops < 8) {
    s.peers.decode.gate->enter_control();
    self->send(s.peers.decode.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto a = env.initAbort();
                 a.setId(id);
                 a.setHops(hops + 1);
               }));
  }
}

caf::behavior prefill_actor(prefill_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                            std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.next_handoff = (static_cast<uint64_t>(st.clk->now_ms()) << 20) + 1;
  st.next_transfer = static_cast<uint64_t>(st.clk->now_ms()) * 64;
  return {
      [self](peers_atom, const peer_set& p) {
        self->state.peers = p;
        self->state.send_credit(true);  // the router's first view of this target
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isSubmit())
            on_submit(self, seq_request::read(env.getSubmit()), false);
          else if (env.isRequeue())
            on_submit(self, seq_request::read(env.getRequeue()), true);
          else if (env.isAbort())
            on_abort(self, env.getAbort().getId().cStr(), env.getAbort().getHops());
          else if (env.isCreditQuery()) {
            s.drain_ctl.on_query(env.getCreditQuery().getHolds());
            s.send_credit(true);
          } else if (env.isCredit() && env.getCredit().getRole() == "decode") {
            // The decode scheduler on this worker: a step held back for it may go now.
            auto c = env.getCredit();
            s.decode_running = c.getRunningSeqs();
            s.decode_waiting = c.getWaitingSeqs();
            s.decode_max_running = c.getMaxRunningSeqs();
            s.decode_took_handoffs = c.getReceived();
            pump(self);
          } else
            s.log->error("prefill: unexpected message dropped");
          // A refused submission or an abort changes no queue pump() saw: report it here.
          if (env.isSubmit() || env.isAbort()) s.send_credit(false);
        } catch (const tandem::error& e) {
          s.log->error("prefill: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("prefill: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](kv_atom, const wire& w) {
        try {
          on_kv_done(self, w);
        } catch (const std::exception& e) {
          self->state.log->error("prefill: bad KV transfer answer: {}", e.what());
        }
      },
      [self](tick_atom) {
        self->state.retry_wait = false;
        pump(self);
      },
      [self](drain_atom, bool on) -> bool {
        self->state.drain_ctl.set(on);
        self->state.send_credit(true);  // the router stops (or resumes) routing here
        return true;
      },
      // The node's decode proxy lost (or regained) a decode node: the router must not pair
      // this prefill target with it until it is back (Credit.unreachable).
      [self](node_down_atom, const std::string&, const std::string& target, const std::string&) {
        if (self->state.unreachable_decode.insert(target).second) self->state.send_credit(true);
      },
      [self](node_up_atom, const std::string&, const std::string& target) {
        if (self->state.unreachable_decode.erase(target)) self->state.send_credit(true);
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"drain_router_clear", "actor=\"prefill\"", s.drain_ctl.router_clear() ? 1.0 : 0.0, "gauge",
             "1 while draining once the router routes nothing here any more, else 0"},
            {"prefill_unreachable_decode_targets", "", double(s.unreachable_decode.size()), "gauge",
             "Decode nodes this node's KV handoffs cannot reach now (the router pairs no request of this "
             "prefill target with them)"},
            {"prefill_queued_requests", "", double(s.waiting.size()), "gauge",
             "Requests waiting for prefill"},
            {"prefill_queued_requests_bound", "", double(s.opt.lim.max_queued_requests), "gauge",
             "limits.max_queued_requests"},
            {"prefill_queued_tokens", "", double(s.queued_tokens), "gauge",
             "Prompt tokens waiting for prefill"},
            {"prefill_queued_tokens_bound", "", double(s.opt.lim.max_queued_tokens), "gauge",
             "limits.max_queued_tokens"},
            {"prefill_active_requests", "", double(s.active.size() + (s.acquiring ? 1 : 0)), "gauge",
             "Requests being prefilled"},
            {"prefill_admitted_total", "", double(s.admitted), "counter",
             "Requests admitted to the prefill queue"},
            {"prefill_requeues_total", "", double(s.requeues), "counter",
             "Preempted sequences taken back for recompute"},
            {"prefill_tokens_total", "", double(s.prompt_tokens_computed), "counter",
             "Tokens computed by prefill"},
            {"prefill_batches_total", "", double(s.batches), "counter", "Prefill forward batches"},
            {"kv_handoffs_total", "", double(s.handoffs), "counter", "KV handoffs to the decode scheduler"},
            {"prefill_kv_sends_inflight", "", double(s.sending.size()), "gauge",
             "Cross-node handoffs whose source pages are being written to the decode node"},
            {"prefill_kv_sends_total", "", double(s.transfers_done), "counter",
             "Cross-node handoffs whose KV pages were written to the decode node"},
            {"prefill_kv_send_failures_total", "", double(s.transfers_failed), "counter",
             "Cross-node handoffs whose KV send failed or was aborted"},
            {"prefill_queued_requests_high_water", "", double(s.queued_requests_high_water), "gauge",
             "Most requests ever waiting for prefill (never above limits.max_queued_requests)"},
            {"prefill_queued_tokens_high_water", "", double(s.queued_tokens_high_water), "gauge",
             "Most prompt tokens ever waiting for prefill (never above limits.max_queued_tokens)"},
            {"prefill_drain_tokens_per_s", "", s.tokens_per_s, "gauge",
             "Measured rate the prefill queue drains at (prompt tokens per wall second while requests wait; while it has work until a queue was seen)"},
            {"prefill_credits_sent_total", "", double(s.credits_sent), "counter",
             "Credits sent to the router (queue changes and heartbeat answers)"},
            {"prefill_decode_pauses_total", "", double(s.pauses), "counter",
             "Times a prefill step waited for the decode scheduler sharing the worker (limits.prefill_pause_decode_waiting_seqs)"},
            {"prefill_decode_paused_ms_total", "", double(s.paused_ms + (s.paused ? s.clk->now_ms() - s.pause_start_ms : 0)),
             "counter", "Time prefill steps waited for the decode scheduler sharing the worker (ms)"},
            {"prefill_decode_paused", "", s.paused ? 1.0 : 0.0, "gauge",
             "1 while a prefill step waits for the decode scheduler sharing the worker"},
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"prefill\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("prefill", m, {&s.queue_wait_ms, &s.compute_ms});
      },
  };
}

}  // namespace

bounded_actor spawn_prefill_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                      std::shared_ptr<const cluster_clock> clk,
                                      std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("prefill", opt.lim.prefill_mailbox);
  auto h = sys.spawn(prefill_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
