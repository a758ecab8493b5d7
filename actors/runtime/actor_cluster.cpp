#include "actors/runtime/actor_cluster_state.h"

namespace tandem {

using cluster_detail::children_of;
using cluster_detail::spawn_set;

actor_cluster::actor_cluster(std::shared_ptr<llama_model> model, actor_cluster_options opt)
    : opt_(std::move(opt)), st_(std::make_unique<state>()) {
  if (!model) throw tandem::error(error_kind::failed, "actor_cluster needs a model");
  auto bad = opt_.lim.validate();
  if (!bad.empty()) throw tandem::error(error_kind::failed, bad);
  const auto& mc = model->config();
  const auto layout = model->layout(opt_.lim.page_size);
  // The layout set served: a sliding-window model keeps its window layers in a pool of rings
  // (in every tier, and across nodes: transfers carry every pool).
  const kv_pools_layout set = model->pools_layout(opt_.lim.page_size);
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
                         opt_.lim.link_timeout_ms, make_actor_logger("cluster", sink, opt_.log_level));
  }

  s.prefix_cache = prefix_cache;
  s.host_pages = host_pages;
  s.extra_host_pages.clear();
  for (size_t p = 1; p < sizing.host_pool_pages.size(); ++p)
    s.extra_host_pages.push_back(static_cast<int32_t>(sizing.host_pool_pages[p]));
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
    self->request(s.supervisor, std::chrono::milliseconds(opt_.lim.query_timeout_ms), stop_atom::value)
        .receive([](bool) {},
                 [&](caf::error& e) { s.log->warn("supervisor did not confirm shutdown: {}", s.sys->render(e)); });
    self->send_exit(s.supervisor, caf::exit_reason::user_shutdown);
    if (s.has("router"))
      self->request(s.router.handle, std::chrono::milliseconds(opt_.lim.query_timeout_ms), stop_atom::value)
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
  r.n = std::max(1, req.n);
  if (req.deadline != std::chrono::steady_clock::time_point::max()) {
    // The API deadline is steady_clock; the cluster clock may be another (tests): carry the remaining time.
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(req.deadline -
                                                                      std::chrono::steady_clock::now());
    r.deadline_ms = s.clk->now_ms() + std::max<int64_t>(left.count(), 1);
  }
  const role_handle<router_role> router(s.router);
  auto ticket = router.admit<msg::submit>();
  if (!ticket) {
    if (cb) cb(error_event(r.id, s.router.gate->overloaded_error(), static_cast<int32_t>(r.prompt.size())));
    return;
  }
  router.send_anon<msg::submit>(std::move(ticket), [&](schema::SubmitRequest::Builder b) { r.write(b); },
                                callback_box{std::move(cb), r.id, static_cast<int32_t>(r.prompt.size())});
}

void actor_cluster::abort(const std::string& request_id, finish_reason why, int32_t choice) {
  auto& s = *st_;
  std::shared_lock<std::shared_mutex> sl(s.submit_mu);
  if (s.stopped || s.unhealthy || !s.has("router")) return;
  role_handle<router_role>(s.router).send_anon<msg::abort>([&](schema::Abort::Builder a) {
    a.setId(request_id);
    a.setStopString(why == finish_reason::stop);
    a.setChoice(choice);
  });
}


}  // namespace tandem
