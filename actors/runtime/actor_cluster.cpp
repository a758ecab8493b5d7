#include "actors/runtime/actor_cluster_state.h"

namespace tandem {

using cluster_detail::children_of;
using cluster_detail::spawn_set;

namespace {

/// Physical memory of this machine (bytes; 0 = unknown): bounds the host tier.
uint64_t physical_ram_bytes() {
  const long ram_pages = ::sysconf(_SC_PHYS_PAGES), ram_page = ::sysconf(_SC_PAGESIZE);
  return ram_pages > 0 && ram_page > 0 ? uint64_t(ram_pages) * uint64_t(ram_page) : 0;
}

/// The start-up line: what the plan allocates here.
void log_plan(spdlog::logger& log, const node_plan& p, const actor_cluster_options& opt) {
  const auto& set = p.pools;
  if (!p.holds_kv) {  // a router-only node: the KV pools live on its prefill and decode nodes
    log.info("cluster up: model {} (tokenizer and limits only), no KV pool on this node (roles: {}), context {}",
             opt.model_id, fmt::join(role_names(p.spec.roles), ", "), p.model.max_context);
    return;
  }
  log.info("cluster up: model {} (kernels {}), {} KV pages of {} ({:.1f} MiB), context {}, prefix cache {}",
           opt.model_id, opt.kernels, p.n_pages, set.pools[0].page.describe(),
           double(p.n_pages) * double(set.pools[0].page.page_bytes()) / (1024.0 * 1024.0), p.model.max_context,
           p.spec.lim.prefix_cache ? "on" : "off");
  for (size_t i = 1; i < set.pools.size(); ++i)
    log.info("KV pool '{}': {} pages of {} ({:.1f} MiB)", set.pools[i].name, p.extra_pages[i - 1], set.pools[i].describe(),
             double(p.extra_pages[i - 1]) * double(set.pools[i].page.page_bytes()) / (1024.0 * 1024.0));
}

}  // namespace

actor_cluster::actor_cluster(std::shared_ptr<llama_model> model, actor_cluster_options opt)
    : opt_(std::move(opt)), st_(std::make_unique<state>()) {
  if (!model) throw tandem::error(error_kind::failed, "actor_cluster needs a model");
  auto& s = *st_;
  // The same plan `tandem check-config` prints (plan_node), so a checked config starts.
  s.plan = plan_node(opt_, shape_of(*model, opt_.eos_id), physical_ram_bytes());
  if (!s.plan.ok()) throw tandem::error(error_kind::failed, s.plan.error);
  const node_plan& plan = s.plan;
  const limits& lim = plan.spec.lim;
  // Fail on an unusable disk directory now, before any actor (and the worker's thread) exists.
  if (plan.disk_pages > 0)
    for (size_t p = 0; p < plan.pools.pools.size(); ++p)
      scan_page_files(plan.spec.cache.disk_dir, pool_file_fingerprint(plan.pools, p),
                      cache_disk_file_bytes(plan.pools.pools[p].page));

  s.clk = plan.spec.clock ? plan.spec.clock : std::make_shared<steady_cluster_clock>();
  auto sink = opt_.sink ? opt_.sink : make_stderr_sink(opt_.log_json);
  s.log = make_actor_logger("cluster", sink, opt_.log_level);
  s.start_ms = s.clk->now_ms();
  s.last_heartbeat_ms = s.start_ms;

  s.cfg.set("scheduler.max-threads", static_cast<size_t>(lim.scheduler_threads));
  s.cfg.add_message_type<wire>("tandem_wire");
  const bool multi_node = !plan.spec.remote_nodes.empty();
  if (multi_node) s.cfg.load<caf::io::middleman>();
  if (opt_.system && multi_node)
    throw tandem::error(error_kind::failed, "an actor system given in actor_cluster_options::system serves one "
                                            "process only; leave remote_nodes empty");
  s.sys = opt_.system ? decltype(s.sys)(opt_.system, system_release{false})
                      : decltype(s.sys)(new caf::actor_system(s.cfg), system_release{true});
  if (multi_node)
    s.links = link_nodes(*s.sys, plan.spec.node_name, plan.spec.cluster_host, plan.spec.cluster_port, role_names(plan.spec.roles),
                         plan.spec.remote_nodes, lim.link_timeout_ms, make_actor_logger("cluster", sink, opt_.log_level));

  s.model = std::move(model);
  s.sink = sink;
  spawn_set(s, opt_);
  supervisor_options sv;
  sv.node_name = plan.spec.node_name;
  sv.max_restarts = lim.supervisor_max_restarts;
  sv.period_ms = lim.supervisor_period_ms;
  sv.restart_all = [this] {
    auto& st = *st_;
    std::unique_lock<std::shared_mutex> sl(st.submit_mu);
    // The old set goes first: the router's state ends its in-flight requests with `disconnected`.
    for (auto* a : st.all())
      if (a->handle) caf::anon_send_exit(a->handle, caf::exit_reason::user_shutdown);
    spawn_set(st, opt_);
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
  log_plan(*s.log, plan, opt_);
}

int32_t actor_cluster::max_context() const { return st_->plan.model.max_context; }
int32_t actor_cluster::n_pages() const { return st_->plan.n_pages; }
const node_plan& actor_cluster::plan() const { return st_->plan; }

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
    if (s.has(node_role::router))
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
  if (!opt_.system) s.sys->await_all_actors_done();  // the owner of a given system runs it to the end
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
  if (!s.has(node_role::router)) {
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
  if (s.stopped || s.unhealthy || !s.has(node_role::router)) return;
  role_handle<router_role>(s.router).send_anon<msg::abort>([&](schema::Abort::Builder a) {
    a.setId(request_id);
    a.setStopString(why == finish_reason::stop);
    a.setChoice(choice);
  });
}


}  // namespace tandem
