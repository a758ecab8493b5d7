#include "actors/router/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <cmath>
#include <deque>
#include <map>
#include <optional>
#include <unordered_map>

#include "actors/common/logprobs_wire.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

token_event error_event(const std::string& request_id, const tandem::error& e, int32_t prompt_tokens) {
  token_event ev;
  ev.request_id = request_id;
  ev.finished = true;
  ev.reason = finish_reason::error;
  ev.err = e;
  ev.prompt_tokens = prompt_tokens;
  return ev;
}

struct callback_box::guard {
  event_callback cb;
  std::string id;
  int32_t prompt_tokens = 0;
  bool taken = false;
  ~guard() {
    if (taken || !cb) return;
    try {
      cb(error_event(id,
                     tandem::error(error_kind::disconnected,
                                   "the router failed before it read the request; retry it"),
                     prompt_tokens));
    } catch (...) {  // a destructor must not throw; the callback's failure has nowhere to go
    }
  }
};

callback_box::callback_box(event_callback cb, std::string request_id, int32_t prompt_tokens)
    : g_(std::make_shared<guard>()) {
  g_->cb = std::move(cb);
  g_->id = std::move(request_id);
  g_->prompt_tokens = prompt_tokens;
}

event_callback callback_box::take() const {
  if (!g_ || g_->taken) return {};
  g_->taken = true;
  return std::move(g_->cb);
}

namespace {

using retry_atom = caf::atom_constant<caf::atom("retry")>;
using heartbeat_atom = caf::atom_constant<caf::atom("heartbt")>;

/// Whether a target still answers while requests are there: any credit or event from it is a
/// sign of life. Silent for 1.5 heartbeats with work in flight (after queries every half
/// heartbeat) = lost, as is a target whose node went down; a later credit brings it back.
struct liveness {
  int64_t heard_ms = 0;   ///< last credit or event from it
  int64_t query_ms = -1;  ///< last credit query sent while requests were there
  bool lost = false;
  std::string lost_why;
  int64_t lost_total = 0;
};

/// A prefill target as the router sees it: its last credit plus what was sent since.
struct prefill_target {
  route_target t;
  target_load load;            ///< from the last credit (queued_* without the in-transit part)
  int64_t active_tokens = 0;
  uint64_t sent = 0;           ///< submissions sent to it
  std::deque<int64_t> in_transit;  ///< prompt tokens of submissions it has not taken yet
  int64_t in_transit_tokens = 0;
  uint64_t last_seq = 0;
  target_health health;
  circuit_breaker breaker;
  int64_t routed = 0;
  liveness live;

  int64_t queued_requests() const { return load.queued_requests + int64_t(in_transit.size()); }
  int64_t queued_tokens() const { return load.queued_tokens + in_transit_tokens; }
  /// Everything ahead of a new request: waiting, in transit and not yet computed.
  int64_t backlog_tokens() const { return queued_tokens() + active_tokens; }
};

struct decode_target {
  route_target t;
  target_load load;
  uint64_t last_seq = 0;
  target_health health;
  circuit_breaker breaker;
  int64_t routed = 0;
  liveness live;
};

/// One stage event, read off the wire (kept while an earlier one is missing).
struct stage_event {
  std::vector<int32_t> tokens;
  std::vector<token_logprobs> logprobs;  ///< parallel to tokens when the request asked
  bool finished = false;
  finish_reason reason = finish_reason::none;
  std::optional<tandem::error> err;
};

struct entry {
  event_callback cb;
  /// Kept for re-routing. Its id is the current attempt's: the client's id, or after a
  /// migration `id#mN`, so events of an attempt given up on are told apart and dropped.
  seq_request req;
  std::string id;    ///< the client's id (the table's key)
  int prefill = 0;   ///< index of its prefill target
  int decode = -1;   ///< index of its decode target (-1: the prefill's own)
  bool local = false;  ///< prefilled on its decode target (conditional disaggregation)
  int32_t retries = 0;
  std::vector<int> tried;  ///< prefill targets that refused it
  int64_t submit_ms = 0;
  int64_t first_token_ms = -1;
  int64_t last_token_ms = -1;
  int64_t deadline_ms = 0;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  std::string state = "queued";
  int64_t stage_since_ms = 0;  ///< when it reached its current stage (silence counts from here at most)
  std::vector<int32_t> emitted;  ///< tokens delivered (with migration on: the continuation's `generated`)
  int32_t migrations = 0;
  std::vector<int> lost_prefill, lost_decode;  ///< targets it lost: never again for this request
  /// Events that overtook an earlier one, by completion index (at most max_new_tokens + 1).
  std::map<int32_t, stage_event> early;
};

/// Where a request goes, or why it cannot go anywhere now.
struct placement {
  int prefill = -1, decode = -1;
  bool local = false;  ///< send it to the decode target to be prefilled there
  std::optional<tandem::error> err;
  std::string reason;
  int64_t retry_after_ms = 0;
};

struct router_state {
  router_options opt;
  std::vector<prefill_target> prefills;
  std::vector<decode_target> decodes;
  std::optional<route_policy> policy;
  std::mt19937_64 jitter;
  int64_t start_ms = 0;
  int64_t retries_total = 0, local_prefill_candidates = 0, local_prefills = 0;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::unordered_map<std::string, entry> table;
  std::unordered_map<std::string, std::string> attempt_ids;  ///< `id#mN` -> id, one per migrated entry
  int64_t migrations_total = 0;
  std::unordered_map<std::string, int64_t> migration_failures;  ///< by reason
  uint64_t next_order = 1;
  bool tick_pending = false;
  bool stopped = false;
  int64_t requests_total = 0, tokens_generated = 0, prompt_tokens_total = 0;
  std::unordered_map<std::string, int64_t> finished_by_reason;
  std::unordered_map<std::string, int64_t> rejected_by_reason;
  histogram ttft{"ttft_ms", "Time to first token (ms)", histogram::latency_ms_buckets()};
  histogram tpot{"tpot_ms", "Time per output token after the first (ms)", histogram::latency_ms_buckets()};
  histogram e2e{"e2e_ms", "Request latency from submit to finish (ms)", histogram::latency_ms_buckets()};
  static inline const char* name = "router";

  static void deliver(const event_callback& cb, token_event ev, spdlog::logger& log) {
    try {
      if (cb) cb(std::move(ev));
    } catch (const std::exception& e) {
      log.error("request {}: event callback threw: {}", ev.request_id, e.what());
    }
  }

  void reject(const std::string& id, const event_callback& cb, const tandem::error& e,
              const std::string& reason, int32_t prompt_tokens, int64_t retry_after_ms = 0) {
    rejected_by_reason[reason] += 1;
    finished_by_reason["error"] += 1;
    log->info("request {}: rejected ({}): {}", id, reason, e.what());
    auto ev = error_event(id, e, prompt_tokens);
    ev.reject_reason = reason;
    ev.retry_after_ms = retry_after_ms;
    deliver(cb, std::move(ev), *log);
  }

  /// Ends an in-flight request with a final event it did not get from a stage.
  void finish_here(const std::string& id, finish_reason reason, const tandem::error* err,
                   const std::string& reject_reason = "", int64_t retry_after_ms = 0) {
    auto it = table.find(id);
    if (it == table.end()) return;
    token_event ev;
    ev.request_id = id;
    ev.finished = true;
    ev.reason = reason;
    if (err) ev.err = *err;
    ev.prompt_tokens = it->second.prompt_tokens;
    ev.completion_tokens = it->second.completion_tokens;
    ev.cached_tokens = it->second.cached_tokens;
    ev.reject_reason = reject_reason;
    ev.retry_after_ms = retry_after_ms;
    account_finish(it->second, reason);
    auto cb = std::move(it->second.cb);
    erase(it);
    deliver(cb, std::move(ev), *log);
  }

  using entry_it = std::unordered_map<std::string, entry>::iterator;

  /// The entry whose current attempt is `wid` (the client's id, or `id#mN` after a
  /// migration), or table.end() (ended, or an attempt given up on).
  entry_it find_attempt(const std::string& wid) {
    auto it = table.find(wid);
    if (it != table.end() && it->second.req.id == wid) return it;
    auto a = attempt_ids.find(wid);
    if (a == attempt_ids.end()) return table.end();
    it = table.find(a->second);
    return it != table.end() && it->second.req.id == wid ? it : table.end();
  }

  void erase(entry_it it) {
    if (it->second.req.id != it->first) attempt_ids.erase(it->second.req.id);
    table.erase(it);
  }

  /// A router that exits with requests in flight (a failure, or the supervisor restarting the
  /// node's actors) ends each with `disconnected`, so no client waits for events that never come.
  ~router_state() {
    if (table.empty()) return;
    tandem::error err(error_kind::disconnected,
                      "the node's actors failed and were restarted before the request finished; retry it");
    std::vector<std::string> ids;
    for (const auto& kv : table) ids.push_back(kv.first);
    for (const auto& id : ids) finish_here(id, finish_reason::error, &err);
  }

  void account_finish(const entry& e, finish_reason reason) {
    static const char* names[] = {"none", "stop", "length", "abort", "error"};
    finished_by_reason[names[static_cast<int>(reason)]] += 1;
    int64_t now = clk->now_ms();
    e2e.observe(double(now - e.submit_ms));
    if (e.completion_tokens > 1 && e.first_token_ms >= 0)
      tpot.observe(double(e.last_token_ms - e.first_token_ms) / double(e.completion_tokens - 1));
  }

  int32_t pages_for(int64_t tokens) const {
    const int32_t ps = std::max(1, opt.lim.page_size);
    return static_cast<int32_t>((tokens + ps - 1) / ps);
  }

  /// Time until target `p` could take `n` more tokens under the bound that refused it.
  int64_t drain_ms(const prefill_target& p, int64_t excess_tokens) const {
    const int64_t w = estimate_queue_wait_ms(std::max<int64_t>(excess_tokens, 1), p.load.prefill_tokens_per_s);
    return w < 0 ? 1000 : std::max<int64_t>(w, 1);
  }

  /// Empty if target `p` can place a request of `n` prompt tokens now, else why not.
  /// A continuation (a migrated stream) skips the queue-wait estimate: it was admitted already.
  std::optional<placement> check_prefill(const prefill_target& p, int64_t n, bool continuation = false) const {
    const auto& lim = opt.lim;
    placement no;
    const int64_t qr = p.queued_requests(), qt = p.queued_tokens();
    if (qr >= lim.max_queued_requests) {
      const int64_t per = qr > 0 ? std::max<int64_t>(qt / qr, 1) : n;
      no.reason = "queue_requests";
      no.retry_after_ms = drain_ms(p, (qr - lim.max_queued_requests + 1) * per + p.active_tokens);
      no.err = tandem::error(error_kind::overloaded,
                             fmt::format("prefill target {} has {} requests queued (limits.max_queued_requests = {}); "
                                         "retry after {} ms",
                                         p.t.name, qr, lim.max_queued_requests, no.retry_after_ms));
      return no;
    }
    if (qt + n > lim.max_queued_tokens) {
      no.reason = "queue_tokens";
      no.retry_after_ms = drain_ms(p, qt + n - lim.max_queued_tokens + p.active_tokens);
      no.err = tandem::error(error_kind::overloaded,
                             fmt::format("prefill target {} holds {} queued prompt tokens; {} more would exceed "
                                         "limits.max_queued_tokens = {}; retry after {} ms",
                                         p.t.name, qt, n, lim.max_queued_tokens, no.retry_after_ms));
      return no;
    }
    if (!continuation && lim.max_queue_wait_ms > 0 && !fits_next_batch(lim, qr, p.backlog_tokens(), n)) {
      const int64_t wait = estimate_queue_wait_ms(p.backlog_tokens() + n, p.load.prefill_tokens_per_s);
      if (wait > lim.max_queue_wait_ms) {
        no.reason = "queue_wait";
        no.retry_after_ms = std::max<int64_t>(wait - lim.max_queue_wait_ms, 1);
        no.err = tandem::error(
            error_kind::overloaded,
            fmt::format("prefill target {} would make the request wait ~{} ms ({} tokens ahead at {:.0f} tokens/s; "
                        "limits.max_queue_wait_ms = {}); retry after {} ms",
                        p.t.name, wait, p.backlog_tokens(), p.load.prefill_tokens_per_s, lim.max_queue_wait_ms,
                        no.retry_after_ms));
        return no;
      }
    }
    return std::nullopt;
  }

  /// A refusal because the decode target is backed up: overloaded, retry in a second (a
  /// decode backlog drains by whole sequences, not at a rate the router measures).
  static placement decode_busy(placement& out, const char* reason, std::string what) {
    out.prefill = -1;
    out.reason = reason;
    out.retry_after_ms = 1000;
    out.err = tandem::error(error_kind::overloaded, std::move(what));
    return out;
  }

  /// Chooses a (prefill, decode) pair that can place `r`, avoiding `avoid` where another
  /// target exists, and never one in `never_prefill` / `never_decode` (targets the request
  /// lost). A continuation (`r.generated` set: a migrated stream) skips the soft admission
  /// estimates (queue wait, decode pages, decode queue); the hard queue bounds still hold.
  placement place(const seq_request& r, const std::vector<int>& avoid, const std::vector<int>& never_prefill = {},
                  const std::vector<int>& never_decode = {}) {
    const int64_t now = clk->now_ms();
    const bool continuation = !r.generated.empty();
    const std::vector<int32_t> all = continuation ? r.all_tokens() : std::vector<int32_t>{};
    const std::vector<int32_t>& tokens = continuation ? all : r.prompt;
    const int64_t n = static_cast<int64_t>(tokens.size());
    auto in = [](const std::vector<int>& v, size_t i) { return std::find(v.begin(), v.end(), int(i)) != v.end(); };
    std::vector<target_load> loads;
    std::vector<bool> ok;
    bool any = false;
    for (size_t i = 0; i < prefills.size(); ++i) {
      auto& p = prefills[i];
      target_load l = p.load;
      l.queued_requests = p.queued_requests();
      l.queued_tokens = p.backlog_tokens();
      loads.push_back(l);
      const bool up =
          p.health.healthy(now, start_ms) && p.breaker.would_allow(now) && !p.live.lost && !in(never_prefill, i);
      ok.push_back(up);
      any = any || up;
    }
    placement out;
    if (!any) {
      out.reason = "no_target";
      out.retry_after_ms = opt.lim.breaker_cooldown_ms;
      std::string why;
      bool only_late = false;  // some target is only late with its credits: busy, not gone
      for (size_t i = 0; i < prefills.size(); ++i) {
        const auto& p = prefills[i];
        if (p.live.lost) why += fmt::format("; {} lost: {}", p.t.name, p.live.lost_why);
        only_late = only_late || (!p.live.lost && p.breaker.would_allow(now) && !in(never_prefill, i));
      }
      if (only_late) {
        // A scheduler too busy to send credits in time is overloaded, not disconnected: 503
        // with Retry-After (a client backs off) rather than 502 (a client reconnects elsewhere).
        out.err = tandem::error(
            error_kind::overloaded,
            fmt::format("no prefill target of {} sent credits within 3 heartbeats (limits.router_heartbeat_ms = {}): "
                        "the schedulers are too busy to report; retry after {} ms",
                        prefills.size(), opt.lim.router_heartbeat_ms, out.retry_after_ms));
        return out;
      }
      out.err = tandem::error(error_kind::disconnected,
                              fmt::format("no healthy prefill target of {}{} (stale credits, open circuit breakers "
                                          "or lost{}); retry on another node",
                                          prefills.size(), never_prefill.empty() ? "" : " that this request did not lose",
                                          why));
      return out;
    }
    {
      auto pref = ok;
      bool left = false;
      for (int a : avoid)
        if (a >= 0 && size_t(a) < pref.size()) pref[size_t(a)] = false;
      for (bool b : pref) left = left || b;
      if (left) ok = pref;  // a fresh target if there is one, else the same again
    }
    std::optional<placement> first_no;
    int32_t cached = 0;
    for (size_t k = 0; k < prefills.size(); ++k) {
      int t = policy->choose_prefill(tokens, loads, ok, &cached);
      if (t < 0) break;
      auto no = check_prefill(prefills[size_t(t)], n, continuation);
      if (!no) {
        out.prefill = t;
        break;
      }
      if (!first_no) first_no = std::move(no);
      ok[size_t(t)] = false;
    }
    if (out.prefill < 0) return *first_no;
    if (!decodes.empty()) {
      std::vector<target_load> dl;
      std::vector<bool> dok;
      for (size_t i = 0; i < decodes.size(); ++i) {
        const auto& d = decodes[i];
        dl.push_back(d.load);
        dok.push_back(d.health.healthy(now, start_ms) && d.breaker.would_allow(now) && !d.live.lost &&
                      !in(never_decode, i));
      }
      const int d = policy->choose_decode(dl, dok);
      if (d < 0) {
        out.prefill = -1;
        out.reason = "no_target";
        out.retry_after_ms = opt.lim.breaker_cooldown_ms;
        std::string lost, why;
        for (int i : never_decode) lost += (lost.empty() ? "" : ", ") + decodes[size_t(i)].t.name;
        bool all_lost = true;
        std::string names;
        for (const auto& d : decodes) {
          if (d.live.lost) why += fmt::format("; {} lost: {}", d.t.name, d.live.lost_why);
          all_lost = all_lost && d.live.lost;
          names += (names.empty() ? "" : ", ") + d.t.name;
        }
        if (all_lost)
          why = fmt::format("; no decode node is reachable (down: {}; {})", names, decodes.front().live.lost_why);
        bool only_late = false;  // as for prefill: a decode target late with credits is busy
        for (size_t i = 0; i < decodes.size(); ++i)
          only_late = only_late || (!decodes[i].live.lost && decodes[i].breaker.would_allow(now) && !in(never_decode, i));
        if (only_late) {
          out.err = tandem::error(
              error_kind::overloaded,
              fmt::format("no decode target of {} sent credits within 3 heartbeats (limits.router_heartbeat_ms = {}): "
                          "the schedulers are too busy to report; retry after {} ms",
                          decodes.size(), opt.lim.router_heartbeat_ms, out.retry_after_ms));
          return out;
        }
        out.err = tandem::error(error_kind::disconnected,
                                fmt::format("no healthy decode target of {}{}{}; retry on another node", decodes.size(),
                                            lost.empty() ? "" : " other than " + lost, why));
        return out;
      }
      const auto& dlo = decodes[size_t(d)].load;
      const int32_t need = pages_for(n + 1);
      if (!continuation && opt.lim.decode_page_admission && dlo.free_pages >= 0 && dlo.waiting_seqs > 0 && dlo.free_pages < need) {
        // The decode batch is full and backed up with sequences holding pages: a new one
        // would only be preempted (recomputed) or fail there.
        return decode_busy(out, "decode_pages",
                           fmt::format("decode target {} has {} free KV pages and {} sequences waiting for a batch "
                                       "slot; the prompt needs {} pages; retry later or raise limits.kv_cache_mb",
                                       decodes[size_t(d)].t.name, dlo.free_pages, dlo.waiting_seqs, need));
      }
      const int32_t wait_bound = opt.lim.max_decode_waiting_seqs > 0 ? opt.lim.max_decode_waiting_seqs
                                                                      : 2 * dlo.max_running_seqs;
      if (!continuation && opt.lim.max_decode_waiting_seqs >= 0 && wait_bound > 0 && dlo.waiting_seqs >= wait_bound) {
        // Prefill outruns decode in a burst: sequences pile up waiting for a batch slot, each
        // holding its pages, and every new one would wait behind them.
        return decode_busy(out, "decode_queue",
                           fmt::format("decode target {} has {} sequences waiting for a slot in its batch of {} "
                                       "(limits.max_decode_waiting_seqs = {}); retry later or add decode capacity",
                                       decodes[size_t(d)].t.name, dlo.waiting_seqs, dlo.max_running_seqs,
                                       opt.lim.max_decode_waiting_seqs));
      }
      out.decode = d;
      // Conditional disaggregation: would this prompt be better prefilled next to its decode batch?
      int64_t shortest = -1;
      for (const auto& p : prefills) {
        const int64_t w = estimate_queue_wait_ms(p.backlog_tokens(), p.load.prefill_tokens_per_s);
        if (w >= 0 && (shortest < 0 || w < shortest)) shortest = w;
      }
      if (prefill_locally(opt.local_prefill, static_cast<int32_t>(n), cached, shortest, dlo)) {
        local_prefill_candidates += 1;
        // Acted on only where it saves a KV transfer (the decode target runs on another node
        // than the prefill target), and only if the decode pool can hold the prompt now: its
        // pages come from there at once, not after a queue.
        const auto node_of = [](const std::string& name) { return name.substr(0, name.rfind('/')); };
        const bool other_node = node_of(decodes[size_t(d)].t.name) != node_of(prefills[size_t(out.prefill)].t.name);
        const bool fits = dlo.free_pages < 0 || dlo.free_pages >= need;
        out.local = other_node && fits;
      }
    }
    return out;
  }

  /// A sign of life of a target: a lost one is back (its node restarted or its link healed).
  /// True when it was lost.
  bool heard(liveness& l, const std::string& name, int64_t now) {
    l.heard_ms = std::max(l.heard_ms, now);
    if (!l.lost) return false;
    l.lost = false;
    log->info("target {} answers again; new requests may go there", name);
    return true;
  }

  /// A lost target that answers again is a fresh start: the breaker that its lost requests
  /// opened closes, and a restarted node numbers its credits from 1 again.
  template <class T>
  void back(T& t) {
    t.breaker.on_success();
    t.last_seq = 0;
  }

  void on_credit(schema::Credit::Reader c) {
    const std::string name = c.getTarget().cStr();
    const int64_t now = clk->now_ms();
    if (std::string(c.getRole().cStr()) == "decode") {
      for (auto& d : decodes) {
        if (d.t.name != name) continue;
        d.health.on_credit(now);
        if (heard(d.live, d.t.name, now)) back(d);
        if (c.getSeq() <= d.last_seq) return;
        d.last_seq = c.getSeq();
        d.load.free_pages = c.getFreePages();
        d.load.running_seqs = c.getRunningSeqs();
        d.load.waiting_seqs = c.getWaitingSeqs();
        d.load.max_running_seqs = c.getMaxRunningSeqs();
        return;
      }
      return;
    }
    for (auto& p : prefills) {
      if (p.t.name != name) continue;
      p.health.on_credit(now);
      if (heard(p.live, p.t.name, now)) back(p);
      if (c.getSeq() <= p.last_seq) return;  // reordered: an older view
      p.last_seq = c.getSeq();
      p.load.queued_requests = c.getQueuedRequests();
      p.load.queued_tokens = c.getQueuedTokens();
      p.load.prefill_tokens_per_s = c.getTokensPerS();
      p.active_tokens = c.getActiveTokens();
      // The target has taken `received` of our submissions: they are in its numbers now.
      const uint64_t received = c.getReceived();
      while (!p.in_transit.empty() && p.sent - p.in_transit.size() < received) {
        p.in_transit_tokens -= p.in_transit.front();
        p.in_transit.pop_front();
      }
      return;
    }
  }

  std::string validate(const seq_request& r) const {
    const auto& m = opt.model;
    if (r.id.empty()) return "request_id is empty; the front end must set a unique id";
    if (r.prompt.empty())
      return fmt::format("request {}: the prompt has no tokens; send at least one token", r.id);
    for (auto t : r.prompt)
      if (t < 0 || t >= m.n_vocab)
        return fmt::format("request {}: prompt token id {} is outside the vocabulary [0, {})", r.id, t,
                           m.n_vocab);
    if (m.max_context > 0 && static_cast<int32_t>(r.prompt.size()) >= m.max_context)
      return fmt::format("request {}: prompt of {} tokens does not fit the context of {} tokens; shorten it",
                         r.id, r.prompt.size(), m.max_context);
    if (r.max_tokens <= 0 || r.max_tokens > opt.lim.max_new_tokens)
      return fmt::format("request {}: max_tokens = {} must be in [1, {}] (limits.max_new_tokens)", r.id,
                         r.max_tokens, opt.lim.max_new_tokens);
    auto sv = r.sampling.validate();
    if (!sv.empty()) return fmt::format("request {}: {}", r.id, sv);
    return "";
  }
};

using router_actor_t = caf::stateful_actor<router_state>;

void schedule_tick(router_actor_t* self) {
  auto& s = self->state;
  if (s.tick_pending || s.table.empty()) return;
  s.tick_pending = true;
  self->delayed_send(self, std::chrono::milliseconds(s.opt.tick_ms), tick_atom::value);
}

/// Sends `e`'s request to the placement's targets; false (and the request ended) if the
/// target's mailbox is full.
bool dispatch(router_actor_t* self, entry& e, const placement& pl) {
  auto& s = self->state;
  auto& p = s.prefills[size_t(pl.prefill)];
  const std::string id = e.id;
  if (pl.local && pl.decode >= 0) {
    auto& d = s.decodes[size_t(pl.decode)];
    if (d.t.actor.gate->try_enter()) {
      const int64_t now = s.clk->now_ms();
      d.breaker.allow(now);
      d.routed += 1;
      // Until its next credit: the decode target holds one more sequence and its pages.
      d.load.waiting_seqs += 1;
      if (d.load.free_pages >= 0)
        d.load.free_pages = std::max<int64_t>(0, d.load.free_pages - s.pages_for(int64_t(e.req.prompt.size()) + 1));
      e.prefill = pl.prefill;
      e.decode = pl.decode;
      e.local = true;
      e.state = "queued";
      e.stage_since_ms = now;
      e.req.decode_target = d.t.name;
      s.local_prefills += 1;
      self->send(d.t.actor.handle, wire_atom::value,
                 make_wire([&](schema::Envelope::Builder env) { e.req.write(env.initSubmit()); }));
      return true;
    }
    // The decode mailbox is full: the prefill path below.
  }
  e.local = false;
  if (!p.t.actor.gate->try_enter()) {
    auto err = p.t.actor.gate->overloaded_error();
    s.rejected_by_reason["prefill_mailbox"] += 1;
    s.finish_here(id, finish_reason::error, &err, "prefill_mailbox", 1000);
    return false;
  }
  const int64_t now = s.clk->now_ms();
  p.breaker.allow(now);  // takes the half-open probe slot, if that is the state
  e.prefill = pl.prefill;
  e.decode = pl.decode;
  e.state = "queued";
  e.stage_since_ms = now;
  e.req.decode_target = pl.decode >= 0 ? s.decodes[size_t(pl.decode)].t.name : "";
  if (pl.decode >= 0) {
    s.decodes[size_t(pl.decode)].breaker.allow(now);
    s.decodes[size_t(pl.decode)].routed += 1;
  }
  const int64_t n = e.req.total_len();
  p.sent += 1;
  p.in_transit.push_back(n);
  p.in_transit_tokens += n;
  p.routed += 1;
  s.policy->on_routed(e.req.generated.empty() ? e.req.prompt : e.req.all_tokens(), pl.prefill);
  self->send(p.t.actor.handle, wire_atom::value,
             make_wire([&](schema::Envelope::Builder env) { e.req.write(env.initSubmit()); }));
  return true;
}

void on_submit(router_actor_t* self, const wire& w, event_callback cb) {
  auto& s = self->state;
  seq_request r;
  try {
    wire_reader rd(w);
    r = seq_request::read(rd.root().getSubmit());
    r.generated.clear();  // only the router's own continuations carry tokens so far
  } catch (const tandem::error& e) {
    s.reject("?", cb, e, "malformed", 0);
    return;
  }
  const auto prompt_len = static_cast<int32_t>(r.prompt.size());
  if (s.stopped) {
    s.reject(r.id, cb,
             tandem::error(error_kind::disconnected, "the cluster is shutting down; retry on another node"),
             "shutdown", prompt_len);
    return;
  }
  auto bad = s.validate(r);
  if (!bad.empty()) {
    s.reject(r.id, cb, tandem::error(error_kind::failed, bad), "invalid", prompt_len);
    return;
  }
  if (s.table.count(r.id) || s.attempt_ids.count(r.id)) {
    s.reject(r.id, cb,
             tandem::error(error_kind::failed,
                           fmt::format("request id {} is already in flight; use unique ids", r.id)),
             "duplicate_id", prompt_len);
    return;
  }
  if (static_cast<int32_t>(s.table.size()) >= s.opt.lim.max_inflight_requests) {
    s.reject(r.id, cb,
             tandem::error(
                 error_kind::overloaded,
                 fmt::format("router in-flight table is full ({} requests, limits.max_inflight_requests); "
                             "retry later",
                             s.table.size())),
             "inflight_full", prompt_len);
    return;
  }
  const int64_t now = s.clk->now_ms();
  const int64_t def = now + s.opt.lim.request_timeout_ms;
  r.deadline_ms = r.deadline_ms > 0 ? std::min(r.deadline_ms, def) : def;
  r.admit_order = s.next_order++;
  auto pl = s.place(r, {});
  if (pl.err) {
    s.reject(r.id, cb, *pl.err, pl.reason, prompt_len, pl.retry_after_ms);
    return;
  }
  entry e;
  e.cb = std::move(cb);
  e.id = r.id;
  e.submit_ms = now;
  e.deadline_ms = r.deadline_ms;
  e.prompt_tokens = prompt_len;
  e.req = r;
  auto [it, fresh] = s.table.emplace(r.id, std::move(e));
  (void)fresh;
  if (!dispatch(self, it->second, pl)) return;
  s.requests_total += 1;
  s.prompt_tokens_total += prompt_len;
  s.log->debug("request {}: accepted ({} prompt tokens, max_tokens {}, deadline in {} ms) -> {}", r.id, prompt_len,
               r.max_tokens, r.deadline_ms - now, s.prefills[size_t(pl.prefill)].t.name);
  schedule_tick(self);
}

/// Delivers `ev`, whose tokens start at completion index `first`, trimming tokens delivered
/// already (a duplicate). Returns true if the request ended.
bool deliver_in_order(router_state& s, std::unordered_map<std::string, entry>::iterator it, int32_t first,
                      stage_event ev) {
  auto& e = it->second;
  const auto skip = static_cast<size_t>(std::max(0, e.completion_tokens - first));
  if (skip >= ev.tokens.size()) ev.tokens.clear();
  else ev.tokens.erase(ev.tokens.begin(), ev.tokens.begin() + static_cast<std::ptrdiff_t>(skip));
  if (ev.logprobs.size() > ev.tokens.size())  // a duplicate's log-probabilities go with its tokens
    ev.logprobs.erase(ev.logprobs.begin(), ev.logprobs.end() - static_cast<std::ptrdiff_t>(ev.tokens.size()));
  const int64_t now = s.clk->now_ms();
  if (!ev.tokens.empty()) {
    if (e.first_token_ms < 0) {
      s.prefills[size_t(e.prefill)].breaker.on_success();
      if (e.decode >= 0) s.decodes[size_t(e.decode)].breaker.on_success();
      e.first_token_ms = now;
      s.ttft.observe(double(now - e.submit_ms));
    }
    e.last_token_ms = now;
    e.completion_tokens += static_cast<int32_t>(ev.tokens.size());
    if (s.opt.lim.router_migration) e.emitted.insert(e.emitted.end(), ev.tokens.begin(), ev.tokens.end());
    s.tokens_generated += static_cast<int64_t>(ev.tokens.size());
  }
  if (ev.tokens.empty() && !ev.finished) return false;  // a duplicate
  token_event out;
  out.request_id = it->first;
  out.tokens = std::move(ev.tokens);
  out.logprobs = std::move(ev.logprobs);
  out.finished = ev.finished;
  out.reason = ev.reason;
  out.err = std::move(ev.err);
  out.prompt_tokens = e.prompt_tokens;
  out.completion_tokens = e.completion_tokens;
  out.cached_tokens = e.cached_tokens;
  if (!out.finished) {
    router_state::deliver(e.cb, std::move(out), *s.log);
    return false;
  }
  s.account_finish(e, out.reason);
  if (out.err) s.log->info("request {}: ended with error: {}", it->first, out.err->what());
  auto cb = std::move(e.cb);
  s.erase(it);
  router_state::deliver(cb, std::move(out), *s.log);
  return true;
}

void send_abort_to(router_actor_t* self, const bounded_actor& a, const std::string& id) {
  if (!a) return;
  a.gate->enter_control();
  self->send(a.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
               auto a = env.initAbort();
               a.setId(id);
               a.setHops(0);
             }));
}

void send_abort(router_actor_t* self, const std::string& id, int target, int local_decode = -1) {
  auto& s = self->state;
  // A local prefill went to its decode target; that one follows it to prefill if preempted.
  if (local_decode >= 0 && size_t(local_decode) < s.decodes.size()) {
    send_abort_to(self, s.decodes[size_t(local_decode)].t.actor, id);
    return;
  }
  if (target < 0 || size_t(target) >= s.prefills.size()) return;
  send_abort_to(self, s.prefills[size_t(target)].t.actor, id);
}

/// Where a request is now: at its decode target (the first token is out, the KV is on its way
/// there or there) or at its prefill target.
/// A local prefill (conditional disaggregation) is on its decode target from the start, until
/// it is preempted.
bool is_at_decode(const entry& e) {
  return e.state == "decode" || (e.local && (e.state == "queued" || e.state == "prefill"));
}

/// Ends `id` with `disconnected`: `cause` and what the client can do.
void end_lost(router_state& s, const std::string& id, const std::string& cause, const std::string& what_to_do) {
  auto it = s.table.find(id);
  if (it == s.table.end()) return;
  tandem::error err(error_kind::disconnected,
                    fmt::format("{}; the stream ended after {} tokens; {}", cause, it->second.completion_tokens,
                                what_to_do));
  s.log->warn("request {}: {}", id, err.what());
  s.finish_here(id, finish_reason::error, &err);
}

/// Request `id` lost the stage that served it (`decode_side`: its decode target, else its
/// prefill target) because of `cause` (names the target and why). With migration on, within
/// the request's budget and deadline, it continues on a fresh prefill/decode pair that
/// excludes every target it lost: the continuation's prompt is the original prompt with the
/// tokens streamed so far as `generated`, so the stages number its events from there (no
/// token lost or duplicated) and sample each token with the same per-index seed. Otherwise it
/// ends with `disconnected`, naming the cause.
void lose(router_actor_t* self, const std::string& id, bool decode_side, const std::string& cause) {
  auto& s = self->state;
  auto it = s.table.find(id);
  if (it == s.table.end()) return;
  auto& e = it->second;
  const int64_t now = s.clk->now_ms();
  // Fence the attempt: its late events are dropped (by id); a stage still holding it frees it.
  const std::string old_id = e.req.id;
  // (The prefill follows an abort into decode; the decode target directly only if the prefill is gone.)
  if (e.local && e.state != "retrying" && is_at_decode(e) && e.decode >= 0) {
    if (!s.decodes[size_t(e.decode)].live.lost) send_abort_to(self, s.decodes[size_t(e.decode)].t.actor, old_id);
  } else if (!s.prefills[size_t(e.prefill)].live.lost) {
    if (e.state != "retrying") send_abort(self, old_id, e.prefill);
  } else if (e.decode >= 0 && !s.decodes[size_t(e.decode)].live.lost) {
    send_abort_to(self, s.decodes[size_t(e.decode)].t.actor, old_id);
  }
  if (decode_side && e.decode >= 0) {
    e.lost_decode.push_back(e.decode);
    s.decodes[size_t(e.decode)].breaker.on_failure(now);
  } else {
    // The prefill target, or (no decode targets) the prefill's own decode peer.
    e.lost_prefill.push_back(e.prefill);
    s.prefills[size_t(e.prefill)].breaker.on_failure(now);
  }
  const auto& lim = s.opt.lim;
  if (!lim.router_migration) {
    s.rejected_by_reason["target_lost"] += 1;
    end_lost(s, id, cause,
             "retry the request, or turn on [router] migration (tandem serve --router-migration on) to continue "
             "streams on another node");
    return;
  }
  if (e.migrations >= lim.router_max_migrations) {
    s.migration_failures["budget"] += 1;
    end_lost(s, id, cause,
             fmt::format("the request already moved {} times (limits.router_max_migrations = {}); retry it",
                         e.migrations, lim.router_max_migrations));
    return;
  }
  if (now >= e.deadline_ms) {
    s.migration_failures["deadline"] += 1;
    end_lost(s, id, cause,
             fmt::format("its deadline passed {} ms ago, so it was not moved; retry it with a longer deadline "
                         "(request_timeout_ms)",
                         now - e.deadline_ms));
    return;
  }
  seq_request c = e.req;
  c.generated = e.emitted;
  c.cached_tokens = 0;
  c.transfer_retries = 0;
  if (static_cast<int32_t>(c.generated.size()) >= c.max_tokens) {
    // Every token is out; only the final event was lost with the target.
    s.log->info("request {}: {}; all {} tokens were delivered: finished here", id, cause, c.generated.size());
    s.finish_here(id, finish_reason::length, nullptr);
    return;
  }
  auto pl = s.place(c, {}, e.lost_prefill, e.lost_decode);
  pl.local = false;  // a continuation re-prefills on a prefill target (it carries tokens so far)
  if (pl.err) {
    s.migration_failures["no_target"] += 1;
    end_lost(s, id, cause, fmt::format("no target to continue on: {}", pl.err->what()));
    return;
  }
  // A fresh id for the new attempt (the client still sees its own).
  std::string nid;
  for (int32_t k = e.migrations + 1;; ++k) {
    nid = fmt::format("{}#m{}", id, k);
    if (!s.table.count(nid) && !s.attempt_ids.count(nid)) break;
  }
  if (old_id != id) s.attempt_ids.erase(old_id);
  s.attempt_ids[nid] = id;
  c.id = nid;
  e.req = std::move(c);
  e.migrations += 1;
  e.early.clear();  // held events of the old attempt
  s.migrations_total += 1;
  s.log->warn("request {}: {}; continuing after {} tokens as {} (migration {} of {})", id, cause,
              e.completion_tokens, nid, e.migrations, lim.router_max_migrations);
  dispatch(self, e, pl);
}

/// A sequence its decode target sent back for recompute (its KV pages were preempted, or its KV
/// transfer failed; its "preempted" event came first). It goes to its prefill target, or to
/// another live one if that target is lost. The router is the one that knows which prefill
/// targets are alive: a decode node often learns that a prefill node died from the failed
/// transfer, before its own link to that node reports it down. If the chosen target dies
/// later, its node-down (or silence) finds the request there and moves or ends it.
void on_requeue(router_actor_t* self, const wire& w, schema::SubmitRequest::Reader r) {
  auto& s = self->state;
  auto it = s.find_attempt(r.getId().cStr());
  if (it == s.table.end()) return;  // ended here already (abort, deadline): nothing to recompute
  auto& e = it->second;
  if (e.state == "retrying") return;
  const std::string id = it->first;
  int t = -1;
  const auto usable = [&](int i) {
    return !s.prefills[size_t(i)].live.lost && s.prefills[size_t(i)].t.actor &&
           std::find(e.lost_prefill.begin(), e.lost_prefill.end(), i) == e.lost_prefill.end();
  };
  const int n = static_cast<int>(s.prefills.size());
  for (int k = 0; k < n && t < 0; ++k) {
    const int i = (std::max(e.prefill, 0) + k) % n;
    if (usable(i)) t = i;
  }
  if (t < 0) {
    const auto& p = s.prefills[size_t(std::clamp(e.prefill, 0, n - 1))];
    e.state = "preempted";
    lose(self, id, false,
         fmt::format("its decode target sent it back for recompute and prefill target {} is lost ({})", p.t.name,
                     p.live.lost ? p.live.lost_why : std::string("no live prefill target")));
    return;
  }
  if (t != e.prefill)
    s.log->info("request {}: recompute goes to prefill target {} ({} is lost)", id, s.prefills[size_t(t)].t.name,
                s.prefills[size_t(e.prefill)].t.name);
  e.prefill = t;
  e.local = false;  // it re-prefills on the prefill target now
  e.state = "preempted";
  e.stage_since_ms = s.clk->now_ms();
  auto& p = s.prefills[size_t(t)];
  p.t.actor.gate->enter_control();  // already admitted: must not be dropped
  self->send(p.t.actor.handle, wire_atom::value, w);
}

void on_event(router_actor_t* self, schema::TokenEvent::Reader r) {
  auto& s = self->state;
  // The current attempt only: an event of one given up on (migrated away from) is moot.
  auto it = s.find_attempt(r.getId().cStr());
  if (it == s.table.end()) return;  // already ended here (abort, deadline): the stage's late event is moot
  auto& e = it->second;
  const std::string id = it->first;
  if (e.state == "retrying") return;  // a late event of the attempt that was refused
  const int64_t now = s.clk->now_ms();
  // A sign of life of the stage that sent it: the decode target once the request is there
  // (the first token's event, which moves it there, comes from the prefill).
  // An error event is no sign of life: a proxy answers for a node that is gone with one.
  const bool alive = !(r.getFinished() && r.getReason() == schema::FinishReason::ERROR);
  if (alive && is_at_decode(e) && e.decode >= 0) {
    auto& d = s.decodes[size_t(e.decode)];
    if (s.heard(d.live, d.t.name, now)) s.back(d);
  } else if (alive) {
    auto& p = s.prefills[size_t(e.prefill)];
    if (s.heard(p.live, p.t.name, now)) s.back(p);
  }
  const std::string prev = e.state;
  e.state = r.getState().cStr();
  if (e.state != prev) e.stage_since_ms = now;
  if (r.getCachedTokens() > 0 && e.migrations == 0) e.cached_tokens = r.getCachedTokens();
  stage_event ev;
  ev.tokens = to_vector(r.getTokens());
  if (r.hasLogprobs()) ev.logprobs = read_logprobs(r.getLogprobs());
  if (ev.logprobs.size() != ev.tokens.size()) ev.logprobs.clear();  // all or nothing: they pair by position
  ev.finished = r.getFinished();
  ev.reason = from_schema(r.getReason());
  if (ev.reason == finish_reason::error) ev.err = read_error(r.getError());
  if (ev.tokens.empty() && !ev.finished) return;  // progress only
  const int32_t first = r.getFirstIndex();
  // A stage error after the stream started (or on a continuation) that is not the client's
  // fault: the stream moves on (lose() decides whether it can).
  if (ev.finished && ev.reason == finish_reason::error && ev.err && s.opt.lim.router_migration &&
      e.first_token_ms >= 0) {
    const auto k = ev.err->kind();
    const bool refused_continuation = k == error_kind::overloaded && e.migrations > 0 && ev.tokens.empty() &&
                                      first >= e.completion_tokens;
    if (k == error_kind::disconnected || k == error_kind::failed || refused_continuation) {
      if (first <= e.completion_tokens && !ev.tokens.empty()) {
        stage_event part;
        part.tokens = std::move(ev.tokens);
        part.logprobs = std::move(ev.logprobs);
        if (deliver_in_order(s, it, first, std::move(part))) return;
      }
      const bool decode_side = e.state == "decode" && e.decode >= 0;
      const std::string where = decode_side ? s.decodes[size_t(e.decode)].t.name : s.prefills[size_t(e.prefill)].t.name;
      lose(self, id, decode_side, fmt::format("{} target {} failed the request: {}", decode_side ? "decode" : "prefill",
                                              where, ev.err->what()));
      return;
    }
  }
  // A refusal before the first token: retry a retryable one on a fresh target.
  if (ev.finished && ev.reason == finish_reason::error && ev.err && e.first_token_ms < 0 && ev.tokens.empty()) {
    const auto& err = *ev.err;
    const bool retryable = err.kind() == error_kind::overloaded || err.kind() == error_kind::disconnected;
    const bool at_decode = e.state == "decode" && e.decode >= 0;
    if (err.kind() == error_kind::disconnected) {
      if (at_decode) s.decodes[size_t(e.decode)].breaker.on_failure(now);
      else s.prefills[size_t(e.prefill)].breaker.on_failure(now);
    }
    if (retryable && e.retries < s.opt.lim.router_max_retries) {
      backoff_policy b{s.opt.lim.router_max_retries, s.opt.lim.router_retry_base_ms, s.opt.lim.router_retry_max_ms};
      const int64_t delay = b.delay_ms(e.retries + 1, s.jitter);
      if (now + delay < e.deadline_ms) {
        e.retries += 1;
        e.tried.push_back(e.prefill);
        e.state = "retrying";
        e.early.clear();  // the next attempt numbers its events from 0 again
        s.retries_total += 1;
        s.log->info("request {}: {} refused it ({}); retry {} in {} ms", id, s.prefills[size_t(e.prefill)].t.name,
                    err.what(), e.retries, delay);
        self->delayed_send(self, std::chrono::milliseconds(delay), retry_atom::value, id);
        return;
      }
    }
  }
  // Prefill and decode (possibly on other nodes) send on different links: an event may
  // overtake an earlier one, or come twice. Hold it until the tokens before it arrived; a gap
  // that never fills ends the request at its deadline, never as a wrong completion.
  if (first > e.completion_tokens) {
    if (static_cast<int32_t>(e.early.size()) <= s.opt.lim.max_new_tokens) e.early.emplace(first, std::move(ev));
    return;
  }
  if (deliver_in_order(s, it, first, std::move(ev))) return;
  while (!it->second.early.empty() && it->second.early.begin()->first <= it->second.completion_tokens) {
    auto nh = it->second.early.extract(it->second.early.begin());
    if (deliver_in_order(s, it, nh.key(), std::move(nh.mapped()))) return;
  }
}


/// Marks a target lost (node down, or silent): no new request goes there until it answers again.
void mark_lost(router_state& s, liveness& l, const std::string& name, const std::string& why) {
  if (l.lost) return;
  l.lost = true;
  l.lost_why = why;
  l.lost_total += 1;
  s.log->warn("target {} lost: {}", name, why);
}

/// A target with requests in flight that stops answering: it is queried every half heartbeat
/// while it is quiet, and lost once nothing came from it for 1.5 heartbeats (counted from the
/// later of its last sign of life and the request's arrival there). Its requests then move
/// (migration) or end, so a target that died without a node-down notice holds no request
/// longer than 2 heartbeats (with tick_ms <= half a heartbeat).
void check_silence(router_actor_t* self, int64_t now) {
  auto& s = self->state;
  const int64_t hb = s.opt.lim.router_heartbeat_ms;
  const int64_t lost_after = hb + hb / 2;
  const int64_t query_every = std::max<int64_t>(hb / 2, 1);
  std::vector<int64_t> p_silent(s.prefills.size(), -1), d_silent(s.decodes.size(), -1);
  for (const auto& [id, e] : s.table) {
    if (e.state == "retrying") continue;
    if (is_at_decode(e)) {
      if (e.decode < 0) continue;  // the prefill's own decode peer: its credits do not come here
      auto& v = d_silent[size_t(e.decode)];
      v = std::max(v, now - std::max(s.decodes[size_t(e.decode)].live.heard_ms, e.stage_since_ms));
    } else {
      auto& v = p_silent[size_t(e.prefill)];
      v = std::max(v, now - std::max(s.prefills[size_t(e.prefill)].live.heard_ms, e.stage_since_ms));
    }
  }
  std::vector<bool> p_lost(s.prefills.size()), d_lost(s.decodes.size());
  bool any = false;
  auto check = [&](liveness& l, const route_target& t, const char* role, int64_t silence) -> bool {
    if (silence < 0 || l.lost) return false;
    if (silence >= lost_after) {
      mark_lost(s, l, t.name,
                fmt::format("{} target {} stopped answering: nothing came from it for {} ms while requests were "
                            "there (lost after 1.5 x limits.router_heartbeat_ms = {} ms)",
                            role, t.name, silence, lost_after));
      return true;
    }
    // A quiet target is asked; one query at a time (a stuck mailbox stays bounded).
    if (now - l.heard_ms >= query_every && (l.query_ms < 0 || now - l.query_ms >= query_every) && t.actor &&
        t.actor.gate->depth() == 0) {
      l.query_ms = now;
      t.actor.gate->enter_control();
      self->send(t.actor.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                   env.initCreditQuery().setFrom("router");
                 }));
    }
    return false;
  };
  for (size_t i = 0; i < s.prefills.size(); ++i)
    if (check(s.prefills[i].live, s.prefills[i].t, "prefill", p_silent[i])) p_lost[i] = any = true;
  for (size_t i = 0; i < s.decodes.size(); ++i)
    if (check(s.decodes[i].live, s.decodes[i].t, "decode", d_silent[i])) d_lost[i] = any = true;
  if (!any) return;
  std::vector<std::pair<std::string, bool>> hit;
  for (const auto& [id, e] : s.table) {
    if (e.state == "retrying") continue;
    if (is_at_decode(e) && e.decode >= 0 && d_lost[size_t(e.decode)]) hit.emplace_back(id, true);
    else if (!is_at_decode(e) && p_lost[size_t(e.prefill)]) hit.emplace_back(id, false);
  }
  for (const auto& [id, decode_side] : hit) {
    auto it = s.table.find(id);
    if (it == s.table.end()) continue;
    const auto& l = decode_side ? s.decodes[size_t(it->second.decode)].live : s.prefills[size_t(it->second.prefill)].live;
    lose(self, id, decode_side, l.lost_why);
  }
}

/// (node_down_atom, what, why): `what` is a role ("decode", "prefill": every node of it is
/// unreachable) or a target's name or node ("n1/decode", "n1": that target is). Its requests
/// move (migration) or end with `disconnected`.
void on_node_down(router_actor_t* self, const std::string& what, const std::string& why) {
  auto& s = self->state;
  const bool all_p = what == "prefill", all_d = what == "decode";
  auto match = [&](const std::string& name) { return name == what || name.rfind(what + "/", 0) == 0; };
  std::vector<bool> pd(s.prefills.size()), dd(s.decodes.size());
  for (size_t i = 0; i < s.prefills.size(); ++i)
    if (all_p || match(s.prefills[i].t.name)) pd[i] = true, mark_lost(s, s.prefills[i].live, s.prefills[i].t.name, why);
  for (size_t i = 0; i < s.decodes.size(); ++i)
    if (all_d || match(s.decodes[i].t.name)) dd[i] = true, mark_lost(s, s.decodes[i].live, s.decodes[i].t.name, why);
  std::vector<std::pair<std::string, bool>> hit;
  for (const auto& [id, e] : s.table) {
    if (e.state == "retrying") continue;
    if (is_at_decode(e)) {
      if (all_d || (e.decode >= 0 && dd[size_t(e.decode)])) hit.emplace_back(id, true);
    } else if (pd[size_t(e.prefill)]) {
      hit.emplace_back(id, false);
    } else if (e.decode >= 0 && dd[size_t(e.decode)]) {
      hit.emplace_back(id, true);  // still at prefill, but it would hand off to the dead node
    }
  }
  if (hit.empty()) return;
  s.log->warn("{} requests lost their target: {}", hit.size(), why);
  for (const auto& [id, decode_side] : hit) lose(self, id, decode_side, why);
}

void on_tick(router_actor_t* self) {
  auto& s = self->state;
  s.tick_pending = false;
  const int64_t now = s.clk->now_ms();
  std::vector<std::string> expired;
  const int32_t qt = s.opt.lim.queue_timeout_ms;
  // (A continuation waiting at its new prefill target streamed already: a deadline, not a queue timeout.)
  auto queued = [](const entry& e) { return (e.state == "queued" || e.state == "retrying") && e.first_token_ms < 0; };
  for (const auto& [id, e] : s.table)
    if (now >= e.deadline_ms || (qt > 0 && queued(e) && now - e.submit_ms >= qt)) expired.push_back(id);
  for (const auto& id : expired) {
    const auto& e = s.table.at(id);
    const int target = e.state == "retrying" ? -1 : e.prefill;
    const std::string wid = e.req.id;
    const int local_decode = e.state != "retrying" && e.local && is_at_decode(e) ? e.decode : -1;
    if (queued(e)) {
      // Never started: the queue (not the request) took too long -> 504 at the front end.
      const auto& p = s.prefills[size_t(e.prefill)];
      const int64_t ra = s.drain_ms(p, p.backlog_tokens());
      tandem::error err(error_kind::overloaded,
                        fmt::format("request waited {} ms in the prefill queue of {} without starting "
                                    "(limits.queue_timeout_ms = {}, request_timeout_ms = {}); retry after {} ms or "
                                    "lower the load",
                                    now - e.submit_ms, p.t.name, qt, s.opt.lim.request_timeout_ms, ra));
      s.log->warn("request {}: {}", id, err.what());
      s.rejected_by_reason["queue_timeout"] += 1;
      s.finish_here(id, finish_reason::error, &err, "queue_timeout", ra);
    } else {
      tandem::error err(
          error_kind::overloaded,
          fmt::format("request deadline exceeded after {} ms in state {} (request_timeout_ms = {}); raise "
                      "request_timeout_ms or reduce load",
                      now - e.submit_ms, e.state, s.opt.lim.request_timeout_ms));
      s.log->warn("request {}: {}", id, err.what());
      s.rejected_by_reason["deadline"] += 1;
      s.finish_here(id, finish_reason::error, &err, "deadline");
    }
    send_abort(self, wid, target, local_decode);
  }
  check_silence(self, now);
  schedule_tick(self);
}

/// A refused request's backoff is over: place it again, on a fresh target if there is one.
void on_retry(router_actor_t* self, const std::string& id) {
  auto& s = self->state;
  auto it = s.table.find(id);
  if (it == s.table.end() || it->second.state != "retrying") return;
  auto& e = it->second;
  auto pl = s.place(e.req, e.tried, e.lost_prefill, e.lost_decode);
  if (pl.err) {
    s.rejected_by_reason[pl.reason] += 1;
    s.finish_here(id, finish_reason::error, &*pl.err, pl.reason, pl.retry_after_ms);
    return;
  }
  dispatch(self, e, pl);
}

/// Health checks: a target whose last credit is older than one heartbeat is asked for one;
/// after three it counts as unhealthy (the policy skips it).
void on_heartbeat(router_actor_t* self) {
  auto& s = self->state;
  const int64_t now = s.clk->now_ms();
  auto query = [&](const bounded_actor& a) {
    // A target with messages still waiting (an earlier query among them) answers when it gets
    // to them, or is gone: one query at a time keeps a dead target's mailbox bounded.
    if (!a || a.gate->depth() > 0) return;
    a.gate->enter_control();
    self->send(a.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 env.initCreditQuery().setFrom("router");
               }));
  };
  for (auto& p : s.prefills)
    if (p.health.age_ms(now, s.start_ms) >= s.opt.lim.router_heartbeat_ms) query(p.t.actor);
  for (auto& d : s.decodes)
    if (d.health.age_ms(now, s.start_ms) >= s.opt.lim.router_heartbeat_ms) query(d.t.actor);
  self->delayed_send(self, std::chrono::milliseconds(s.opt.lim.router_heartbeat_ms), heartbeat_atom::value);
}

caf::behavior router_actor(router_actor_t* self, router_options opt, std::vector<route_target> prefill,
                           std::vector<route_target> decode, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.start_ms = st.clk->now_ms();
  const int64_t stale = 3 * int64_t(opt.lim.router_heartbeat_ms);
  for (auto& t : prefill) {
    prefill_target p;
    p.live.heard_ms = st.start_ms;
    p.t = std::move(t);
    p.health = target_health(stale);
    p.breaker = circuit_breaker(opt.lim.breaker_failures, opt.lim.breaker_cooldown_ms);
    st.prefills.push_back(std::move(p));
  }
  for (auto& t : decode) {
    decode_target d;
    d.live.heard_ms = st.start_ms;
    d.t = std::move(t);
    d.health = target_health(stale);
    d.breaker = circuit_breaker(opt.lim.breaker_failures, opt.lim.breaker_cooldown_ms);
    st.decodes.push_back(std::move(d));
  }
  auto po = opt.policy;
  po.block_tokens = opt.lim.page_size;
  st.policy.emplace(po, opt.seed);
  st.jitter.seed(opt.seed ^ 0x9e3779b97f4a7c15ull);
  // Every reason the router can refuse for is exported from the start (at 0), so dashboards
  // and alerts see the series before the first rejection.
  for (const char* r : {"malformed", "shutdown", "invalid", "duplicate_id", "inflight_full", "prefill_mailbox", "deadline",
                        "queue_requests", "queue_tokens", "queue_wait", "queue_timeout", "decode_pages", "decode_queue", "no_target",
                        "target_lost"})
    st.rejected_by_reason[r] = 0;
  for (const char* r : {"budget", "deadline", "no_target"}) st.migration_failures[r] = 0;
  self->delayed_send(self, std::chrono::milliseconds(opt.lim.router_heartbeat_ms), heartbeat_atom::value);
  return {
      [self](submit_atom, const wire& w, const callback_box& cb) {
        self->state.gate->leave();
        on_submit(self, w, cb.take());
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isEvent()) {
            on_event(self, env.getEvent());
          } else if (env.isCredit()) {
            s.on_credit(env.getCredit());
          } else if (env.isRequeue()) {
            on_requeue(self, w, env.getRequeue());
          } else if (env.isAbort()) {
            std::string id = env.getAbort().getId().cStr();
            auto it = s.table.find(id);
            if (it == s.table.end()) return;
            const int target = it->second.state == "retrying" ? -1 : it->second.prefill;
            const std::string wid = it->second.req.id;  // the current attempt's
            const auto& ie = it->second;
            const int local_decode = ie.state != "retrying" && ie.local && is_at_decode(ie) ? ie.decode : -1;
            // A stop string ends the request at the front end: a normal finish, counted as stop.
            const bool stop_string = env.getAbort().getStopString();
            if (stop_string)
              s.log->debug("request {}: ended at a stop string", id);
            else
              s.log->info("request {}: aborted by the client", id);
            s.finish_here(id, stop_string ? finish_reason::stop : finish_reason::abort, nullptr);
            send_abort(self, wid, target, local_decode);
          } else {
            s.log->error("router: unexpected message dropped");
          }
        } catch (const tandem::error& e) {
          s.log->error("router: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("router: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](tick_atom) { on_tick(self); },
      [self](node_down_atom, const std::string& what, const std::string& why) { on_node_down(self, what, why); },
      [self](node_down_atom, const std::string&, const std::string& target, const std::string& why) {
        on_node_down(self, target, why);  // (role, "node/role" target, why): per-target proxies
      },
      [self](node_up_atom, const std::string&, const std::string& target) {
        // Its proxy reached the node again: ask for a credit now, which brings a lost target
        // back (a credit is the sign of life that counts).
        auto& s = self->state;
        auto ask = [&](const route_target& t) {
          if (t.name != target || !t.actor || t.actor.gate->depth() > 0) return;
          s.log->info("target {} is reachable again; asking for its credit", target);
          t.actor.gate->enter_control();
          self->send(t.actor.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                       env.initCreditQuery().setFrom("router");
                     }));
        };
        for (const auto& p : s.prefills) ask(p.t);
        for (const auto& d : s.decodes) ask(d.t);
      },
      [self](retry_atom, const std::string& id) { on_retry(self, id); },
      [self](heartbeat_atom) { on_heartbeat(self); },
      [self](stop_atom) -> bool {
        auto& s = self->state;
        s.stopped = true;
        std::vector<std::string> ids;
        for (const auto& [id, e] : s.table) ids.push_back(id);
        tandem::error err(error_kind::disconnected,
                          "the cluster shut down before the request finished; retry");
        for (const auto& id : ids) s.finish_here(id, finish_reason::error, &err);
        return true;
      },
      [self](queue_wait_atom, int32_t ms) -> int32_t {
        auto& s = self->state;
        const int32_t before = s.opt.lim.max_queue_wait_ms;
        s.opt.lim.max_queue_wait_ms = std::max<int32_t>(ms, 0);
        s.log->info("limits.max_queue_wait_ms set to {} (was {})", s.opt.lim.max_queue_wait_ms, before);
        return before;
      },
      [self](inflight_atom) -> inflight_list {
        auto& s = self->state;
        inflight_list out;
        int64_t now = s.clk->now_ms();
        out.requests.reserve(s.table.size());
        for (const auto& [id, e] : s.table)
          out.requests.push_back({id, e.state, now - e.submit_ms, e.prompt_tokens, e.completion_tokens});
        std::sort(out.requests.begin(), out.requests.end(),
                  [](const request_report& a, const request_report& b) { return a.age_ms > b.age_ms; });
        return out;
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"requests_total", "", double(s.requests_total), "counter", "Requests accepted by the router"},
            {"requests_inflight", "", double(s.table.size()), "gauge",
             "Requests in the router's in-flight table"},
            {"requests_inflight_bound", "", double(s.opt.lim.max_inflight_requests), "gauge",
             "Bound of the in-flight table"},
            {"queue_wait_bound_ms", "", double(s.opt.lim.max_queue_wait_ms), "gauge",
             "Queue-wait bound the router admits by now (limits.max_queue_wait_ms; 0 = off)"},
            {"tokens_generated_total", "", double(s.tokens_generated), "counter",
             "Completion tokens delivered"},
            {"prompt_tokens_total", "", double(s.prompt_tokens_total), "counter",
             "Prompt tokens of the requests accepted by the router"},
        };
        for (const auto& [r, n] : s.finished_by_reason)
          m.push_back({"requests_finished_total", fmt::format("reason=\"{}\"", r), double(n), "counter",
                       "Requests ended, by finish reason"});
        m.push_back({"router_retries_total", "", double(s.retries_total), "counter",
                     "Requests re-routed after a target refused them before their first token"});
        m.push_back({"router_migrations_total", "", double(s.migrations_total), "counter",
                     "Streams moved to another target after theirs was lost"});
        for (const auto& [r, n] : s.migration_failures)
          m.push_back({"router_migration_failures_total", fmt::format("reason=\"{}\"", r), double(n), "counter",
                       "Streams that lost their target and could not move, by reason"});
        m.push_back({"router_local_prefill_candidates_total", "", double(s.local_prefill_candidates), "counter",
                     "Requests the conditional-disaggregation rule would prefill on their decode node"});
        m.push_back({"router_local_prefill_total", "", double(s.local_prefills), "counter",
                     "Requests sent to their decode target to be prefilled there (conditional disaggregation)"});
        m.push_back({"router_prefix_index_nodes", "", double(s.policy->index().size()), "gauge",
                     "Nodes of the cache_aware prefix index (bounded, LRU)"});
        m.push_back({"router_balance_fallbacks_total", "", double(s.policy->balance_fallbacks()), "counter",
                     "cache_aware choices overridden by the balance thresholds"});
        const int64_t now = s.clk->now_ms();
        auto target_metrics = [&](const std::string& name, const target_health& h, const circuit_breaker& b,
                                  int64_t routed, const liveness& live) {
          auto l = fmt::format("target=\"{}\"", name);
          m.push_back({"router_target_healthy", l, h.healthy(now, s.start_ms) && !live.lost ? 1.0 : 0.0, "gauge",
                       "1 while the target's credits are fresh (3 heartbeats) and it is not lost, else 0"});
          m.push_back({"router_target_lost_total", l, double(live.lost_total), "counter",
                       "Times the target was lost (node down, or silent 1.5 heartbeats with requests there)"});
          m.push_back({"router_target_credit_age_ms", l, double(h.age_ms(now, s.start_ms)), "gauge",
                       "Age of the target's last credit"});
          m.push_back({"router_breaker_state", l, double(static_cast<int>(b.current(now))), "gauge",
                       "Circuit breaker of the target: 0 closed, 1 open, 2 half-open"});
          m.push_back({"router_breaker_opens_total", l, double(b.opens()), "counter",
                       "Times the target's circuit breaker opened"});
          m.push_back({"router_routed_total", l, double(routed), "counter", "Requests sent to the target"});
        };
        for (const auto& p : s.prefills) {
          target_metrics(p.t.name, p.health, p.breaker, p.routed, p.live);
          auto l = fmt::format("target=\"{}\"", p.t.name);
          m.push_back({"router_target_queued_tokens", l, double(p.backlog_tokens()), "gauge",
                       "Prompt tokens ahead of a new request at the prefill target (credits + in transit)"});
          m.push_back({"router_target_queue_wait_ms", l,
                       double(estimate_queue_wait_ms(p.backlog_tokens(), p.load.prefill_tokens_per_s)), "gauge",
                       "Estimated queue wait of the prefill target (-1 = drain rate not measured yet)"});
        }
        for (const auto& d : s.decodes) {
          target_metrics(d.t.name, d.health, d.breaker, d.routed, d.live);
          m.push_back({"router_target_free_pages", fmt::format("target=\"{}\"", d.t.name), double(d.load.free_pages),
                       "gauge", "KV pages free or evictable at the decode target's last allocation (-1 = unknown)"});
        }
        // Readiness (actors/runtime/readiness.h): a role with targets and none of them live
        // means every request fails, whatever the process's own health.
        auto live_count = [&](const auto& targets) {
          int n = 0;
          for (const auto& t : targets) n += t.health.healthy(now, s.start_ms) && !t.live.lost ? 1 : 0;
          return double(n);
        };
        m.push_back({"router_targets", "role=\"prefill\"", double(s.prefills.size()), "gauge",
                     "Targets the router routes to, by role"});
        m.push_back({"router_targets", "role=\"decode\"", double(s.decodes.size()), "gauge",
                     "Targets the router routes to, by role"});
        m.push_back({"router_live_targets", "role=\"prefill\"", live_count(s.prefills), "gauge",
                     "Targets with fresh credits that are not lost, by role"});
        m.push_back({"router_live_targets", "role=\"decode\"", live_count(s.decodes), "gauge",
                     "Targets with fresh credits that are not lost, by role"});
        for (const auto& [r, n] : s.rejected_by_reason)
          m.push_back({"rejections_total", fmt::format("actor=\"router\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("router", m, {&s.ttft, &s.tpot, &s.e2e});
      },
  };
}

}  // namespace

bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, std::vector<route_target> prefill,
                           std::vector<route_target> decode, std::shared_ptr<const cluster_clock> clk,
                           std::shared_ptr<spdlog::logger> log) {
  if (prefill.empty()) throw tandem::error(error_kind::failed, "the router needs at least one prefill target");
  auto gate = std::make_shared<mailbox_gate>("router", opt.lim.router_mailbox);
  auto h = sys.spawn(router_actor, opt, std::move(prefill), std::move(decode), gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, bounded_actor prefill,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  return spawn_router(sys, opt, {route_target{"local/prefill", std::move(prefill)}}, {}, std::move(clk),
                      std::move(log));
}

}  // namespace tandem
