#include "actors/runtime/actor_cluster.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <caf/all.hpp>
#include <caf/io/middleman.hpp>
#include <mutex>
#include <shared_mutex>

#include <unistd.h>

#include <fstream>
#include <map>
#include <optional>

#include "actors/cache_tier/cache_tier.h"
#include "actors/cache_tier/page_file.h"
#include "actors/common/drain_mode.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/runtime/node_drain.h"
#include "actors/runtime/readiness.h"
#include "actors/supervisor/supervisor.h"
#include "actors/worker/worker.h"

namespace tandem {

struct actor_cluster::state {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  bounded_actor router, prefill, decode, worker, cache;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::atomic<bool> stopped{false};
  std::mutex stop_mu;
  /// submit() holds it shared while sending, shutdown() exclusively while setting `stopped`:
  /// every submission either reaches the router before its stop message or sees `stopped`.
  std::shared_mutex submit_mu;
  int64_t start_ms = 0;
  model_facts facts;
  /// Cluster time at which every actor last answered a stats query (a heartbeat round).
  std::atomic<int64_t> last_heartbeat_ms{0};
  // What a restart needs to spawn the actor set again.
  std::shared_ptr<llama_model> model;
  kv_layout layout;
  kv_pools_layout pools;             ///< the layout set the node serves (one pool: `layout`)
  std::vector<int32_t> extra_pages;  ///< device pages of pools 1..
  std::shared_ptr<spdlog::sinks::sink> sink;
  /// Cache tiers, sized once at start (the same on every restart).
  bool prefix_cache = true;
  int32_t host_pages = 0;
  int64_t disk_pages = 0;
  caf::actor supervisor;
  /// Set once by the supervisor's escalation; submissions then fail fast. Guarded by submit_mu.
  std::string unhealthy_why;
  std::atomic<bool> unhealthy{false};
  std::atomic<bool> draining{false};  ///< tandem inspect --drain (re-applied to restarted actors)

  /// Multi-node: this node's ingress and the other nodes (empty for one process).
  node_links links;
  /// On the router's node, one stand-in per remote node and role: the router's targets
  /// ("node/role", the name that node's credits carry), so its policies, health checks and
  /// breakers see every node. `prefill`/`decode` above are then the local scheduler or the
  /// proxy over all nodes of the role that the local schedulers send to (none on a router-only node).
  std::vector<bounded_actor> route_proxies;
  std::vector<std::string> roles;  ///< empty = every role
  bool has(const std::string& r) const {
    return roles.empty() || std::find(roles.begin(), roles.end(), r) != roles.end();
  }

  /// The current actors, copied under the lock (the supervisor may replace them). Roles of
  /// other nodes are their local proxies; roles nobody here needs have no actor.
  std::vector<bounded_actor*> all() {
    std::vector<bounded_actor*> v;
    for (auto* a : {&router, &prefill, &decode, &worker, &cache})
      if (a->handle) v.push_back(a);
    for (auto& p : route_proxies) v.push_back(&p);
    return v;
  }
};

namespace {

/// Resident set size of this process (bytes), from /proc/self/statm; 0 if unreadable.
double process_rss_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return double(resident) * double(::sysconf(_SC_PAGESIZE));
}

/// The proxy for a role of other nodes, over all its nodes (what a local scheduler sends
/// to: handoffs go to the decode node the router chose), or an empty handle if no other node
/// has it.
bounded_actor remote_role(actor_cluster::state& s, const actor_cluster_options& opt, const std::string& role,
                          int32_t bound) {
  auto targets = s.links.with_role(role);
  if (targets.empty()) return {};
  return spawn_remote_proxy(*s.sys, role, std::move(targets), bound, false,
                            make_actor_logger("proxy_" + role, s.sink, opt.log_level), "",
                            (role == "decode" && s.has("prefill")) || (role == "prefill" && s.has("decode")));
}

/// The router's targets for `role`: the local scheduler (named `node/role`, as its credits),
/// or one proxy per other node with the role (added to s.route_proxies). A proxy's mailbox is
/// named after the role when it is the role's only stand-in here, else after its target.
std::vector<route_target> route_targets(actor_cluster::state& s, const actor_cluster_options& opt,
                                        const std::string& role, const bounded_actor& local, int32_t bound) {
  if (s.has(role)) return {route_target{opt.node_name + "/" + role, local}};
  std::vector<route_target> v;
  auto nodes = s.links.with_role(role);
  const bool alone = nodes.size() == 1 && !local;
  for (auto& n : nodes) {
    const std::string target = n.name + "/" + role;
    auto a = spawn_remote_proxy(*s.sys, role, {n}, bound, true,
                                make_actor_logger("proxy_" + role, s.sink, opt.log_level), alone ? role : target);
    s.route_proxies.push_back(a);
    v.push_back(route_target{target, a});
  }
  return v;
}

/// The router over every prefill and decode target this node reaches (local or proxied).
bounded_actor spawn_router_for(actor_cluster::state& s, const actor_cluster_options& opt) {
  router_options ro;
  ro.lim = opt.lim;
  ro.model = s.facts;
  ro.tick_ms = opt.router_tick_ms;
  ro.policy = opt.policy;
  auto prefills = route_targets(s, opt, "prefill", s.prefill, opt.lim.prefill_mailbox);
  auto decodes = route_targets(s, opt, "decode", s.decode, opt.lim.decode_mailbox);
  if (prefills.empty())
    throw tandem::error(error_kind::failed,
                        fmt::format("node {} runs the router but no node has the prefill role; give one node it",
                                    opt.node_name));
  return spawn_router(*s.sys, ro, std::move(prefills), std::move(decodes), s.clk,
                      make_actor_logger("router", s.sink, opt.log_level));
}

/// Sends the peer set to the proxies (they answer undeliverable work to the router through it).
void send_peers_to_proxies(actor_cluster::state& s, const peer_set& peers) {
  for (auto& p : s.route_proxies) caf::anon_send(p.handle, peers_atom::value, peers);
}

/// Spawns and wires one set of the node's actors into `s` (at start and on every restart).
void spawn_set(actor_cluster::state& s, const actor_cluster_options& opt, int32_t n_pages) {
  s.route_proxies.clear();  // a restart sent the old ones their exit with the rest
  if (!s.has("worker")) {
    // A router-only node: the front ends and the router over one proxy per remote node.
    s.worker = s.cache = s.prefill = s.decode = bounded_actor{};
    s.router = spawn_router_for(s, opt);
    peer_set peers{s.router, {}, {}, {}, {}};
    send_peers_to_proxies(s, peers);
    if (s.links.ingress) caf::anon_send(s.links.ingress, peers_atom::value, peers);
    return;
  }
  worker_options wo;
  wo.kv_transfer = opt.kv_transfer;
  wo.pool_id = opt.node_name + "/worker0";
  wo.n_pages = n_pages;
  wo.page_size = opt.lim.page_size;
  wo.pools = s.pools;
  wo.extra_pages = s.extra_pages;
  wo.device = opt.device;
  wo.mailbox_bound = opt.lim.worker_mailbox;
  wo.fail_at_start = opt.worker_fails_at_start;
  wo.grammar_vocab = opt.grammar_vocab;
  wo.host_pages = s.host_pages;
  if (s.disk_pages > 0) wo.disk_dir = opt.cache.disk_dir;
  s.worker = spawn_worker(*s.sys, s.model, wo, make_actor_logger("worker", s.sink, opt.log_level));

  cache_tier_options co;
  co.n_pages = n_pages;
  co.page_size = opt.lim.page_size;
  co.prefix_cache = s.prefix_cache;
  co.mailbox_bound = opt.lim.cache_tier_mailbox;
  co.cache = opt.cache;
  co.layout = s.layout;
  co.pools = s.pools;
  co.extra_pages = s.extra_pages;
  co.chunk_tokens = opt.lim.prefill_chunk_tokens;
  co.host_pages = s.host_pages;
  co.disk_pages = s.disk_pages;
  s.cache = spawn_cache_tier(*s.sys, co, s.worker, make_actor_logger("cache_tier", s.sink, opt.log_level));

  scheduler_options so;
  so.lim = opt.lim;
  so.lim.prefix_cache = s.prefix_cache;
  so.model = s.facts;
  so.layout = s.layout;
  so.pools = s.pools;
  so.pool_id = wo.pool_id;
  so.node = opt.node_name;
  so.transfer_failure_policy = opt.transfer_failure_policy;
  so.shares_worker = s.has("prefill") && s.has("decode");
  if (!s.has("decode")) {
    auto d = s.links.with_role("decode");
    if (!d.empty()) so.remote_decode_node = d.front().name;
  }
  if (!s.has("prefill")) so.lim.prefix_cache = false;  // nothing acquires prefixes on a decode-only node
  s.prefill = s.has("prefill")
                  ? spawn_prefill_scheduler(*s.sys, so, s.clk, make_actor_logger("prefill", s.sink, opt.log_level))
                  : remote_role(s, opt, "prefill", opt.lim.prefill_mailbox);
  s.decode = s.has("decode")
                 ? spawn_decode_scheduler(*s.sys, so, s.clk, make_actor_logger("decode", s.sink, opt.log_level))
                 : remote_role(s, opt, "decode", opt.lim.decode_mailbox);

  s.router = s.has("router") ? spawn_router_for(s, opt) : remote_role(s, opt, "router", opt.lim.router_mailbox);

  peer_set peers{s.router, s.prefill, s.decode, s.worker, s.cache};
  for (auto* a : {&s.prefill, &s.decode, &s.router})
    if (a->handle && (a != &s.router || !s.has("router"))) caf::anon_send(a->handle, peers_atom::value, peers);
  send_peers_to_proxies(s, peers);
  if (s.links.ingress) caf::anon_send(s.links.ingress, peers_atom::value, peers);
  if (s.draining)  // restarted while draining: the new actors drain too
    for (auto [role, a] : {std::pair{"router", &s.router}, std::pair{"prefill", &s.prefill}, std::pair{"decode", &s.decode}})
      if (s.has(role) && a->handle) caf::anon_send(a->handle, drain_atom::value, true);
}

std::vector<supervised_child> children_of(actor_cluster::state& s) {
  std::vector<supervised_child> v;
  for (auto [name, a] : {std::pair{"router", &s.router}, std::pair{"prefill", &s.prefill},
                         std::pair{"decode", &s.decode}, std::pair{"worker", &s.worker},
                         std::pair{"cache_tier", &s.cache}})
    if (a->handle) v.push_back({name, a->handle});
  for (auto& p : s.route_proxies) v.push_back({p.gate->actor_name(), p.handle});
  return v;
}

}  // namespace

actor_cluster::actor_cluster(std::shared_ptr<llama_model> model, actor_cluster_options opt)
    : opt_(std::move(opt)), st_(std::make_unique<state>()) {
  if (!model) throw tandem::error(error_kind::failed, "actor_cluster needs a model");
  auto bad = opt_.lim.validate();
  if (!bad.empty()) throw tandem::error(error_kind::failed, bad);
  const auto& mc = model->config();
  const auto layout = model->layout(opt_.lim.page_size);
  // The layout set served: a sliding-window model keeps its window layers in a pool of rings.
  // Cross-node transfers move one pool today, so a node that sends or receives KV over the
  // network serves the one-pool layout (full-context pages for every layer).
  const kv_pools_layout set = opt_.kv_transfer ? kv_pools_layout::single(layout) : model->pools_layout(opt_.lim.page_size);
  max_context_ = mc.n_ctx > 0 ? mc.n_ctx : opt_.lim.max_context;
  if (opt_.lim.max_context > 0) max_context_ = std::min(max_context_, opt_.lim.max_context);
  if (max_context_ <= 1)
    throw tandem::error(
        error_kind::failed,
        fmt::format("context length {} is too small; set limits.max_context > 1", max_context_));
  // The same sizing `tandem check-config` checks (size_kv_pools), so a checked config starts.
  // Only a node with a worker or cache tier allocates pools (check-config checks those).
  const bool holds_kv = opt_.roles.empty() ||
                        std::find(opt_.roles.begin(), opt_.roles.end(), "worker") != opt_.roles.end() ||
                        std::find(opt_.roles.begin(), opt_.roles.end(), "cache") != opt_.roles.end();
  kv_sizing sizing;
  {
    const long ram_pages = ::sysconf(_SC_PHYS_PAGES), ram_page = ::sysconf(_SC_PAGESIZE);
    const uint64_t ram = ram_pages > 0 && ram_page > 0 ? uint64_t(ram_pages) * uint64_t(ram_page) : 0;
    sizing = size_kv_pools(opt_.lim, opt_.cache, set, ram);
    if (!sizing.ok() && holds_kv) {
      std::string msg = sizing.problems.size() == 1 ? "invalid KV cache settings: " : "invalid KV cache settings:";
      for (const auto& p : sizing.problems) msg += (sizing.problems.size() == 1 ? "" : "\n  ") + p;
      throw tandem::error(error_kind::failed, msg);
    }
  }
  n_pages_ = static_cast<int32_t>(std::clamp<int64_t>(sizing.device_pages, 1, int64_t(1) << 30));
  const bool prefix_cache = opt_.lim.prefix_cache && opt_.cache.enabled;
  const int32_t host_pages = static_cast<int32_t>(sizing.host_pages);
  const int64_t disk_pages = sizing.disk_pages;
  // Fail on an unusable disk directory now, before any actor (and the worker's thread) exists.
  if (disk_pages > 0)
    for (size_t p = 0; p < set.pools.size(); ++p)
      scan_page_files(opt_.cache.disk_dir, pool_file_fingerprint(set, p), cache_disk_file_bytes(set.pools[p].page));

  auto& s = *st_;
  s.clk = opt_.clock ? opt_.clock : std::make_shared<steady_cluster_clock>();
  auto sink = opt_.sink ? opt_.sink : make_stderr_sink(opt_.log_json);
  s.log = make_actor_logger("cluster", sink, opt_.log_level);
  s.start_ms = s.clk->now_ms();
  s.last_heartbeat_ms = s.start_ms;
  s.facts = model_facts{opt_.eos_id, max_context_, mc.n_vocab};

  s.cfg.set("scheduler.max-threads", static_cast<size_t>(opt_.lim.scheduler_threads));
  s.cfg.add_message_type<wire>("tandem_wire");
  s.roles = opt_.roles;
  const bool multi_node = !opt_.remote_nodes.empty();
  if (multi_node) s.cfg.load<caf::io::middleman>();
  s.sys = std::make_unique<caf::actor_system>(s.cfg);
  if (multi_node) {
    std::vector<std::string> local = opt_.roles;
    s.links = link_nodes(*s.sys, opt_.node_name, opt_.cluster_host, opt_.cluster_port, local, opt_.remote_nodes,
                         opt_.link_timeout_ms, make_actor_logger("cluster", sink, opt_.log_level));
  }

  s.prefix_cache = prefix_cache;
  s.host_pages = host_pages;
  s.disk_pages = disk_pages;
  s.model = std::move(model);
  s.layout = layout;
  s.pools = set;
  s.extra_pages.clear();
  for (size_t p = 1; p < sizing.pool_pages.size(); ++p)
    s.extra_pages.push_back(static_cast<int32_t>(std::clamp<int64_t>(sizing.pool_pages[p], 1, int64_t(1) << 30)));
  s.sink = sink;
  spawn_set(s, opt_, n_pages_);
  supervisor_options sv;
  sv.node_name = opt_.node_name;
  sv.max_restarts = opt_.lim.supervisor_max_restarts;
  sv.period_ms = opt_.lim.supervisor_period_ms;
  sv.restart_all = [this] {
    auto& st = *st_;
    std::unique_lock<std::shared_mutex> sl(st.submit_mu);
    // The old set goes first: the router's state ends its in-flight requests with `disconnected`.
    for (auto* a : st.all())
      if (a->handle) caf::anon_send_exit(a->handle, caf::exit_reason::user_shutdown);
    spawn_set(st, opt_, n_pages_);
    return children_of(st);
  };
  sv.escalate = [this](const std::string& why) {
    auto& st = *st_;
    std::unique_lock<std::shared_mutex> sl(st.submit_mu);
    st.unhealthy_why = why;
    st.unhealthy = true;
    if (opt_.on_escalate) opt_.on_escalate(why);
  };
  s.supervisor = spawn_supervisor(*s.sys, std::move(sv), children_of(s), s.clk,
                                  make_actor_logger("supervisor", sink, opt_.log_level));
  if (holds_kv) {
    s.log->info("cluster up: model {} (kernels {}), {} KV pages of {} ({:.1f} MiB), context {}, prefix cache {}",
                opt_.model_id, opt_.kernels, n_pages_, set.pools[0].page.describe(),
                double(n_pages_) * double(set.pools[0].page.page_bytes()) / (1024.0 * 1024.0), max_context_,
                opt_.lim.prefix_cache ? "on" : "off");
    for (size_t p = 1; p < set.pools.size(); ++p)
      s.log->info("KV pool '{}': {} pages of {} ({:.1f} MiB)", set.pools[p].name, s.extra_pages[p - 1],
                  set.pools[p].describe(),
                  double(s.extra_pages[p - 1]) * double(set.pools[p].page.page_bytes()) / (1024.0 * 1024.0));
  }
  else  // a router-only node: the KV pools live on its prefill and decode nodes
    s.log->info("cluster up: model {} (tokenizer and limits only), no KV pool on this node (roles: {}), context {}",
                opt_.model_id, fmt::join(opt_.roles, ", "), max_context_);
}

actor_cluster::~actor_cluster() { shutdown(); }

void actor_cluster::shutdown() {
  auto& s = *st_;
  std::lock_guard<std::mutex> lk(s.stop_mu);
  if (!s.sys) return;
  {
    std::unique_lock<std::shared_mutex> sl(s.submit_mu);
    s.stopped = true;
  }
  {
    caf::scoped_actor self{*s.sys};
    // The supervisor first, so the exits below are not taken for failures.
    self->request(s.supervisor, std::chrono::milliseconds(opt_.query_timeout_ms), stop_atom::value)
        .receive([](bool) {},
                 [&](caf::error& e) { s.log->warn("supervisor did not confirm shutdown: {}", s.sys->render(e)); });
    self->send_exit(s.supervisor, caf::exit_reason::user_shutdown);
    if (s.has("router"))
      self->request(s.router.handle, std::chrono::milliseconds(opt_.query_timeout_ms), stop_atom::value)
          .receive(
              [](bool) {},
              [&](caf::error& e) { s.log->warn("router did not confirm shutdown: {}", s.sys->render(e)); });
    for (auto* a : {&s.router, &s.prefill, &s.decode, &s.cache, &s.worker})
      if (a->handle) self->send_exit(a->handle, caf::exit_reason::user_shutdown);
    for (auto& p : s.route_proxies) self->send_exit(p.handle, caf::exit_reason::user_shutdown);
    if (s.links.ingress) {
      s.sys->middleman().unpublish(s.links.ingress, s.links.port);
      self->send_exit(s.links.ingress, caf::exit_reason::user_shutdown);
    }
  }
  s.links = node_links{};
  s.sys->await_all_actors_done();
  s.router = s.prefill = s.decode = s.cache = s.worker = bounded_actor{};
  s.route_proxies.clear();
  s.supervisor = caf::actor{};
  s.sys.reset();
  s.log->info("cluster stopped");
}

void actor_cluster::submit(completion_request req, event_callback cb) {
  auto& s = *st_;
  std::shared_lock<std::shared_mutex> sl(s.submit_mu);
  if (s.stopped) {
    if (cb)
      cb(error_event(
          req.request_id,
          tandem::error(error_kind::disconnected, "the cluster is shut down; retry on another node"),
          static_cast<int32_t>(req.prompt.size())));
    return;
  }
  if (!s.has("router")) {
    std::string routers;
    for (const auto& n : s.links.with_role("router")) routers += (routers.empty() ? "" : ", ") + n.name;
    if (cb)
      cb(error_event(req.request_id,
                     tandem::error(error_kind::unimplemented,
                                   fmt::format("node {} does not run the router; send requests to node {}",
                                               opt_.node_name, routers.empty() ? "with the router role" : routers)),
                     static_cast<int32_t>(req.prompt.size())));
    return;
  }
  if (s.unhealthy) {
    if (cb)
      cb(error_event(req.request_id, tandem::error(error_kind::disconnected, s.unhealthy_why + "; retry on another node"),
                     static_cast<int32_t>(req.prompt.size())));
    return;
  }
  seq_request r;
  r.id = std::move(req.request_id);
  r.prompt = std::move(req.prompt);
  r.stop_tokens = std::move(req.stop_tokens);
  r.sampling = req.sampling;
  r.max_tokens = req.max_tokens;
  r.ignore_eos = req.ignore_eos;
  r.logprobs = req.logprobs;
  if (req.deadline != std::chrono::steady_clock::time_point::max()) {
    // The API deadline is steady_clock; the cluster clock may be another (tests): carry the remaining time.
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(req.deadline -
                                                                      std::chrono::steady_clock::now());
    r.deadline_ms = s.clk->now_ms() + std::max<int64_t>(left.count(), 1);
  }
  if (!s.router.gate->try_enter()) {
    if (cb) cb(error_event(r.id, s.router.gate->overloaded_error(), static_cast<int32_t>(r.prompt.size())));
    return;
  }
  caf::anon_send(s.router.handle, submit_atom::value,
                 make_wire([&](schema::Envelope::Builder env) { r.write(env.initSubmit()); }),
                 callback_box{std::move(cb), r.id, static_cast<int32_t>(r.prompt.size())});
}

void actor_cluster::abort(const std::string& request_id, finish_reason why) {
  auto& s = *st_;
  std::shared_lock<std::shared_mutex> sl(s.submit_mu);
  if (s.stopped || s.unhealthy || !s.has("router")) return;
  s.router.gate->enter_control();
  caf::anon_send(s.router.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                   auto a = env.initAbort();
                   a.setId(request_id);
                   a.setStopString(why == finish_reason::stop);
                 }));
}

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
  for (const auto& actor : actors) {
    const auto* a = &actor;
    const auto& g = *a->gate;
    auto lbl = fmt::format("actor=\"{}\"", g.actor_name());
    boxes.metrics.push_back(
        {"mailbox_depth", lbl, double(g.depth()), "gauge", "Messages waiting in the mailbox"});
    boxes.metrics.push_back(
        {"mailbox_bound", lbl, double(g.bound()), "gauge", "Mailbox bound (limits.*_mailbox)"});
    boxes.metrics.push_back(
        {"mailbox_high_water", lbl, double(g.high_water()), "gauge", "Deepest mailbox seen"});
    boxes.metrics.push_back({"mailbox_rejected_total", lbl, double(g.rejected()), "counter",
                             "Messages refused at a full mailbox"});
    if (a->handle == worker.handle && !include_worker) continue;
    if (unhealthy) {
      all_answered = false;  // the escalated set is not restarted; asking would only time out
      continue;
    }
    self->request(a->handle, std::chrono::milliseconds(opt_.query_timeout_ms), stats_atom::value)
        .receive([&](const wire& w) { out.push_back(read_stats(w)); },
                 [&](caf::error& e) {
                   all_answered = false;
                   s.log->warn("stats from {} failed: {}", g.actor_name(), s.sys->render(e));
                 });
  }
  self->request(supervisor, std::chrono::milliseconds(opt_.query_timeout_ms), stats_atom::value)
      .receive([&](const wire& w) { out.push_back(read_stats(w)); },
               [&](caf::error& e) {
                 all_answered = false;
                 s.log->warn("stats from the supervisor failed: {}", s.sys->render(e));
               });
  if (s.links.ingress)
    self->request(s.links.ingress, std::chrono::milliseconds(opt_.query_timeout_ms), stats_atom::value)
        .receive([&](const wire& w) { out.push_back(read_stats(w)); },
                 [&](caf::error& e) {
                   all_answered = false;
                   s.log->warn("stats from the ingress failed: {}", s.sys->render(e));
                 });
  int64_t now_ms = s.clk->now_ms();
  if (all_answered) s.last_heartbeat_ms = now_ms;
  stats_snapshot up;
  up.actor = "cluster";
  double queued = 0, running = 0;
  for (const auto& x : out) {
    queued += x.value("prefill_queued_requests");
    running += x.value("prefill_active_requests") + x.value("decode_running_requests") +
               x.value("decode_waiting_requests");
  }
  up.metrics.push_back({"requests_queued", "", queued, "gauge", "Requests waiting for prefill"});
  up.metrics.push_back({"requests_running", "", running, "gauge", "Requests being prefilled or decoded"});
  up.metrics.push_back({"uptime_seconds", "", double(now_ms - s.start_ms) / 1000.0, "gauge",
                        "Seconds since the cluster started"});
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
  // Node health: every scrape is a heartbeat round over the actors.
  auto node = fmt::format("node=\"{}\"", opt_.node_name);
  up.metrics.push_back({"node_up", node, all_answered ? 1.0 : 0.0, "gauge",
                        "1 if every actor of the node answered the last stats round, else 0"});
  {
    const stats_snapshot *router = nullptr, *prefill = nullptr;
    for (const auto& x : out) {
      if (x.actor == "router") router = &x;
      if (x.actor == "prefill" && s.has("prefill")) prefill = &x;
    }
    const auto phase = node_drain_phase(s.draining, s.has("router"), s.has("prefill"), s.has("decode"), out);
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
    const bool is_prefill = s.has("prefill") && a->handle == s.prefill.handle;
    self->request(a->handle, std::chrono::milliseconds(opt_.query_timeout_ms), stats_atom::value)
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
  if (const auto phase = node_drain_phase(s.draining, s.has("router"), s.has("prefill"), s.has("decode"), snaps);
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
  if (!s.has("router"))
    throw tandem::error(error_kind::failed,
                        "this node runs no router: set limits.max_queue_wait_ms on the node with the router role");
  int32_t before = -1;
  std::string failure;
  caf::scoped_actor self{*s.sys};
  self->request(s.router.handle, std::chrono::milliseconds(opt_.query_timeout_ms), queue_wait_atom::value, ms)
      .receive([&](int32_t b) { before = b; }, [&](caf::error& e) { failure = s.sys->render(e); });
  if (before < 0)
    throw tandem::error(error_kind::disconnected,
                        fmt::format("the router did not take the new queue-wait bound ({}); retry", failure));
  return before;
}

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
      const bool local = (a == &s.router && s.has("router")) || (a == &s.prefill && s.has("prefill")) ||
                         (a == &s.decode && s.has("decode")) || a == &s.worker || a == &s.cache;
      remote.push_back(!local);
    }
  }
  for (size_t i = 0; i < actors.size(); ++i) {
    const auto& a = actors[i];
    actor_report ar;
    ar.name = a.gate->actor_name();
    ar.mailbox_depth = a.gate->depth();
    ar.mailbox_bound = a.gate->bound();
    ar.messages_handled = a.gate->accepted() - a.gate->depth();
    ar.mailbox_rejected = a.gate->rejected();
    ar.state = s.unhealthy ? "escalated" : remote[i] ? "remote" : by_actor.count(ar.name) ? "running" : "not answering";
    if (sup) {
      auto sl = fmt::format("node=\"{}\",actor=\"{}\"", opt_.node_name, ar.name);
      ar.restarts = int64_t(sup->value("actor_restarts_total", sl));
      for (const auto& m : sup->metrics) {
        if (m.name != "actor_last_failure_info" || m.labels.rfind(sl + ",cause=\"", 0) != 0) continue;
        std::string cause = m.labels.substr(sl.size() + 8);
        if (!cause.empty()) cause.pop_back();  // closing quote
        ar.last_error = cause;
      }
    }
    r.actors.push_back(std::move(ar));
  }
  if (!s.unhealthy && s.has("router")) {
    caf::scoped_actor self{*s.sys};
    self->request(actors[0].handle, std::chrono::milliseconds(opt_.query_timeout_ms), inflight_atom::value)
        .receive([&](const inflight_list& l) { r.requests = l.requests; },
                 [&](caf::error& e) { s.log->warn("in-flight table from the router failed: {}", s.sys->render(e)); });
  }
  if (auto it = by_actor.find("cache_tier"); it != by_actor.end()) {
    const auto& c = *it->second;
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
    // A layout of several pools: a row per pool ("device:window"), pages and bytes of each.
    if (s.pools.pools.size() > 1)
      for (const auto& spec : s.pools.pools) {
        const std::string l = fmt::format("pool=\"{}\"", spec.name);
        pool_report q;
        q.name = "device:" + spec.name;
        q.pages_total = int64_t(c.value("kv_pool_pages_total", l));
        q.pages_free = int64_t(c.value("kv_pool_pages_free", l));
        q.pages_cached = int64_t(c.value("kv_pool_pages_cached", l));
        q.bytes = int64_t(c.value("kv_pool_device_bytes", l));
        r.pools.push_back(q);
      }
  }
  return r;
}

node_report actor_cluster::drain(bool on) {
  auto& s = *st_;
  if (s.stopped || !s.sys) throw tandem::error(error_kind::disconnected, "the node is shut down; nothing to drain");
  std::vector<std::pair<std::string, bounded_actor>> actors;
  {
    std::shared_lock<std::shared_mutex> sl(s.submit_mu);
    s.draining = on;
    for (auto [role, a] : {std::pair{"router", &s.router}, std::pair{"prefill", &s.prefill}, std::pair{"decode", &s.decode}})
      if (s.has(role) && a->handle) actors.emplace_back(role, *a);
  }
  caf::scoped_actor self{*s.sys};
  std::string failed;
  for (const auto& [role, a] : actors)
    self->request(a.handle, std::chrono::milliseconds(opt_.query_timeout_ms), drain_atom::value, on)
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
