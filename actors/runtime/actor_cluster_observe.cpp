/// What a node says about itself: stats snapshots of every actor, health and readiness, the
/// inspect report, and drain.
#include "actors/runtime/actor_cluster_state.h"

namespace tandem {

using cluster_detail::children_of;

namespace cluster_detail {

double process_rss_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return double(resident) * double(::sysconf(_SC_PAGESIZE));
}

}  // namespace cluster_detail

using cluster_detail::process_rss_bytes;

namespace {

/// The mailbox gauges of one actor's gate (every actor, answering or not).
void add_mailbox_samples(const mailbox_gate& g, stats_snapshot& boxes) {
  auto lbl = fmt::format("actor=\"{}\"", g.actor_name());
  boxes.metrics.push_back({"mailbox_depth", lbl, double(g.depth()), "gauge", "Messages waiting in the mailbox"});
  boxes.metrics.push_back({"mailbox_bound", lbl, double(g.bound()), "gauge", "Mailbox bound (limits.*_mailbox)"});
  boxes.metrics.push_back({"mailbox_high_water", lbl, double(g.high_water()), "gauge", "Deepest mailbox seen"});
  boxes.metrics.push_back({"mailbox_rejected_total", lbl, double(g.rejected()), "counter",
                           "Messages refused at a full mailbox"});
}

/// Asks `who` (named `what` in the log) for its stats into `out`; false (logged) if it did not
/// answer within `timeout_ms`.
bool ask_stats(caf::scoped_actor& self, const caf::actor& who, int32_t timeout_ms, const std::string& what,
               caf::actor_system& sys, spdlog::logger& log, std::vector<stats_snapshot>& out) {
  bool answered = true;
  self->request(who, std::chrono::milliseconds(timeout_ms), stats_atom::value)
      .receive([&](const wire& w) { out.push_back(read_stats(w)); },
               [&](caf::error& e) {
                 answered = false;
                 log.warn("stats from {} failed: {}", what, sys.render(e));
               });
  return answered;
}

/// The node's load over its actors' snapshots: requests and tokens queued and running, uptime,
/// prefix cache hit rate.
void add_load_samples(const std::vector<stats_snapshot>& out, double uptime_s, stats_snapshot& up) {
  double queued = 0, running = 0;
  for (const auto& x : out) {
    queued += x.value("prefill_queued_requests");
    running += x.value("prefill_active_requests") + x.value("decode_running_requests") +
               x.value("decode_waiting_requests");
  }
  up.metrics.push_back({"requests_queued", "", queued, "gauge", "Requests waiting for prefill"});
  up.metrics.push_back({"requests_running", "", running, "gauge", "Requests being prefilled or decoded"});
  up.metrics.push_back({"uptime_seconds", "", uptime_s, "gauge", "Seconds since the cluster started"});
  double prompt = 0, hit = 0, queued_tokens = 0, running_tokens = 0;
  for (const auto& x : out) {
    prompt += x.value("prompt_tokens_total");
    hit += x.value("prefix_cache_hit_tokens_total");
    queued_tokens += x.value("prefill_queued_tokens");
    running_tokens += x.value("decode_running_tokens");
  }
  up.metrics.push_back({"tokens_queued", "", queued_tokens, "gauge", "Prompt tokens waiting for prefill"});
  up.metrics.push_back({"tokens_running", "", running_tokens, "gauge", "Context tokens of the sequences being decoded"});
  up.metrics.push_back({"prefix_cache_hit_rate", "", prompt > 0 ? hit / prompt : 0, "gauge",
                        "Fraction of accepted prompt tokens served from the prefix cache"});
}

}  // namespace

std::vector<stats_snapshot> actor_cluster::snapshots(bool include_worker) const {
  auto& s = *st_;
  std::vector<stats_snapshot> out;
  if (s.stopped || !s.sys) return out;
  // Copies: the supervisor may replace the actors while this waits for their answers.
  std::vector<bounded_actor> actors;
  bounded_actor worker;
  caf::actor supervisor;
  {
    std::shared_lock<std::shared_mutex> sl(s.submit_mu);
    for (auto* a : s.all()) actors.push_back(*a);
    worker = s.worker;
    supervisor = s.supervisor;
  }
  bool unhealthy = s.unhealthy;
  caf::scoped_actor self{*s.sys};
  stats_snapshot boxes;
  boxes.actor = "mailboxes";
  bool all_answered = true;
  const int32_t timeout_ms = opt_.lim.query_timeout_ms;
  for (const auto& a : actors) {
    add_mailbox_samples(*a.gate, boxes);
    if (a.handle == worker.handle && !include_worker) continue;
    if (unhealthy) {
      all_answered = false;  // the escalated set is not restarted; asking would only time out
      continue;
    }
    all_answered &= ask_stats(self, a.handle, timeout_ms, a.gate->actor_name(), *s.sys, *s.log, out);
  }
  all_answered &= ask_stats(self, supervisor, timeout_ms, "the supervisor", *s.sys, *s.log, out);
  if (s.links.ingress) all_answered &= ask_stats(self, s.links.ingress, timeout_ms, "the ingress", *s.sys, *s.log, out);
  int64_t now_ms = s.clk->now_ms();
  if (all_answered) s.last_heartbeat_ms = now_ms;
  stats_snapshot up;
  up.actor = "cluster";
  add_load_samples(out, double(now_ms - s.start_ms) / 1000.0, up);
  // Node health: every scrape is a heartbeat round over the actors.
  auto node = fmt::format("node=\"{}\"", opt_.node_name);
  up.metrics.push_back({"node_up", node, all_answered ? 1.0 : 0.0, "gauge",
                        "1 if every actor of the node answered the last stats round, else 0"});
  {
    const stats_snapshot *router = nullptr, *prefill = nullptr;
    for (const auto& x : out) {
      if (x.actor == "router") router = &x;
      if (x.actor == "prefill" && s.has(node_role::prefill)) prefill = &x;
    }
    const auto phase = node_drain_phase(s.draining, s.has(node_role::router), s.has(node_role::prefill), s.has(node_role::decode), out);
    const bool ready = node_readiness(all_answered && !unhealthy, "", router).ready && phase == drain_phase::serving &&
                       handoff_readiness(prefill, static_cast<int>(s.links.with_role("decode").size())).ready;
    up.metrics.push_back({"node_drain_state", node, double(static_cast<int>(phase)), "gauge",
                          "Drain of the node (tandem inspect --drain): 0 serving, 1 draining, 2 drained (safe to stop)"});
    up.metrics.push_back({"node_ready", node, ready ? 1.0 : 0.0, "gauge",
                          "1 if the node can serve (GET /health/ready 200): its actors answer and its router has a "
                          "live target of every role, else 0"});
  }
  up.metrics.push_back({"node_heartbeat_age_seconds", node, double(now_ms - s.last_heartbeat_ms.load()) / 1000.0,
                        "gauge", "Seconds since every actor of the node last answered"});
  up.metrics.push_back({"process_resident_memory_bytes", node, process_rss_bytes(), "gauge",
                        "Resident memory of the node's process"});
  up.metrics.push_back({"process_cpu_seconds_total", node, process_cpu_seconds(), "counter",
                        "User and system CPU time of the node's process"});
  out.push_back(std::move(boxes));
  out.push_back(std::move(up));
  return out;
}

namespace {
/// Bytes of the host tier (the worker reports them).
double bytes_host(const std::vector<stats_snapshot>& snaps) {
  double b = 0;
  for (const auto& x : snaps) b += x.value("kv_host_pool_bytes");
  return b;
}
}  // namespace

namespace {
double total(const std::vector<stats_snapshot>& v, const std::string& name,
             const std::string* labels = nullptr) {
  double t = 0;
  for (const auto& s : v) t += labels ? s.value(name, *labels) : s.value(name);
  return t;
}
}  // namespace

stats_info actor_cluster::stats() const {
  auto v = snapshots(false);
  stats_info i;
  i.requests_total = int64_t(total(v, "requests_total"));
  i.requests_queued = int64_t(total(v, "prefill_queued_requests"));
  i.requests_running = int64_t(total(v, "prefill_active_requests") + total(v, "decode_running_requests") +
                               total(v, "decode_waiting_requests"));
  i.tokens_generated = int64_t(total(v, "tokens_generated_total"));
  i.kv_pages_total = int64_t(total(v, "kv_pages_total"));
  i.kv_pages_free = int64_t(total(v, "kv_pages_free"));
  // Everything that ended with `overloaded`: bounds hit inside the actors, plus submissions
  // refused at the router's own mailbox (the only gate the front end passes directly).
  static const char* overloaded_reasons[] = {"queue_requests", "queue_tokens",    "kv_pages",
                                             "inflight_full",  "prefill_mailbox", "decode_mailbox",
                                             "cache_mailbox",  "deadline",        "queue_wait",
                                             "queue_timeout",  "decode_pages"};
  double rej = 0;
  for (const auto& s : v)
    for (const auto& m : s.metrics) {
      if (m.name == "mailbox_rejected_total" && m.labels == "actor=\"router\"") rej += m.value;
      if (m.name != "rejections_total") continue;
      for (const char* r : overloaded_reasons)
        if (m.labels.find(fmt::format("reason=\"{}\"", r)) != std::string::npos) rej += m.value;
    }
  i.rejected_overloaded = int64_t(rej);
  return i;
}

health_info actor_cluster::health() const {
  auto& s = *st_;
  health_info h;
  h.uptime_ms = s.clk->now_ms() - s.start_ms;
  if (s.stopped || !s.sys) {
    h.status = "stopped";
    return h;
  }
  std::vector<bounded_actor> actors;
  bounded_actor worker;
  {
    std::shared_lock<std::shared_mutex> sl(s.submit_mu);
    if (s.unhealthy) {
      h.ok = false;
      h.status = s.unhealthy_why;
      return h;
    }
    for (auto* a : {&s.router, &s.prefill, &s.decode, &s.cache})
      if (a->handle) actors.push_back(*a);
    for (auto& p : s.route_proxies) actors.push_back(p);
    worker = s.worker;
  }
  caf::scoped_actor self{*s.sys};
  bool ok = true;
  std::string why;
  std::optional<stats_snapshot> router;  // its view of the targets decides readiness
  std::vector<stats_snapshot> snaps;     // while draining: what the actors still hold
  std::optional<stats_snapshot> prefill;  // which decode nodes its handoffs reach
  for (const auto& actor : actors) {
    const auto* a = &actor;
    const bool is_router = a->handle == s.router.handle;
    const bool is_prefill = s.has(node_role::prefill) && a->handle == s.prefill.handle;
    self->request(a->handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), stats_atom::value)
        .receive([&](const wire& w) {
                   if (is_router) router = read_stats(w);
                   if (is_prefill) prefill = read_stats(w);
                   if (s.draining) snaps.push_back(is_router ? *router : read_stats(w));
                 },
                 [&](caf::error& e) {
                   ok = false;
                   why = fmt::format("{} actor does not answer: {}", a->gate->actor_name(), s.sys->render(e));
                 });
    if (!ok) break;
  }
  // A draining prefill node has drained once its worker wrote out every KV send. The worker
  // answers between forward passes, so it is asked only then; no answer means still draining.
  if (ok && s.draining && s.has(node_role::prefill) && worker.handle)
    self->request(worker.handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), stats_atom::value)
        .receive([&](const wire& w) { snaps.push_back(read_stats(w)); }, [&](caf::error&) {});
  h.ok = ok;
  h.status = ok ? "ok" : why;
  auto r = node_readiness(ok, h.status, router ? &*router : nullptr);
  h.ready = r.ready;
  h.ready_status = r.reason;
  if (auto hr = handoff_readiness(prefill ? &*prefill : nullptr, static_cast<int>(s.links.with_role("decode").size()));
      ok && !hr.ready) {
    h.ready_status = h.ready ? hr.reason : h.ready_status + "; " + hr.reason;
    h.ready = false;
  }
  if (const auto phase = node_drain_phase(s.draining, s.has(node_role::router), s.has(node_role::prefill), s.has(node_role::decode), snaps);
      ok && phase != drain_phase::serving) {
    h.ready = false;
    h.ready_status = drain_status(phase, opt_.node_name);
    h.drain = to_string(phase);
  }
  return h;
}

void actor_cluster::inject_failure(const std::string& role, const std::string& cause) {
  auto& s = *st_;
  std::shared_lock<std::shared_mutex> sl(s.submit_mu);
  if (s.stopped) throw tandem::error(error_kind::failed, "the cluster is shut down");
  for (const auto& c : children_of(s)) {
    if (c.name != role) continue;
    // An exit message carrying an error: the actor terminates with it, as after a crash.
    c.handle->enqueue(nullptr, caf::make_message_id(),
                      caf::make_message(caf::exit_msg{c.handle->address(), caf::make_error(caf::sec::runtime_error, cause)}),
                      nullptr);
    return;
  }
  throw tandem::error(error_kind::failed,
                      fmt::format("no actor role '{}'; use router, prefill, decode, worker or cache_tier", role));
}

int32_t actor_cluster::set_max_queue_wait_ms(int32_t ms) {
  auto& s = *st_;
  if (ms < 0)
    throw tandem::error(error_kind::failed,
                        fmt::format("limits.max_queue_wait_ms = {} must be >= 0 (0 = off)", ms));
  if (s.stopped || !s.sys)
    throw tandem::error(error_kind::disconnected, "the cluster is shut down; start it again to set its limits");
  if (!s.has(node_role::router))
    throw tandem::error(error_kind::failed,
                        "this node runs no router: set limits.max_queue_wait_ms on the node with the router role");
  int32_t before = -1;
  std::string failure;
  caf::scoped_actor self{*s.sys};
  self->request(s.router.handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), queue_wait_atom::value, ms)
      .receive([&](int32_t b) { before = b; }, [&](caf::error& e) { failure = s.sys->render(e); });
  if (before < 0)
    throw tandem::error(error_kind::disconnected,
                        fmt::format("the router did not take the new queue-wait bound ({}); retry", failure));
  return before;
}

namespace {

/// An actor's row of the report from its mailbox gate (its state is the caller's).
actor_report mailbox_report(const bounded_actor& a) {
  actor_report ar;
  ar.name = a.gate->actor_name();
  ar.mailbox_depth = a.gate->depth();
  ar.mailbox_bound = a.gate->bound();
  ar.messages_handled = a.gate->accepted() - a.gate->depth();
  ar.mailbox_rejected = a.gate->rejected();
  return ar;
}

/// The supervisor's restart count and last failure of the actor of `ar`.
void add_restarts(const stats_snapshot& sup, const std::string& node, actor_report& ar) {
  auto sl = fmt::format("node=\"{}\",actor=\"{}\"", node, ar.name);
  ar.restarts = int64_t(sup.value("actor_restarts_total", sl));
  for (const auto& m : sup.metrics) {
    if (m.name != "actor_last_failure_info" || m.labels.rfind(sl + ",cause=\"", 0) != 0) continue;
    std::string cause = m.labels.substr(sl.size() + 8);
    if (!cause.empty()) cause.pop_back();  // closing quote
    ar.last_error = cause;
  }
}

/// The pool rows of the report from the cache tier's snapshot `c`: the device pool, a row per
/// pool and tier of a layout of several, the host and disk tiers.
void add_pool_reports(const stats_snapshot& c, const std::vector<stats_snapshot>& snaps, const kv_pools_layout& pools,
                      node_report& r) {
  pool_report p;
  p.name = "device";
  p.pages_total = int64_t(c.value("kv_pages_total"));
  p.pages_free = int64_t(c.value("kv_pages_free"));
  p.pages_cached = int64_t(c.value("kv_pages_cached"));
  p.pages_evictable = int64_t(c.value("kv_pages_evictable"));
  double bytes = 0;
  for (const auto& x : snaps) bytes += x.value("kv_pool_bytes");
  p.bytes = int64_t(bytes);
  r.pools.push_back(p);
  // A layout of several pools: a row per pool and tier ("device:window", "host:window") from
  // the cache tier's `kv_pool_<prefix>...{pool}` series.
  auto pool_rows = [&](const std::string& tier, const std::string& prefix, const std::string& bytes_name) {
    for (const auto& spec : pools.pools) {
      const std::string l = fmt::format("pool=\"{}\"", spec.name);
      pool_report q;
      q.name = tier + ":" + spec.name;
      q.pages_total = int64_t(c.value("kv_pool_" + prefix + "pages_total", l));
      q.pages_free = int64_t(c.value("kv_pool_" + prefix + "pages_free", l));
      q.pages_cached = int64_t(c.value("kv_pool_" + prefix + "pages_cached", l));
      q.bytes = int64_t(c.value(bytes_name, l));
      r.pools.push_back(q);
    }
  };
  const bool several = pools.pools.size() > 1;
  if (several) pool_rows("device", "", "kv_pool_device_bytes");
  // The host and disk tiers behind it (pool 0's pages; a disk entry has a file per pool of its block).
  for (const char* tier : {"host", "disk"}) {
    const std::string l = fmt::format("tier=\"{}\"", tier);
    const int64_t total = int64_t(c.value("cache_pages_total", l));
    if (total <= 0) continue;
    pool_report q;
    q.name = tier;
    q.pages_total = total;
    q.pages_free = total - int64_t(c.value("cache_pages_used", l));
    q.pages_cached = int64_t(c.value("cache_pages_cached", l));
    q.bytes = std::string(tier) == "host" ? int64_t(bytes_host(snaps)) : 0;
    r.pools.push_back(q);
  }
  // Each pool has host pages of its own.
  if (several && c.value("cache_pages_total", "tier=\"host\"") > 0) pool_rows("host", "host_", "kv_pool_host_bytes");
}

}  // namespace

node_report actor_cluster::inspect() const {
  auto& s = *st_;
  node_report r;
  r.node = opt_.node_name;
  r.model_id = opt_.model_id;
  auto h = health();
  r.healthy = h.ok;
  r.status = h.status;
  r.ready = h.ready;
  r.ready_status = h.ready_status;
  r.drain = h.drain;
  r.uptime_ms = h.uptime_ms;
  if (s.stopped || !s.sys) return r;
  auto snaps = snapshots(true);
  const stats_snapshot* sup = nullptr;
  std::map<std::string, const stats_snapshot*> by_actor;
  for (const auto& x : snaps) {
    if (x.actor == "supervisor") sup = &x;
    by_actor[x.actor] = &x;
  }
  // Each actor, and whether it only stands in for a role another node runs (a proxy): such a
  // row is marked "remote", not reported as this node's role that is not answering.
  std::vector<bounded_actor> actors;
  std::vector<bool> remote;
  {
    std::shared_lock<std::shared_mutex> sl(s.submit_mu);
    for (auto* a : s.all()) {
      actors.push_back(*a);
      const bool local = (a == &s.router && s.has(node_role::router)) || (a == &s.prefill && s.has(node_role::prefill)) ||
                         (a == &s.decode && s.has(node_role::decode)) || a == &s.worker || a == &s.cache;
      remote.push_back(!local);
    }
  }
  for (size_t i = 0; i < actors.size(); ++i) {
    actor_report ar = mailbox_report(actors[i]);
    ar.state = s.unhealthy ? "escalated" : remote[i] ? "remote" : by_actor.count(ar.name) ? "running" : "not answering";
    if (sup) add_restarts(*sup, opt_.node_name, ar);
    r.actors.push_back(std::move(ar));
  }
  if (!s.unhealthy && s.has(node_role::router)) {
    caf::scoped_actor self{*s.sys};
    self->request(actors[0].handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), inflight_atom::value)
        .receive([&](const inflight_list& l) { r.requests = l.requests; },
                 [&](caf::error& e) { s.log->warn("in-flight table from the router failed: {}", s.sys->render(e)); });
  }
  if (auto it = by_actor.find("cache_tier"); it != by_actor.end()) add_pool_reports(*it->second, snaps, s.plan.pools, r);
  return r;
}

node_report actor_cluster::drain(bool on) {
  auto& s = *st_;
  if (s.stopped || !s.sys) throw tandem::error(error_kind::disconnected, "the node is shut down; nothing to drain");
  std::vector<std::pair<std::string, bounded_actor>> actors;
  {
    std::shared_lock<std::shared_mutex> sl(s.submit_mu);
    s.draining = on;
    for (auto [role, a] : {std::pair{node_role::router, &s.router}, std::pair{node_role::prefill, &s.prefill},
                           std::pair{node_role::decode, &s.decode}})
      if (s.has(role) && a->handle) actors.emplace_back(to_string(role), *a);
  }
  caf::scoped_actor self{*s.sys};
  std::string failed;
  for (const auto& [role, a] : actors)
    self->request(a.handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), drain_atom::value, on)
        .receive([](bool) {}, [&, role = role](caf::error& e) { failed += fmt::format(" {}: {};", role, s.sys->render(e)); });
  if (!failed.empty())
    throw tandem::error(error_kind::disconnected, fmt::format("node {}: actors did not take the {} ({}); retry",
                                                              opt_.node_name, on ? "drain" : "undrain", failed));
  s.log->warn("node {} {}", opt_.node_name,
              on ? "drains: no new requests are routed here; it reports drained once it holds none"
                 : "takes requests again (undrained)");
  return inspect();
}

std::string actor_cluster::metrics_text() const { return render_prometheus(snapshots()); }


}  // namespace tandem
