/// The router moving a stream whose target was lost (migration), or ending it; recompute requeues.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem::router_impl {

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

namespace {

/// Fences the current attempt of `e`: its late events are dropped (by id) and a stage still
/// holding it frees it. (The prefill follows an abort into decode; the decode target is told
/// directly only if the prefill is gone.)
void fence_attempt(router_actor_t* self, const entry& e) {
  auto& s = self->state;
  const std::string& old_id = e.req.id;
  if (e.local && e.state != request_stage::retrying && is_at_decode(e) && e.decode >= 0) {
    if (!s.decodes[size_t(e.decode)].live.lost) send_abort_to(self, s.decodes[size_t(e.decode)].t.actor, old_id);
  } else if (!s.prefills[size_t(e.prefill)].live.lost) {
    if (e.state != request_stage::retrying) send_abort(self, old_id, e.prefill);
  } else if (e.decode >= 0 && !s.decodes[size_t(e.decode)].live.lost) {
    send_abort_to(self, s.decodes[size_t(e.decode)].t.actor, old_id);
  }
}

/// The lost target is never chosen again for this request, and its breaker counts a failure.
void count_loss(router_state& s, entry& e, bool decode_side, int64_t now) {
  if (decode_side && e.decode >= 0) {
    e.lost_decode.push_back(e.decode);
    s.decodes[size_t(e.decode)].breaker.on_failure(now);
  } else {
    // The prefill target, or (no decode targets) the prefill's own decode peer.
    e.lost_prefill.push_back(e.prefill);
    s.prefills[size_t(e.prefill)].breaker.on_failure(now);
  }
}

/// Ends `id` (true) when it may not move: migration off, n > 1, its budget spent, or its
/// deadline passed.
bool ended_unmoved(router_state& s, const entry& e, const std::string& id, const std::string& cause, int64_t now) {
  const auto& lim = s.opt.lim;
  if (!lim.router_migration) {
    s.rejected_by_reason["target_lost"] += 1;
    end_lost(s, id, cause,
             "retry the request, or turn on [router] migration (tandem serve --router-migration on) to continue "
             "streams on another node");
    return true;
  }
  if (e.req.n > 1) {
    // Its forks hold shared pages on one decode node: not moved (documented in docs/api.md).
    s.migration_failures["n_choices"] += 1;
    end_lost(s, id, cause, fmt::format("a request with n = {} is not moved to another node; retry it", e.req.n));
    return true;
  }
  if (e.migrations >= lim.router_max_migrations) {
    s.migration_failures["budget"] += 1;
    end_lost(s, id, cause,
             fmt::format("the request already moved {} times (limits.router_max_migrations = {}); retry it",
                         e.migrations, lim.router_max_migrations));
    return true;
  }
  if (now >= e.deadline_ms) {
    s.migration_failures["deadline"] += 1;
    end_lost(s, id, cause,
             fmt::format("its deadline passed {} ms ago, so it was not moved; retry it with a longer deadline "
                         "(request_timeout_ms)",
                         now - e.deadline_ms));
    return true;
  }
  return false;
}

/// A fresh id for the next attempt of `id` (the client still sees its own): `id#mK`.
std::string fresh_attempt_id(const router_state& s, const entry& e, const std::string& id) {
  std::string nid;
  for (int32_t k = e.migrations + 1;; ++k) {
    nid = fmt::format("{}#m{}", id, k);
    if (!s.table.count(nid) && !s.attempt_ids.count(nid)) return nid;
  }
}

}  // namespace

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
  const std::string old_id = e.req.id;
  fence_attempt(self, e);
  count_loss(s, e, decode_side, now);
  const auto& lim = s.opt.lim;
  if (ended_unmoved(s, e, id, cause, now)) return;
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
  const std::string nid = fresh_attempt_id(s, e, id);
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
void on_requeue(router_actor_t* self, schema::SubmitRequest::Reader r) {
  auto& s = self->state;
  auto it = s.find_attempt(r.getId().cStr());
  if (it == s.table.end()) return;  // ended here already (abort, deadline): nothing to recompute
  auto& e = it->second;
  if (e.state == request_stage::retrying) return;
  const std::string id = it->first;
  int t = -1;
  const auto usable = [&](int i, bool draining_too) {
    return !s.prefills[size_t(i)].live.lost && s.prefills[size_t(i)].t.actor &&
           (draining_too || !s.prefills[size_t(i)].draining) &&
           std::find(e.lost_prefill.begin(), e.lost_prefill.end(), i) == e.lost_prefill.end();
  };
  const int n = static_cast<int>(s.prefills.size());
  // A draining target only when no other is left: it still finishes what it was given.
  for (bool draining_too : {false, true})
    for (int k = 0; k < n && t < 0; ++k) {
      const int i = (std::max(e.prefill, 0) + k) % n;
      if (usable(i, draining_too)) t = i;
    }
  if (t < 0) {
    const auto& p = s.prefills[size_t(std::clamp(e.prefill, 0, n - 1))];
    e.state = request_stage::preempted;
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
  e.state = request_stage::preempted;
  e.stage_since_ms = s.clk->now_ms();
  auto& p = s.prefills[size_t(t)];
  p.t.actor.send_copy<msg::requeue>(self, r);  // control (already admitted): never refused
}

}  // namespace tandem::router_impl
