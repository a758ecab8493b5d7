/// The router's side of n > 1 (OpenAI's n): one in-flight entry per request, whose choices
/// 1..n-1 (forks made at the decode target, decode_fork.cpp) stream beside choice 0. Each
/// choice's events are delivered in order on their own; the entry ends once, with its last
/// choice, and an error of any choice ends them all.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/router/router_state.h"

namespace tandem::router_impl {

namespace {

/// Delivers choice `k`'s event whose tokens start at index `first`, trimming duplicates.
/// True if the request ended.
bool deliver_choice(router_state& s, router_state::entry_it it, int32_t k, int32_t first, stage_event ev) {
  auto& e = it->second;
  auto& c = e.choices[size_t(k - 1)];
  const auto skip = static_cast<size_t>(std::max(0, c.completion_tokens - first));
  if (skip >= ev.tokens.size()) ev.tokens.clear();
  else ev.tokens.erase(ev.tokens.begin(), ev.tokens.begin() + static_cast<std::ptrdiff_t>(skip));
  if (ev.logprobs.size() > ev.tokens.size())
    ev.logprobs.erase(ev.logprobs.begin(), ev.logprobs.end() - static_cast<std::ptrdiff_t>(ev.tokens.size()));
  if (!ev.tokens.empty()) {
    e.last_token_ms = s.clk->now_ms();
    c.completion_tokens += static_cast<int32_t>(ev.tokens.size());
    s.tokens_generated += static_cast<int64_t>(ev.tokens.size());
  }
  if (ev.tokens.empty() && !ev.finished) return false;
  token_event out;
  out.request_id = it->first;
  out.choice = k;
  out.tokens = std::move(ev.tokens);
  out.logprobs = std::move(ev.logprobs);
  out.finished = ev.finished;
  out.reason = ev.reason;
  out.prompt_tokens = e.prompt_tokens;
  out.completion_tokens = c.completion_tokens;
  out.cached_tokens = e.cached_tokens;
  router_state::deliver(e.cb, std::move(out), *s.log);
  if (!ev.finished) return false;
  return end_choice(s, it, k, ev.reason);
}

}  // namespace

bool end_choice(router_state& s, router_state::entry_it it, int32_t choice, finish_reason reason) {
  auto& e = it->second;
  if (choice == 0) {
    e.done0 = true;
    e.reason0 = reason;
  } else {
    auto& c = e.choices[size_t(choice - 1)];
    c.done = true;
    c.early.clear();
  }
  if (!e.done0) return false;
  for (const auto& c : e.choices)
    if (!c.done) return false;
  // The request is counted once: as choice 0 ended (every choice ended; an error ends them all
  // through fail_choices).
  s.account_finish(e, e.reason0);
  s.erase(it);
  return true;
}

void fail_choices(router_actor_t* self, router_state::entry_it it, const tandem::error& err) {
  auto& s = self->state;
  const std::string id = it->first;
  const auto& e = it->second;
  const int target = e.state == request_stage::retrying ? -1 : e.prefill;
  const std::string wid = e.req.id;
  const int local_decode = e.state != request_stage::retrying && e.local && is_at_decode(e) ? e.decode : -1;
  const int decode = e.decode;
  s.log->info("request {}: a choice failed, ending all {}: {}", id, e.choices.size() + 1, err.what());
  s.finish_here(id, finish_reason::error, &err);  // erases the entry
  send_abort(self, wid, target, local_decode);
  // The forks live at the decode target: tell it directly too (an abort there is idempotent).
  if (decode >= 0 && size_t(decode) < s.decodes.size() && local_decode < 0)
    send_abort_to(self, s.decodes[size_t(decode)].t.actor, wid);
}

void on_choice_event(router_actor_t* self, router_state::entry_it it, int32_t choice, int32_t first, stage_event ev) {
  auto& s = self->state;
  auto& e = it->second;
  if (choice < 0 || choice > static_cast<int32_t>(e.choices.size())) {
    s.log->warn("request {}: event of choice {} of {} dropped", it->first, choice, e.choices.size() + 1);
    return;
  }
  if (ev.finished && ev.reason == finish_reason::error && ev.err) {
    fail_choices(self, it, *ev.err);
    return;
  }
  if (choice == 0) return;  // choice 0 ended already: a late copy
  auto& c = e.choices[size_t(choice - 1)];
  if (c.done) return;
  if (first > c.completion_tokens) {
    if (static_cast<int32_t>(c.early.size()) <= s.opt.lim.max_new_tokens) c.early.emplace(first, std::move(ev));
    return;
  }
  if (deliver_choice(s, it, choice, first, std::move(ev))) return;
  auto& cc = it->second.choices[size_t(choice - 1)];
  while (!cc.done && !cc.early.empty() && cc.early.begin()->first <= cc.completion_tokens) {
    auto nh = cc.early.extract(cc.early.begin());
    if (deliver_choice(s, it, choice, nh.key(), std::move(nh.mapped()))) return;
  }
}

void stop_choice(router_actor_t* self, const std::string& id, int32_t choice) {
  auto& s = self->state;
  auto it = s.table.find(id);
  if (it == s.table.end()) return;
  auto& e = it->second;
  if (choice < 0 || choice > static_cast<int32_t>(e.choices.size())) return;
  const bool done = choice == 0 ? e.done0 : e.choices[size_t(choice - 1)].done;
  if (done) return;
  const std::string wid = e.req.id;
  const int decode = e.decode;
  const int prefill = e.prefill;
  const int32_t tokens = choice == 0 ? e.completion_tokens : e.choices[size_t(choice - 1)].completion_tokens;
  token_event out;
  out.request_id = id;
  out.choice = choice;
  out.finished = true;
  out.reason = finish_reason::stop;
  out.prompt_tokens = e.prompt_tokens;
  out.completion_tokens = tokens;
  out.cached_tokens = e.cached_tokens;
  router_state::deliver(e.cb, std::move(out), *s.log);
  if (choice == 0) e.early.clear();
  end_choice(s, it, choice, finish_reason::stop);
  // Only that fork stops; the others go on.
  auto send_to = [&](const auto& a, int32_t hops) {
    if (!a) return;
    a.template send<msg::abort>(self, [&](schema::Abort::Builder ab) {
      ab.setId(wid);
      ab.setHops(hops);
      ab.setStopString(true);
      ab.setChoice(choice);
    });
  };
  // A fork lives at its decode target only (hops 8: not chased further); without decode
  // targets that is the prefill's own decode peer, which the prefill forwards it to.
  if (decode >= 0 && size_t(decode) < s.decodes.size()) send_to(s.decodes[size_t(decode)].t.actor, 8);
  else if (prefill >= 0 && size_t(prefill) < s.prefills.size()) send_to(s.prefills[size_t(prefill)].t.actor, 0);
}

}  // namespace tandem::router_impl
