/// The router's view of its targets' liveness: credits, heartbeats, silence and node-down.
#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/router/router_state.h"

namespace tandem::router_impl {

/// A sign of life of a target: a lost one is back (its node restarted or its link healed).
/// True when it was lost.
bool router_state::heard(liveness& l, const std::string& name, int64_t now) {
  l.heard_ms = std::max(l.heard_ms, now);
  if (!l.lost) return false;
  l.lost = false;
  l.back_ms = now;
  log->info("target {} answers again; new requests may go there", name);
  return true;
}

bool router_state::on_credit(schema::Credit::Reader c) {
  const std::string name = c.getTarget().cStr();
  const int64_t now = clk->now_ms();
  if (c.getRole() == schema::StageRole::DECODE) {
    for (auto& d : decodes) {
      if (d.t.name != name) continue;
      d.health.on_credit(now);
      const bool came_back = heard(d.live, d.t.name, now);
      if (came_back) back(d);
      if (c.getSeq() <= d.last_seq) return came_back;
      d.last_seq = c.getSeq();
      d.load.free_pages = c.getFreePages();
      d.load.running_seqs = c.getRunningSeqs();
      d.load.waiting_seqs = c.getWaitingSeqs();
      d.load.max_running_seqs = c.getMaxRunningSeqs();
      if (d.draining != c.getDraining())
        log->info("target {} {}", d.t.name, c.getDraining() ? "drains: no new requests go there" : "takes requests again");
      d.draining = c.getDraining();
      return came_back;
    }
    return false;
  }
  for (auto& p : prefills) {
    if (p.t.name != name) continue;
    p.health.on_credit(now);
    if (heard(p.live, p.t.name, now)) back(p);
    if (c.getSeq() <= p.last_seq) return false;  // reordered: an older view
    p.last_seq = c.getSeq();
    p.credit_ms = now;
    if (p.draining != c.getDraining())
      log->info("target {} {}", p.t.name, c.getDraining() ? "drains: no new requests go there" : "takes requests again");
    p.draining = c.getDraining();
    p.unreachable.clear();
    for (auto u : c.getUnreachable()) p.unreachable.emplace_back(u.cStr());
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
    return false;
  }
  return false;
}

bool router_state::reaches(const prefill_target& p, const decode_target& d) const {
  if (std::find(p.unreachable.begin(), p.unreachable.end(), d.t.name) != p.unreachable.end()) return false;
  return d.live.back_ms < 0 || p.credit_ms >= d.live.back_ms;
}

bool router_state::decode_eligible(const decode_target& d, int64_t now) const {
  return d.health.healthy(now, start_ms) && d.breaker.would_allow(now) && !d.live.lost && !d.draining;
}

int32_t router_state::holds(int i, bool decode) const {
  int32_t n = 0;
  for (const auto& [id, e] : table) {
    if (decode) n += e.decode == i ? 1 : 0;
    else n += e.prefill == i && !is_at_decode(e) ? 1 : 0;
  }
  return n;
}

void query_prefills(router_actor_t* self) {
  for (const auto& p : self->state.prefills) query_credit(self, p.t.actor);
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
    if (e.state == request_stage::retrying) continue;
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
  auto check = [&](liveness& l, const auto& t, const char* role, int64_t silence) -> bool {
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
      t.actor.template send<msg::credit_query>(self, [](schema::StatsQuery::Builder q) { q.setFrom("router"); });
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
    if (e.state == request_stage::retrying) continue;
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
    if (e.state == request_stage::retrying) continue;
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

/// Health checks: a target whose last credit is older than one heartbeat is asked for one;
/// after three it counts as unhealthy (the policy skips it).
void on_heartbeat(router_actor_t* self) {
  auto& s = self->state;
  const int64_t now = s.clk->now_ms();
  // A draining target is told each heartbeat how many requests the router still has there:
  // at 0 it reports drained.
  for (size_t i = 0; i < s.prefills.size(); ++i) {
    const auto& p = s.prefills[i];
    if (p.draining) query_credit(self, p.t.actor, s.holds(int(i), false));
    else if (p.health.age_ms(now, s.start_ms) >= s.opt.lim.router_heartbeat_ms) query_credit(self, p.t.actor);
  }
  for (size_t i = 0; i < s.decodes.size(); ++i) {
    const auto& d = s.decodes[i];
    if (d.draining) query_credit(self, d.t.actor, s.holds(int(i), true));
    else if (d.health.age_ms(now, s.start_ms) >= s.opt.lim.router_heartbeat_ms) query_credit(self, d.t.actor);
  }
  self->delayed_send(self, std::chrono::milliseconds(s.opt.lim.router_heartbeat_ms), heartbeat_atom::value);
}

}  // namespace tandem::router_impl
