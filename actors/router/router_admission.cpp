/// The router's admission: validating a request, choosing where it goes (or why it cannot go
/// anywhere now), and sending it there; a refused request's retry.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem::router_impl {

int32_t router_state::pages_for(int64_t tokens) const {
  const int32_t ps = std::max(1, opt.lim.page_size);
  return static_cast<int32_t>((tokens + ps - 1) / ps);
}
/// Time until target `p` could take `n` more tokens under the bound that refused it.
int64_t router_state::drain_ms(const prefill_target& p, int64_t excess_tokens) const {
  const int64_t w = estimate_queue_wait_ms(std::max<int64_t>(excess_tokens, 1), p.load.prefill_tokens_per_s);
  return w < 0 ? 1000 : std::max<int64_t>(w, 1);
}
/// Empty if target `p` can place a request of `n` prompt tokens now, else why not.
/// A continuation (a migrated stream) skips the queue-wait estimate: it was admitted already.
std::optional<placement> router_state::check_prefill(const prefill_target& p, int64_t n, bool continuation) const {
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
placement router_state::decode_busy(placement& out, const char* reason, std::string what) {
  out.prefill = -1;
  out.reason = reason;
  out.retry_after_ms = 1000;
  out.err = tandem::error(error_kind::overloaded, std::move(what));
  return out;
}

namespace {

bool listed(const std::vector<int>& v, size_t i) { return std::find(v.begin(), v.end(), int(i)) != v.end(); }

/// Why no prefill target can take anything now: lost, draining or open breakers
/// (disconnected), or only late with their credits (overloaded: busy, not gone).
placement no_prefill_target(const router_state& s, const std::vector<int>& never_prefill, int64_t now) {
  const auto& prefills = s.prefills;
  placement out;
  out.reason = "no_target";
  out.retry_after_ms = s.opt.lim.breaker_cooldown_ms;
  std::string why;
  bool only_late = false;  // some target is only late with its credits: busy, not gone
  for (size_t i = 0; i < prefills.size(); ++i) {
    const auto& p = prefills[i];
    if (p.live.lost) why += fmt::format("; {} lost: {}", p.t.name, p.live.lost_why);
    else if (p.draining) why += fmt::format("; {} is draining", p.t.name);
    only_late = only_late || (!p.live.lost && !p.draining && p.breaker.would_allow(now) && !listed(never_prefill, i));
  }
  if (only_late) {
    // A scheduler too busy to send credits in time is overloaded, not disconnected: 503
    // with Retry-After (a client backs off) rather than 502 (a client reconnects elsewhere).
    out.err = tandem::error(
        error_kind::overloaded,
        fmt::format("no prefill target of {} sent credits within 3 heartbeats (limits.router_heartbeat_ms = {}): "
                    "the schedulers are too busy to report; retry after {} ms",
                    prefills.size(), s.opt.lim.router_heartbeat_ms, out.retry_after_ms));
    return out;
  }
  out.err = tandem::error(error_kind::disconnected,
                          fmt::format("no healthy prefill target of {}{} (stale credits, open circuit breakers, "
                                      "draining or lost{}); retry on another node",
                                      prefills.size(), never_prefill.empty() ? "" : " that this request did not lose",
                                      why));
  return out;
}

/// Why no decode target reachable from the chosen prefill target can take the request.
placement no_decode_target(const router_state& s, placement out, const std::vector<int>& never_decode, int64_t now) {
  const auto& decodes = s.decodes;
  out.prefill = -1;
  out.reason = "no_target";
  out.retry_after_ms = s.opt.lim.breaker_cooldown_ms;
  std::string lost, why;
  for (int i : never_decode) lost += (lost.empty() ? "" : ", ") + decodes[size_t(i)].t.name;
  bool all_lost = true;
  std::string names;
  for (const auto& d : decodes) {
    if (d.live.lost) why += fmt::format("; {} lost: {}", d.t.name, d.live.lost_why);
    else if (d.draining) why += fmt::format("; {} is draining", d.t.name);
    all_lost = all_lost && d.live.lost;
    names += (names.empty() ? "" : ", ") + d.t.name;
  }
  if (all_lost)
    why = fmt::format("; no decode node is reachable (down: {}; {})", names, decodes.front().live.lost_why);
  bool only_late = false;  // as for prefill: a decode target late with credits is busy
  for (size_t i = 0; i < decodes.size(); ++i)
    only_late = only_late || (!decodes[i].live.lost && !decodes[i].draining && decodes[i].breaker.would_allow(now) &&
                              !listed(never_decode, i));
  if (only_late) {
    out.err = tandem::error(
        error_kind::overloaded,
        fmt::format("no decode target of {} sent credits within 3 heartbeats (limits.router_heartbeat_ms = {}): "
                    "the schedulers are too busy to report; retry after {} ms",
                    decodes.size(), s.opt.lim.router_heartbeat_ms, out.retry_after_ms));
    return out;
  }
  out.err = tandem::error(error_kind::disconnected,
                          fmt::format("no healthy decode target of {}{}{}; retry on another node", decodes.size(),
                                      lost.empty() ? "" : " other than " + lost, why));
  return out;
}

/// The soft admission of a new request (not a continuation) at decode target `d`, which it
/// needs `need` pages at: refused when the target's batch is backed up with sequences holding
/// pages, or its queue of sequences waiting for a batch slot is full.
std::optional<placement> decode_refusal(const router_state& s, const seq_request& r, int32_t need, int d,
                                        placement& out) {
  const auto& opt = s.opt;
  const auto& dlo = s.decodes[size_t(d)].load;
  const std::string& name = s.decodes[size_t(d)].t.name;
  // Choices fork at the decode target: each fork beyond the first takes a page of its own for
  // the block holding the last prompt position (decode_fork.cpp) and a batch slot.
  const int32_t forks = std::max(0, r.n - 1);
  if (opt.lim.decode_page_admission && dlo.free_pages >= 0 && dlo.waiting_seqs > 0 && dlo.free_pages < need) {
    // The decode batch is full and backed up with sequences holding pages: a new one
    // would only be preempted (recomputed) or fail there.
    return router_state::decode_busy(
        out, "decode_pages",
        fmt::format("decode target {} has {} free KV pages and {} sequences waiting for a batch "
                    "slot; the prompt needs {} pages{}; retry later or raise limits.kv_cache_mb",
                    name, dlo.free_pages, dlo.waiting_seqs, need,
                    forks > 0 ? fmt::format(" (one of them for each of its {} extra choices)", forks) : ""));
  }
  const int32_t wait_bound = opt.lim.max_decode_waiting_seqs > 0 ? opt.lim.max_decode_waiting_seqs
                                                                  : 2 * dlo.max_running_seqs;
  const bool queue_full = dlo.waiting_seqs >= wait_bound || (dlo.waiting_seqs > 0 && dlo.waiting_seqs + 1 + forks > wait_bound);
  if (opt.lim.max_decode_waiting_seqs >= 0 && wait_bound > 0 && queue_full) {
    // Prefill outruns decode in a burst: sequences pile up waiting for a batch slot, each
    // holding its pages, and every new one would wait behind them. A request of n choices
    // adds n sequences; behind an empty queue it is admitted whatever its n.
    return router_state::decode_busy(
        out, "decode_queue",
        fmt::format("decode target {} has {} sequences waiting for a slot in its batch of {} "
                    "(limits.max_decode_waiting_seqs = {}){}; retry later or add decode capacity",
                    name, dlo.waiting_seqs, dlo.max_running_seqs, opt.lim.max_decode_waiting_seqs,
                    forks > 0 ? fmt::format(" and the request's n = {} choices would add {}", r.n, r.n) : ""));
  }
  return std::nullopt;
}

/// Conditional disaggregation: whether a prompt of `n` tokens (`cached` of them in the prefill
/// target's cache) is better prefilled next to its decode batch at `d` than at `prefill`.
/// Acted on only where it saves a KV transfer (the decode target runs on another node than the
/// prefill target), and only if the decode pool can hold the prompt (`need` pages) now: its
/// pages come from there at once, not after a queue.
bool prefill_at_decode(router_state& s, int64_t n, int32_t cached, int32_t need, int d, int prefill) {
  const auto& dlo = s.decodes[size_t(d)].load;
  int64_t shortest = -1;
  for (const auto& p : s.prefills) {
    const int64_t w = estimate_queue_wait_ms(p.backlog_tokens(), p.load.prefill_tokens_per_s);
    if (w >= 0 && (shortest < 0 || w < shortest)) shortest = w;
  }
  if (!prefill_locally(s.opt.local_prefill, static_cast<int32_t>(n), cached, shortest, dlo)) return false;
  s.local_prefill_candidates += 1;
  const auto node_of = [](const std::string& name) { return name.substr(0, name.rfind('/')); };
  const bool other_node = node_of(s.decodes[size_t(d)].t.name) != node_of(s.prefills[size_t(prefill)].t.name);
  const bool fits = dlo.free_pages < 0 || dlo.free_pages >= need;
  return other_node && fits;
}

}  // namespace

/// Chooses a (prefill, decode) pair that can place `r`, avoiding `avoid` where another target
/// exists, and never one in `never_prefill` / `never_decode` (targets the request lost). A continuation (`r.generated` set: a migrated stream) skips the soft admission
/// estimates (queue wait, decode pages, decode queue); the hard queue bounds still hold.
placement router_state::place(const seq_request& r, const std::vector<int>& avoid, const std::vector<int>& never_prefill,
                                const std::vector<int>& never_decode) {
  const int64_t now = clk->now_ms();
  const bool continuation = !r.generated.empty();
  const std::vector<int32_t> all = continuation ? r.all_tokens() : std::vector<int32_t>{};
  const std::vector<int32_t>& tokens = continuation ? all : r.prompt;
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<target_load> loads;
  std::vector<bool> ok;
  bool any = false;
  for (size_t i = 0; i < prefills.size(); ++i) {
    auto& p = prefills[i];
    target_load l = p.load;
    l.queued_requests = p.queued_requests();
    l.queued_tokens = p.backlog_tokens();
    loads.push_back(l);
    const bool up = p.health.healthy(now, start_ms) && p.breaker.would_allow(now) && !p.live.lost && !p.draining &&
                    !listed(never_prefill, i);
    ok.push_back(up);
    any = any || up;
  }
  if (!any) return no_prefill_target(*this, never_prefill, now);
  placement out;
  {
    auto pref = ok;
    bool left = false;
    for (int a : avoid)
      if (a >= 0 && size_t(a) < pref.size()) pref[size_t(a)] = false;
    for (bool b : pref) left = left || b;
    if (left) ok = pref;  // a fresh target if there is one, else the same again
  }
  // The decode targets that can take work at all; a prefill target is chosen only if its node
  // reaches one of them (a decode node that restarted is not reachable from every prefill node
  // at once: each redials it on its own back-off).
  std::vector<bool> dok;
  bool any_decode = false;
  for (size_t i = 0; i < decodes.size(); ++i) {
    dok.push_back(decode_eligible(decodes[i], now) && !listed(never_decode, i));
    any_decode = any_decode || dok.back();
  }
  std::optional<placement> first_no;
  int32_t cached = 0;
  for (size_t k = 0; k < prefills.size(); ++k) {
    int t = policy->choose_prefill(tokens, loads, ok, &cached);
    if (t < 0) break;
    auto no = check_prefill(prefills[size_t(t)], n, continuation);
    if (!no && any_decode) {
      bool reach = false;
      for (size_t i = 0; i < decodes.size() && !reach; ++i) reach = dok[i] && reaches(prefills[size_t(t)], decodes[i]);
      if (!reach) {
        placement un;
        un.reason = "no_target";
        un.retry_after_ms = 1000;
        un.err = tandem::error(error_kind::overloaded,
                               fmt::format("prefill target {} does not reach a healthy decode target yet (its node "
                                           "is reconnecting to them); retry after {} ms",
                                           prefills[size_t(t)].t.name, un.retry_after_ms));
        no = std::move(un);
      }
    }
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
    std::vector<bool> dreach = dok;
    for (size_t i = 0; i < decodes.size(); ++i) {
      dl.push_back(decodes[i].load);
      dreach[i] = dok[i] && reaches(prefills[size_t(out.prefill)], decodes[i]);
    }
    const int d = policy->choose_decode(dl, dreach);
    if (d < 0) return no_decode_target(*this, out, never_decode, now);
    // Choices fork at the decode target: each fork beyond the first takes a page of its own.
    const int32_t need = pages_for(n + 1) + std::max(0, r.n - 1);
    if (!continuation) {
      if (auto busy = decode_refusal(*this, r, need, d, out)) return *busy;
    }
    out.decode = d;
    // n > 1 forks at its decode target after a prefill on the prefill path (decode_fork.cpp).
    if (r.n <= 1) out.local = prefill_at_decode(*this, n, cached, need, d, out.prefill);
  }
  return out;
}

std::string router_state::validate(const seq_request& r) const {
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
  if (r.n < 1 || r.n > opt.lim.max_choices || r.n > opt.lim.max_running_seqs)
    return fmt::format("request {}: n = {} must be in [1, {}] (limits.max_choices, at most limits.max_running_seqs)",
                       r.id, r.n, std::min(opt.lim.max_choices, opt.lim.max_running_seqs));
  auto sv = r.sampling.validate();
  if (!sv.empty()) return fmt::format("request {}: {}", r.id, sv);
  return "";
}

/// Sends `e`'s request to the placement's targets; false (and the request ended) if the
/// target's mailbox is full.
bool dispatch(router_actor_t* self, entry& e, const placement& pl) {
  auto& s = self->state;
  auto& p = s.prefills[size_t(pl.prefill)];
  const std::string id = e.id;
  if (pl.local && pl.decode >= 0) {
    auto& d = s.decodes[size_t(pl.decode)];
    if (auto ticket = d.t.actor.admit<msg::submit>()) {
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
      e.state = request_stage::queued;
      e.stage_since_ms = now;
      e.req.decode_target = d.t.name;
      s.local_prefills += 1;
      d.t.actor.send<msg::submit>(self, std::move(ticket), [&](schema::SubmitRequest::Builder b) { e.req.write(b); });
      return true;
    }
    // The decode mailbox is full: the prefill path below.
  }
  e.local = false;
  auto ticket = p.t.actor.admit<msg::submit>();
  if (!ticket) {
    auto err = p.t.actor.gate->overloaded_error();
    s.rejected_by_reason["prefill_mailbox"] += 1;
    s.finish_here(id, finish_reason::error, &err, "prefill_mailbox", 1000);
    return false;
  }
  const int64_t now = s.clk->now_ms();
  p.breaker.allow(now);  // takes the half-open probe slot, if that is the state
  e.prefill = pl.prefill;
  e.decode = pl.decode;
  e.state = request_stage::queued;
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
  p.t.actor.send<msg::submit>(self, std::move(ticket), [&](schema::SubmitRequest::Builder b) { e.req.write(b); });
  return true;
}

void on_submit(router_actor_t* self, seq_request r, event_callback cb) {
  auto& s = self->state;
  r.generated.clear();  // only the router's own continuations carry tokens so far
  const auto prompt_len = static_cast<int32_t>(r.prompt.size());
  if (s.stopped) {
    s.reject(r.id, cb,
             tandem::error(error_kind::disconnected, "the cluster is shutting down; retry on another node"),
             "shutdown", prompt_len);
    return;
  }
  if (s.draining) {
    s.reject(r.id, cb,
             tandem::error(error_kind::disconnected,
                           "this router node is draining (tandem inspect --drain); send requests to another router "
                           "node, or undrain it with tandem inspect --undrain"),
             "draining", prompt_len);
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
  e.choices.resize(static_cast<size_t>(r.n - 1));
  auto [it, fresh] = s.table.emplace(r.id, std::move(e));
  (void)fresh;
  if (!dispatch(self, it->second, pl)) return;
  s.requests_total += 1;
  s.prompt_tokens_total += prompt_len;
  s.log->debug("request {}: accepted ({} prompt tokens, max_tokens {}, deadline in {} ms) -> {}", r.id, prompt_len,
               r.max_tokens, r.deadline_ms - now, s.prefills[size_t(pl.prefill)].t.name);
  schedule_tick(self);
}

/// A refused request's backoff is over: place it again, on a fresh target if there is one.
void on_retry(router_actor_t* self, const std::string& id) {
  auto& s = self->state;
  auto it = s.table.find(id);
  if (it == s.table.end() || it->second.state != request_stage::retrying) return;
  auto& e = it->second;
  auto pl = s.place(e.req, e.tried, e.lost_prefill, e.lost_decode);
  if (pl.err) {
    s.rejected_by_reason[pl.reason] += 1;
    s.finish_here(id, finish_reason::error, &*pl.err, pl.reason, pl.retry_after_ms);
    return;
  }
  dispatch(self, e, pl);
}

}  // namespace tandem::router_impl
