#include "transport/ucx/transfer_state.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem::ucx {

namespace {

/// Pages a list of pools holds (-1 entries are released window blocks, not pages).
size_t count_pages(const pool_pages& pp) {
  size_t n = 0;
  for (const auto& p : pp)
    for (int32_t x : p) n += x >= 0;
  return n;
}

}  // namespace

std::string_view to_string(transfer_phase p) {
  switch (p) {
    case transfer_phase::bootstrapping: return "bootstrapping";
    case transfer_phase::waiting: return "waiting";
    case transfer_phase::transferring: return "transferring";
    case transfer_phase::done: return "done";
    case transfer_phase::failed: return "failed";
  }
  return "failed";
}

std::string_view to_string(notify_kind k) {
  switch (k) {
    case notify_kind::started: return "started";
    case notify_kind::done: return "done";
    case notify_kind::failed: return "failed";
    case notify_kind::cancel: return "cancel";
  }
  return "failed";
}

std::string_view to_string(fail_reason r) {
  switch (r) {
    case fail_reason::timeout_bootstrapping: return "timeout_bootstrapping";
    case fail_reason::timeout_waiting: return "timeout_waiting";
    case fail_reason::timeout_transferring: return "timeout_transferring";
    case fail_reason::aborted: return "aborted";
    case fail_reason::peer_failed: return "peer_failed";
    case fail_reason::peer_closed: return "peer_closed";
    case fail_reason::put_failed: return "put_failed";
    case fail_reason::remote_failed: return "remote_failed";
    case fail_reason::remote_cancel: return "remote_cancel";
    case fail_reason::bad_descriptors: return "bad_descriptors";
    case fail_reason::manifest: return "manifest";
    case fail_reason::checksum: return "checksum";
  }
  return "failed";
}

transfer_table::transfer_table(const cluster_clock& clock, transfer_transport& transport,
                               transfer_limits limits, release_fn release)
    : clock_(clock), transport_(transport), limits_(limits), release_(std::move(release)) {}

void transfer_table::start_receive(transfer_id id, peer_id source, pool_pages dst_pages) {
  transfer t{transfer_role::destination, source};
  t.pages = std::move(dst_pages);
  admit(id, std::move(t));
}

void transfer_table::start_send(transfer_id id, peer_id destination, pool_pages src_pages) {
  transfer t{transfer_role::source, destination};
  t.pages = std::move(src_pages);
  admit(id, std::move(t));
}

void transfer_table::admit(transfer_id id, transfer t) {
  if (live_.count(id) || quarantine_.count(id))
    throw tandem::error(fmt::format("KV transfer {} is already in progress; use a fresh transfer id per request", id));
  if (live_.size() >= limits_.max_transfers) {
    ++rejected_;
    throw tandem::error(error_kind::overloaded,
                        fmt::format("KV transfer table full ({} transfers); retry later or raise max_transfers",
                                    limits_.max_transfers));
  }
  ++started_;
  peer_id peer = t.peer;
  enter(t, transfer_phase::bootstrapping);
  auto& tr = live_.emplace(id, std::move(t)).first->second;
  auto p = peers_.find(peer);
  if (p == peers_.end()) {
    peers_[peer] = peer_state::connecting;
    transport_.connect(peer);
  } else if (p->second == peer_state::ready) {
    on_ready_peer(id, tr);
  }
  // connecting: on_peer_ready picks it up; closing: on_peer_closed fails it.
}

void transfer_table::enter(transfer& t, transfer_phase p) {
  t.phase = p;
  int64_t now = clock_.now_ms();
  switch (p) {
    case transfer_phase::bootstrapping: t.deadline_ms = now + limits_.bootstrap_ms; break;
    case transfer_phase::waiting: t.deadline_ms = now + limits_.waiting_ms; break;
    case transfer_phase::transferring: t.deadline_ms = now + limits_.transferring_ms; break;
    default: break;
  }
}

void transfer_table::on_ready_peer(transfer_id id, transfer& t) {
  if (t.phase != transfer_phase::bootstrapping) return;
  enter(t, transfer_phase::waiting);
  if (t.role == transfer_role::destination) {
    // From here on the source may write into the pages at any time.
    t.io_in_flight = true;
    transport_.send_descriptors(t.peer, id, t.pages);
    return;
  }
  maybe_put(id, t);
}

void transfer_table::maybe_put(transfer_id id, transfer& t) {
  if (t.role != transfer_role::source || t.phase != transfer_phase::waiting) return;
  if (!t.have_descriptors) {
    auto e = early_.find(id);
    if (e == early_.end() || e->second.peer != t.peer) return;
    t.remote_pages = std::move(e->second.pages);
    t.have_descriptors = true;
    early_.erase(e);
  }
  if (!t.ready) return;
  if (std::string why = check_descriptors(t.pages, t.remote_pages); !why.empty()) {
    fail(id, fail_reason::bad_descriptors, fmt::format("KV transfer {}: {}", id, why));
    return;
  }
  t.io_in_flight = true;
  enter(t, transfer_phase::transferring);
  transport_.notify(t.peer, id, notify_kind::started);
  transport_.put_pages(t.peer, id, t.pages, t.remote_pages);
}

void transfer_table::source_ready(transfer_id id) {
  auto it = live_.find(id);
  if (it == live_.end() || it->second.role != transfer_role::source) return;
  it->second.ready = true;
  maybe_put(id, it->second);
}

void transfer_table::abort(transfer_id id) {
  if (live_.count(id)) fail(id, fail_reason::aborted, fmt::format("KV transfer {} aborted", id));
}

void transfer_table::tick() {
  int64_t now = clock_.now_ms();
  std::vector<std::pair<transfer_id, transfer_phase>> expired;
  for (auto& [id, t] : live_)
    if (now >= t.deadline_ms) expired.emplace_back(id, t.phase);
  for (auto& [id, ph] : expired) {
    fail_reason r = ph == transfer_phase::bootstrapping ? fail_reason::timeout_bootstrapping
                    : ph == transfer_phase::waiting     ? fail_reason::timeout_waiting
                                                        : fail_reason::timeout_transferring;
    fail(id, r, fmt::format("KV transfer {} timed out while {}; check that the peer is alive and raise the "
                            "{} deadline if it is just slow",
                            id, to_string(ph), to_string(ph)));
  }
  std::vector<std::pair<transfer_id, peer_id>> stale;
  for (auto& [id, e] : early_)
    if (now >= e.deadline_ms) stale.emplace_back(id, e.peer);
  for (auto& [id, peer] : stale) {
    early_.erase(id);
    ++early_dropped_;
    transport_.notify(peer, id, notify_kind::failed);  // lets the destination free its pages
  }
  std::vector<peer_id> close;
  for (auto& [id, q] : quarantine_)
    if (now >= q.deadline_ms && !q.close_requested) close.push_back(q.peer);
  for (peer_id p : close) request_close(p);
}

void transfer_table::on_peer_ready(peer_id peer) {
  // A peer that connected to us is ready without this side having asked for it.
  auto p = peers_.find(peer);
  if (p != peers_.end() && p->second == peer_state::closing) return;
  peers_[peer] = peer_state::ready;
  std::vector<transfer_id> ids;
  for (auto& [id, t] : live_)
    if (t.peer == peer) ids.push_back(id);
  for (transfer_id id : ids) {
    auto it = live_.find(id);
    if (it != live_.end()) on_ready_peer(id, it->second);
  }
}

void transfer_table::on_peer_failed(peer_id peer, const std::string& why) {
  std::vector<transfer_id> ids;
  for (auto& [id, t] : live_)
    if (t.peer == peer) ids.push_back(id);
  for (transfer_id id : ids) fail(id, fail_reason::peer_failed, why);
  last_error_ = why;
  request_close(peer);
}

void transfer_table::on_peer_closed(peer_id peer) {
  peers_.erase(peer);
  std::vector<transfer_id> ids;
  for (auto& [id, t] : live_)
    if (t.peer == peer) ids.push_back(id);
  for (transfer_id id : ids)
    fail(id, fail_reason::peer_closed, fmt::format("KV transfer {}: the connection to peer {} closed", id, peer),
         /*nothing_in_flight=*/true);
  std::vector<transfer_id> q;
  for (auto& [id, e] : quarantine_)
    if (e.peer == peer) q.push_back(id);
  for (transfer_id id : q) release_quarantine(id);
  std::vector<transfer_id> e;
  for (auto& [id, d] : early_)
    if (d.peer == peer) e.push_back(id);
  for (transfer_id id : e) early_.erase(id);
}

void transfer_table::on_descriptors(peer_id peer, transfer_id id, pool_pages dst_pages) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second.role == transfer_role::source && it->second.peer == peer) {
    auto& t = it->second;
    if (t.have_descriptors) {
      ++late_events_;
      return;
    }
    t.remote_pages = std::move(dst_pages);
    t.have_descriptors = true;
    maybe_put(id, t);
    return;
  }
  if (it != live_.end() || quarantine_.count(id) || early_.count(id)) {
    ++late_events_;
    return;
  }
  // The destination may learn of the request before this side does: keep them a while.
  if (early_.size() >= limits_.max_early_descriptors) {
    ++early_dropped_;
    transport_.notify(peer, id, notify_kind::failed);
    return;
  }
  early_[id] = {peer, clock_.now_ms() + limits_.bootstrap_ms + limits_.waiting_ms, std::move(dst_pages)};
}

void transfer_table::on_put_complete(transfer_id id, bool ok, const std::string& why) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second.role == transfer_role::source &&
      it->second.phase == transfer_phase::transferring) {
    auto& t = it->second;
    t.io_in_flight = false;
    if (ok) {
      transport_.notify(t.peer, id, notify_kind::done);
      finish(id);
    } else {
      fail(id, fail_reason::put_failed, fmt::format("KV transfer {}: writing the pages failed: {}", id, why));
    }
    return;
  }
  auto q = quarantine_.find(id);
  if (q != quarantine_.end() && q->second.role == transfer_role::source) {
    transport_.notify(q->second.peer, id, notify_kind::failed);
    release_quarantine(id);
    return;
  }
  ++late_events_;
}

void transfer_table::on_notify(peer_id peer, transfer_id id, notify_kind kind) {
  auto it = live_.find(id);
  if (it != live_.end() && it->second.peer == peer) {
    auto& t = it->second;
    if (t.role == transfer_role::destination) {
      switch (kind) {
        case notify_kind::started:
          if (t.phase == transfer_phase::waiting) enter(t, transfer_phase::transferring);
          return;
        case notify_kind::done: {
          t.io_in_flight = false;  // the source flushed: nothing more lands
          fail_reason r = fail_reason::checksum;
          if (std::string why = transport_.verify_received(peer, id, t.pages, r); !why.empty()) {
            fail(id, r, fmt::format("KV transfer {}: {}", id, why), /*nothing_in_flight=*/true);
            return;
          }
          finish(id);
          return;
        }
        case notify_kind::failed:
          t.io_in_flight = false;
          fail(id, fail_reason::remote_failed, fmt::format("KV transfer {}: the source gave up", id));
          return;
        case notify_kind::cancel: break;
      }
    } else if (kind == notify_kind::cancel) {
      fail(id, fail_reason::remote_cancel, fmt::format("KV transfer {}: the destination cancelled", id));
      return;
    }
    ++late_events_;
    return;
  }
  auto q = quarantine_.find(id);
  if (q != quarantine_.end() && q->second.peer == peer) {
    if (q->second.role == transfer_role::destination &&
        (kind == notify_kind::done || kind == notify_kind::failed)) {
      release_quarantine(id);  // the source flushed: nothing of it can land any more
      return;
    }
    ++late_events_;
    return;
  }
  if (kind == notify_kind::cancel) {
    // Nothing of `id` is in flight here (not live, not quarantined): say so, so the
    // destination frees its pages without waiting for its quarantine deadline.
    early_.erase(id);
    transport_.notify(peer, id, notify_kind::failed);
  }
  ++late_events_;
}

void transfer_table::fail(transfer_id id, fail_reason r, const std::string& why, bool nothing_in_flight) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  transfer t = std::move(it->second);
  live_.erase(it);
  ++failures_[r];
  last_error_ = why;
  bool in_flight = t.io_in_flight && !nothing_in_flight;
  if (!nothing_in_flight) {
    if (t.role == transfer_role::destination && in_flight) transport_.notify(t.peer, id, notify_kind::cancel);
    if (t.role == transfer_role::source && !in_flight) transport_.notify(t.peer, id, notify_kind::failed);
  }
  if (!in_flight) {
    release(id, t.role, std::move(t.pages), false);
    return;
  }
  bool close_now = quarantine_.size() >= limits_.max_quarantined;
  quarantine_[id] = {t.role, t.peer, clock_.now_ms() + limits_.quarantine_ms, std::move(t.pages), false};
  if (close_now) request_close(t.peer);
}

void transfer_table::finish(transfer_id id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  transfer t = std::move(it->second);
  live_.erase(it);
  ++completed_;
  release(id, t.role, std::move(t.pages), true);
}

void transfer_table::release_quarantine(transfer_id id) {
  auto it = quarantine_.find(id);
  if (it == quarantine_.end()) return;
  quarantined_transfer q = std::move(it->second);
  quarantine_.erase(it);
  release(id, q.role, std::move(q.pages), false);
}

void transfer_table::release(transfer_id id, transfer_role role, pool_pages pages, bool delivered) {
  pages_released_ += count_pages(pages);
  if (release_) release_(id, role, pages, delivered);
}

void transfer_table::request_close(peer_id peer) {
  for (auto& [id, q] : quarantine_)
    if (q.peer == peer) q.close_requested = true;
  auto p = peers_.find(peer);
  if (p != peers_.end() && p->second == peer_state::closing) return;
  peers_[peer] = peer_state::closing;
  transport_.close_peer(peer);
}

std::string transfer_table::pool_label(size_t p) const {
  return p < pool_names_.size() ? fmt::format("pool {} ({})", p, pool_names_[p]) : fmt::format("pool {}", p);
}

std::string transfer_table::check_descriptors(const pool_pages& src, const pool_pages& dst) const {
  if (src.size() != dst.size())
    return fmt::format("the destination offered pages of {} pools for {} source pools; both sides must serve the "
                       "same KV layout set",
                       dst.size(), src.size());
  for (size_t p = 0; p < src.size(); ++p) {
    if (src[p].size() != dst[p].size())
      return fmt::format("{}: the destination offered {} pages for {} source pages; both sides must size the "
                         "request with the same page size",
                         pool_label(p), dst[p].size(), src[p].size());
    for (size_t i = 0; i < src[p].size(); ++i)
      if ((src[p][i] < 0) != (dst[p][i] < 0))
        return fmt::format("{}: block {} is {} on the source but {} on the destination; released window blocks "
                           "must match on both sides",
                           pool_label(p), i, src[p][i] < 0 ? "released" : "held",
                           dst[p][i] < 0 ? "released" : "held");
  }
  return {};
}

std::optional<transfer_phase> transfer_table::phase(transfer_id id) const {
  if (auto it = live_.find(id); it != live_.end()) return it->second.phase;
  if (quarantine_.count(id)) return transfer_phase::failed;
  return std::nullopt;
}

size_t transfer_table::quarantined_pages() const {
  size_t n = 0;
  for (auto& [id, q] : quarantine_) n += count_pages(q.pages);
  return n;
}

uint64_t transfer_table::failed(fail_reason r) const {
  auto it = failures_.find(r);
  return it == failures_.end() ? 0 : it->second;
}

std::vector<metric_sample> transfer_table::metrics() const {
  std::vector<metric_sample> m;
  m.push_back({"kv_transfer_started_total", "", double(started_), "counter", "KV transfers started"});
  m.push_back({"kv_transfer_done_total", "", double(completed_), "counter", "KV transfers completed"});
  for (auto& [r, n] : failures_)
    m.push_back({"kv_transfer_failed_total", fmt::format("reason=\"{}\"", to_string(r)), double(n), "counter",
                 "KV transfers failed, by reason"});
  m.push_back({"kv_transfer_late_events_total", "", double(late_events_), "counter",
               "completions/notifications for unknown or finished transfers (ignored)"});
  m.push_back({"kv_transfer_rejected_total", "", double(rejected_), "counter",
               "KV transfers rejected because the table was full"});
  m.push_back({"kv_transfer_early_descriptors_dropped_total", "", double(early_dropped_), "counter",
               "descriptors that arrived for a request this side never started"});
  m.push_back({"kv_transfer_pages_released_total", "", double(pages_released_), "counter",
               "pages handed back to their owner"});
  m.push_back({"kv_transfer_live", "", double(live_.size()), "gauge", "KV transfers in progress"});
  m.push_back({"kv_transfer_quarantined_pages", "", double(quarantined_pages()), "gauge",
               "pages held back because a remote write may still land"});
  return m;
}

}  // namespace tandem::ucx
