/// The router's in-flight table: ending a request exactly once, finding an attempt, delivering
/// stage events in order, aborts, and the tick that enforces deadlines.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem::router_impl {

void router_state::deliver(const event_callback& cb, token_event ev, spdlog::logger& log) {
  try {
    if (cb) cb(std::move(ev));
  } catch (const std::exception& e) {
    log.error("request {}: event callback threw: {}", ev.request_id, e.what());
  }
}
void router_state::reject(const std::string& id, const event_callback& cb, const tandem::error& e,
                            const std::string& reason, int32_t prompt_tokens, int64_t retry_after_ms) {
  rejected_by_reason[reason] += 1;
  finished_by_reason["error"] += 1;
  log->info("request {}: rejected ({}): {}", id, reason, e.what());
  auto ev = error_event(id, e, prompt_tokens);
  ev.reject_reason = reason;
  ev.retry_after_ms = retry_after_ms;
  deliver(cb, std::move(ev), *log);
}

void router_state::finish_here(const std::string& id, finish_reason reason, const tandem::error* err,
                                const std::string& reject_reason, int64_t retry_after_ms) {
  auto it = table.find(id);
  if (it == table.end()) return;
  // n > 1: the open choices other than the last end first (the last event ends the request).
  for (size_t k = 0; k < it->second.choices.size(); ++k) {
    auto& c = it->second.choices[k];
    if (c.done) continue;
    c.done = true;
    token_event cev;
    cev.request_id = id;
    cev.choice = static_cast<int32_t>(k + 1);
    cev.finished = true;
    cev.reason = reason;
    if (err) cev.err = *err;
    cev.prompt_tokens = it->second.prompt_tokens;
    cev.completion_tokens = c.completion_tokens;
    cev.cached_tokens = it->second.cached_tokens;
    cev.reject_reason = reject_reason;
    cev.retry_after_ms = retry_after_ms;
    deliver(it->second.cb, std::move(cev), *log);
  }
  if (it->second.done0) {
    // Choice 0 ended already: this ends the request without another event of it.
    account_finish(it->second, reason);
    erase(it);
    return;
  }
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
/// The entry whose current attempt is `wid` (the client's id, or `id#mN` after a
/// migration), or table.end() (ended, or an attempt given up on).
router_state::entry_it router_state::find_attempt(const std::string& wid) {
  auto it = table.find(wid);
  if (it != table.end() && it->second.req.id == wid) return it;
  auto a = attempt_ids.find(wid);
  if (a == attempt_ids.end()) return table.end();
  it = table.find(a->second);
  return it != table.end() && it->second.req.id == wid ? it : table.end();
}
void router_state::erase(entry_it it) {
  if (it->second.req.id != it->first) attempt_ids.erase(it->second.req.id);
  table.erase(it);
}
/// A router that exits with requests in flight (a failure, or the supervisor restarting the
/// node's actors) ends each with `disconnected`, so no client waits for events that never come.
router_state::~router_state() {
  if (table.empty()) return;
  tandem::error err(error_kind::disconnected,
                    "the node's actors failed and were restarted before the request finished; retry it");
  std::vector<std::string> ids;
  for (const auto& kv : table) ids.push_back(kv.first);
  for (const auto& id : ids) finish_here(id, finish_reason::error, &err);
}
void router_state::account_finish(const entry& e, finish_reason reason) {
  static const char* names[] = {"none", "stop", "length", "abort", "error"};
  finished_by_reason[names[static_cast<int>(reason)]] += 1;
  int64_t now = clk->now_ms();
  e2e.observe(double(now - e.submit_ms));
  if (e.completion_tokens > 1 && e.first_token_ms >= 0)
    tpot.observe(double(e.last_token_ms - e.first_token_ms) / double(e.completion_tokens - 1));
}

void schedule_tick(router_actor_t* self) {
  auto& s = self->state;
  if (s.tick_pending || s.table.empty()) return;
  s.tick_pending = true;
  self->delayed_send(self, std::chrono::milliseconds(s.opt.tick_ms), tick_atom::value);
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
  if (!e.choices.empty() && !out.err) {
    // n > 1: choice 0 ended; the request ends with its last choice (router_choices.cpp).
    const finish_reason why = out.reason;
    router_state::deliver(e.cb, std::move(out), *s.log);
    end_choice(s, it, 0, why);
    return true;
  }
  s.account_finish(e, out.reason);
  if (out.err) s.log->info("request {}: ended with error: {}", it->first, out.err->what());
  auto cb = std::move(e.cb);
  s.erase(it);
  router_state::deliver(cb, std::move(out), *s.log);
  return true;
}

void send_abort(router_actor_t* self, const std::string& id, int target, int local_decode) {
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
  return e.state == request_stage::decode || (e.local && (e.state == request_stage::queued || e.state == request_stage::prefill));
}

namespace {

/// An event is a sign of life of the stage that sent it: the decode target once the request is
/// there (the first token's event, which moves it there, comes from the prefill). An error
/// event is no sign of life: a proxy answers for a node that is gone with one.
void note_alive(router_state& s, const entry& e, schema::TokenEvent::Reader r, int64_t now) {
  const bool alive = !(r.getFinished() && r.getReason() == schema::FinishReason::ERROR);
  if (alive && is_at_decode(e) && e.decode >= 0) {
    auto& d = s.decodes[size_t(e.decode)];
    if (s.heard(d.live, d.t.name, now)) s.back(d);
  } else if (alive) {
    auto& p = s.prefills[size_t(e.prefill)];
    if (s.heard(p.live, p.t.name, now)) s.back(p);
  }
}

stage_event read_stage_event(schema::TokenEvent::Reader r) {
  stage_event ev;
  ev.tokens = to_vector(r.getTokens());
  if (r.hasLogprobs()) ev.logprobs = read_logprobs(r.getLogprobs());
  if (ev.logprobs.size() != ev.tokens.size()) ev.logprobs.clear();  // all or nothing: they pair by position
  ev.finished = r.getFinished();
  ev.reason = from_schema(r.getReason());
  if (ev.reason == finish_reason::error) ev.err = read_error(r.getError());
  return ev;
}

bool is_error_end(const stage_event& ev) { return ev.finished && ev.reason == finish_reason::error && ev.err; }

/// A stage error after the stream started (or on a continuation) that is not the client's
/// fault: the stream moves on (lose() decides whether it can). True: the event was taken.
bool moved_on_stage_error(router_actor_t* self, router_state::entry_it it, const std::string& id, int32_t first,
                          stage_event& ev) {
  auto& s = self->state;
  auto& e = it->second;
  if (!is_error_end(ev) || !s.opt.lim.router_migration || e.first_token_ms < 0) return false;
  const auto k = ev.err->kind();
  const bool refused_continuation = k == error_kind::overloaded && e.migrations > 0 && ev.tokens.empty() &&
                                    first >= e.completion_tokens;
  if (k != error_kind::disconnected && k != error_kind::failed && !refused_continuation) return false;
  if (first <= e.completion_tokens && !ev.tokens.empty()) {
    stage_event part;
    part.tokens = std::move(ev.tokens);
    part.logprobs = std::move(ev.logprobs);
    if (deliver_in_order(s, it, first, std::move(part))) return true;
  }
  const bool decode_side = e.state == request_stage::decode && e.decode >= 0;
  const std::string where = decode_side ? s.decodes[size_t(e.decode)].t.name : s.prefills[size_t(e.prefill)].t.name;
  lose(self, id, decode_side, fmt::format("{} target {} failed the request: {}", decode_side ? "decode" : "prefill",
                                          where, ev.err->what()));
  return true;
}

/// A refusal before the first token: a retryable one is retried on a fresh target after a
/// backoff. True: the retry is scheduled.
bool retried_refusal(router_actor_t* self, entry& e, const std::string& id, const stage_event& ev, int64_t now) {
  auto& s = self->state;
  if (!is_error_end(ev) || e.first_token_ms >= 0 || !ev.tokens.empty()) return false;
  const auto& err = *ev.err;
  const bool retryable = err.kind() == error_kind::overloaded || err.kind() == error_kind::disconnected;
  const bool at_decode = e.state == request_stage::decode && e.decode >= 0;
  if (err.kind() == error_kind::disconnected) {
    // Counted against the node that failed: a decode node its prefill could not reach
    // (a refused handoff arrives in state "decode") is not chosen again for this request.
    if (at_decode) {
      s.decodes[size_t(e.decode)].breaker.on_failure(now);
      bool other = false;  // with no other decode target, the retry may find this one reachable again
      for (size_t i = 0; i < s.decodes.size(); ++i)
        other = other || (int(i) != e.decode && s.decode_eligible(s.decodes[i], now));
      if (other) e.lost_decode.push_back(e.decode);
    } else {
      s.prefills[size_t(e.prefill)].breaker.on_failure(now);
    }
  }
  if (!retryable || e.retries >= s.opt.lim.router_max_retries) return false;
  backoff_policy b{s.opt.lim.router_max_retries, s.opt.lim.router_retry_base_ms, s.opt.lim.router_retry_max_ms};
  const int64_t delay = b.delay_ms(e.retries + 1, s.jitter);
  if (now + delay >= e.deadline_ms) return false;
  e.retries += 1;
  e.tried.push_back(e.prefill);
  e.state = request_stage::retrying;
  e.early.clear();  // the next attempt numbers its events from 0 again
  s.retries_total += 1;
  s.log->info("request {}: {} refused it ({}); retry {} in {} ms", id, s.prefills[size_t(e.prefill)].t.name, err.what(),
              e.retries, delay);
  self->delayed_send(self, std::chrono::milliseconds(delay), retry_atom::value, id);
  return true;
}

/// Prefill and decode (possibly on other nodes) send on different links: an event may overtake
/// an earlier one, or come twice. Holds it until the tokens before it arrived; a gap that never
/// fills ends the request at its deadline, never as a wrong completion.
void deliver_or_hold(router_state& s, router_state::entry_it it, int32_t first, stage_event ev) {
  if (first > it->second.completion_tokens) {
    if (static_cast<int32_t>(it->second.early.size()) <= s.opt.lim.max_new_tokens)
      it->second.early.emplace(first, std::move(ev));
    return;
  }
  if (deliver_in_order(s, it, first, std::move(ev))) return;
  while (!it->second.early.empty() && it->second.early.begin()->first <= it->second.completion_tokens) {
    auto nh = it->second.early.extract(it->second.early.begin());
    if (deliver_in_order(s, it, nh.key(), std::move(nh.mapped()))) return;
  }
}

}  // namespace

void on_event(router_actor_t* self, schema::TokenEvent::Reader r) {
  auto& s = self->state;
  // The current attempt only: an event of one given up on (migrated away from) is moot.
  auto it = s.find_attempt(r.getId().cStr());
  if (it == s.table.end()) return;  // already ended here (abort, deadline): the stage's late event is moot
  auto& e = it->second;
  const std::string id = it->first;
  if (e.state == request_stage::retrying) return;  // a late event of the attempt that was refused
  const int64_t now = s.clk->now_ms();
  note_alive(s, e, r, now);
  const request_stage prev = e.state;
  e.state = from_schema(r.getState());
  if (e.state != prev) e.stage_since_ms = now;
  if (r.getCachedTokens() > 0 && e.migrations == 0) e.cached_tokens = r.getCachedTokens();
  stage_event ev = read_stage_event(r);
  if (ev.tokens.empty() && !ev.finished) return;  // progress only
  const int32_t first = r.getFirstIndex();
  if (r.getChoice() > 0 || e.done0) {
    on_choice_event(self, it, r.getChoice(), first, std::move(ev));
    return;
  }
  if (moved_on_stage_error(self, it, id, first, ev)) return;
  if (retried_refusal(self, e, id, ev, now)) return;
  if (!e.choices.empty() && is_error_end(ev)) {
    // n > 1: an error of choice 0 ends every choice and aborts the forks.
    fail_choices(self, it, *ev.err);
    return;
  }
  deliver_or_hold(s, it, first, std::move(ev));
}

void on_tick(router_actor_t* self) {
  auto& s = self->state;
  s.tick_pending = false;
  const int64_t now = s.clk->now_ms();
  std::vector<std::string> expired;
  const int32_t qt = s.opt.lim.queue_timeout_ms;
  // (A continuation waiting at its new prefill target streamed already: a deadline, not a queue timeout.)
  auto queued = [](const entry& e) { return (e.state == request_stage::queued || e.state == request_stage::retrying) && e.first_token_ms < 0; };
  for (const auto& [id, e] : s.table)
    if (now >= e.deadline_ms || (qt > 0 && queued(e) && now - e.submit_ms >= qt)) expired.push_back(id);
  for (const auto& id : expired) {
    const auto& e = s.table.at(id);
    const int target = e.state == request_stage::retrying ? -1 : e.prefill;
    const std::string wid = e.req.id;
    const int local_decode = e.state != request_stage::retrying && e.local && is_at_decode(e) ? e.decode : -1;
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
                      now - e.submit_ms, to_string(e.state), s.opt.lim.request_timeout_ms));
      s.log->warn("request {}: {}", id, err.what());
      s.rejected_by_reason["deadline"] += 1;
      s.finish_here(id, finish_reason::error, &err, "deadline");
    }
    send_abort(self, wid, target, local_decode);
  }
  check_silence(self, now);
  schedule_tick(self);
}

}  // namespace tandem::router_impl
