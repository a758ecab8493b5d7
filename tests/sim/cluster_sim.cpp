#include "tests/sim/cluster_sim.h"

#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>

#include <algorithm>
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <cstdlib>
#include <deque>
#include <map>
#include <set>

#include "actors/cache_tier/cache_tier.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/common/wire.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/runtime/remote_link.h"
#include "actors/worker/worker.h"
#include "tests/actors/support.h"
#include "tests/sim/kv_fabric.h"

namespace tandem::sim {

namespace {

using flush_atom = caf::atom_constant<caf::atom("simflush")>;

class sim_clock final : public cluster_clock {
 public:
  explicit sim_clock(caf::detail::test_actor_clock& c) : c_(c) {}
  int64_t now_ms() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(c_.current_time.time_since_epoch()).count();
  }

 private:
  caf::detail::test_actor_clock& c_;
};

/// See sim.cpp: CAF 0.17's function actors taking nothing but `self` trip UBSan.
template <class Self, class F>
caf::actor spawn_fn(caf::actor_system& sys, F f) {
  return sys.spawn([f = std::move(f)](Self* self, int) mutable { return f(self); }, 0);
}

enum class role_kind { router, prefill, decode };

struct cnode {
  std::string name;
  role_kind role = role_kind::router;
  bool up = true;
  int32_t incarnation = 0;
  int32_t n_pages = 0;
  caf::actor ingress, dialer;
  bounded_actor sched, worker, cache;   ///< the router, or the prefill/decode scheduler and its worker and cache
  std::vector<bounded_actor> proxies;
  std::vector<bounded_actor*> gated() {
    std::vector<bounded_actor*> v;
    for (auto* a : {&sched, &worker, &cache})
      if (a->handle) v.push_back(a);
    for (auto& p : proxies) v.push_back(&p);
    return v;
  }
};

struct req_record {
  std::vector<int32_t> prompt;
  int32_t max_tokens = 0;
  std::vector<int32_t> tokens;
  int finished = 0;
  finish_reason reason = finish_reason::none;
  std::string error;
};

struct cworld;

/// One direction of the connection between two nodes (the middleman's stand-in).
struct link_state {
  cworld* w = nullptr;
  int32_t from = 0, to = 0;
  std::deque<std::pair<int64_t, std::vector<char>>> q;  ///< serialized messages, due time
  bool timer = false;
  static inline const char* name = "sim_link";
};
using link_actor_t = caf::stateful_actor<link_state>;

struct cworld : gate_fault {
  uint64_t seed;
  sim_rng rng;
  cluster_menu f;
  limits lim;
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::scheduler::test_coordinator* sched = nullptr;
  std::shared_ptr<sim_clock> clk;
  std::shared_ptr<spdlog::sinks::sink> sink = std::make_shared<spdlog::sinks::null_sink_mt>();
  std::shared_ptr<test::fake_model> model;
  kv_layout layout;
  std::unique_ptr<kv_fabric> fabric;
  std::vector<cnode> nodes;
  std::map<std::pair<int32_t, int32_t>, caf::actor> links;  ///< live link actors (from, to)
  std::map<std::pair<int32_t, int32_t>, int64_t> down_until;  ///< flapped links (min, max)
  int32_t faults = 0, restarts = 0;
  std::deque<std::string> trace;
  std::map<std::string, req_record> reqs;
  std::vector<std::string> violations;

  explicit cworld(uint64_t s) : seed(s), rng(s * 0x9E3779B97F4A7C15ull + 7) {}

  int64_t now() const { return clk->now_ms(); }
  void note(std::string s) {
    trace.push_back(fmt::format("t={} {}", now(), s));
    if (trace.size() > 80) trace.pop_front();
  }
  void violate(std::string s) {
    note("VIOLATION " + s);
    violations.push_back(std::move(s));
  }
  bool reject(const std::string& actor_name) override {
    if (!rng.chance(f.gate_reject)) return false;
    ++faults;
    note(fmt::format("fault: {} mailbox full", actor_name));
    return true;
  }
  std::shared_ptr<gate_fault> shared_self() { return std::shared_ptr<gate_fault>(std::shared_ptr<void>{}, this); }
  /// TANDEM_SIM_LOG=info|debug: the actors' logs on stderr (replaying one seed).
  std::shared_ptr<spdlog::logger> lg(const std::string& n) {
    static const char* level = std::getenv("TANDEM_SIM_LOG");
    if (!level) return make_actor_logger(n, sink, "off");
    static auto err = make_stderr_sink(false);
    return make_actor_logger(n, err, level);
  }

  // --- links
  bool link_ok(int32_t a, int32_t b) const {
    auto it = down_until.find({std::min(a, b), std::max(a, b)});
    return it == down_until.end() || now() >= it->second;
  }

  void flush(link_actor_t* self) {
    auto& s = self->state;
    while (!s.q.empty() && s.q.front().first <= now()) {
      // The receiving side of BASP: the bytes become a message again.
      caf::message m;
      caf::binary_deserializer src{*sys, s.q.front().second};
      if (auto err = src(m)) violate(fmt::format("link {}->{}: a message does not deserialize", s.from, s.to));
      s.q.pop_front();
      if (nodes[size_t(s.to)].up) caf::anon_send(nodes[size_t(s.to)].ingress, std::move(m));
    }
    if (!s.q.empty() && !s.timer) {
      s.timer = true;
      self->delayed_send(self, std::chrono::milliseconds(s.q.front().first - now()), flush_atom::value);
    }
  }

  caf::actor link(int32_t from, int32_t to) {
    auto& l = links[{from, to}];
    if (l) return l;
    l = spawn_fn<link_actor_t>(*sys, [this, from, to](link_actor_t* self) -> caf::behavior {
      self->state.w = this;
      self->state.from = from;
      self->state.to = to;
      return {
          [self](wire_atom, const std::string& role, const wire& w) {
            auto& s = self->state;
            auto* world = s.w;
            std::vector<char> buf;
            caf::binary_serializer sink{*world->sys, buf};
            auto m = caf::make_message(wire_atom::value, role, w);
            if (auto err = sink(m)) world->violate("a cross-node message does not serialize");
            int64_t due = world->now();
            if (world->rng.chance(world->f.link_delay)) due += world->rng.between(1, world->f.max_link_delay_ms);
            if (!s.q.empty()) due = std::max(due, s.q.back().first);  // TCP keeps the order
            s.q.emplace_back(due, std::move(buf));
            world->flush(self);
          },
          [self](flush_atom) {
            self->state.timer = false;
            self->state.w->flush(self);
          },
      };
    });
    return l;
  }

  /// A link's connection breaks: what it holds is lost, the proxies that use it hear `down`.
  void cut(int32_t from, int32_t to) {
    auto it = links.find({from, to});
    if (it == links.end()) return;
    caf::anon_send_exit(it->second, caf::exit_reason::remote_link_unreachable);
    links.erase(it);
  }

  /// The middleman's connect for node `from`: host is the target node's name.
  caf::actor spawn_dialer(int32_t from) {
    return spawn_fn<caf::event_based_actor>(*sys, [this, from](caf::event_based_actor*) -> caf::behavior {
      return {[this, from](caf::connect_atom, const std::string& host,
                           uint16_t) -> caf::result<caf::node_id, caf::strong_actor_ptr, std::set<std::string>> {
        int32_t to = -1;
        for (size_t i = 0; i < nodes.size(); ++i)
          if (nodes[i].name == host) to = int32_t(i);
        if (to < 0 || !nodes[size_t(to)].up || !nodes[size_t(from)].up || !link_ok(from, to))
          return caf::make_error(caf::sec::cannot_connect_to_node);
        const bool fresh = !links.count({from, to});
        auto l = link(from, to);
        if (fresh) note(fmt::format("link {}->{} redialled", nodes[size_t(from)].name, host));
        return {caf::node_id{}, caf::actor_cast<caf::strong_actor_ptr>(l), std::set<std::string>{}};
      }};
    });
  }

  remote_node remote(int32_t from, int32_t to, const std::string& role) {
    remote_node r;
    r.name = nodes[size_t(to)].name;
    r.host = r.name;
    r.cluster_port = 1000 + to;
    r.roles = {role};
    r.ingress = link(from, to);  // cut at once if the peer is not reachable (cut_unreachable)
    return r;
  }

  std::vector<int32_t> with(role_kind k) const {
    std::vector<int32_t> v;
    for (size_t i = 0; i < nodes.size(); ++i)
      if (nodes[i].role == k) v.push_back(int32_t(i));
    return v;
  }

  // --- nodes
  void spawn_node(int32_t i) {
    auto& n = nodes[size_t(i)];
    n.up = true;
    n.proxies.clear();
    n.dialer = spawn_dialer(i);
    const std::string role = n.role == role_kind::router ? "router" : n.role == role_kind::prefill ? "prefill" : "decode";
    n.ingress = spawn_ingress(*sys, n.name, {role}, lg("ingress"));
    auto proxy = [&](const std::string& r, std::vector<int32_t> to, bool notify_router, const std::string& name,
                     bool notify_local) {
      std::vector<remote_node> t;
      for (int32_t j : to) t.push_back(remote(i, j, r));
      auto p = spawn_remote_proxy(*sys, r, std::move(t), r == "router" ? lim.router_mailbox
                                                         : r == "prefill" ? lim.prefill_mailbox
                                                                          : lim.decode_mailbox,
                                  notify_router, lg("proxy"), name, notify_local, n.dialer);
      p.gate->set_fault(shared_self());
      n.proxies.push_back(p);
      return p;
    };
    if (n.role == role_kind::router) {
      std::vector<route_target> pre, dec;
      for (int32_t j : with(role_kind::prefill))
        pre.push_back({nodes[size_t(j)].name + "/prefill", proxy("prefill", {j}, true, nodes[size_t(j)].name + "/prefill", false)});
      for (int32_t j : with(role_kind::decode))
        dec.push_back({nodes[size_t(j)].name + "/decode", proxy("decode", {j}, true, nodes[size_t(j)].name + "/decode", false)});
      router_options ro;
      ro.lim = lim;
      ro.model = model_facts{-1, 512, 64};
      ro.tick_ms = 5;
      n.sched = spawn_router(*sys, ro, std::move(pre), std::move(dec), clk, lg("router"));
      n.sched.gate->set_fault(shared_self());
      peer_set peers{n.sched, {}, {}, {}, {}};
      for (auto& p : n.proxies) caf::anon_send(p.handle, peers_atom::value, peers);
      caf::anon_send(n.ingress, peers_atom::value, peers);
      cut_unreachable(i);
      return;
    }
    worker_options wo;
    wo.n_pages = n.n_pages;
    wo.page_size = lim.page_size;
    wo.mailbox_bound = lim.worker_mailbox;
    wo.detached = false;
    wo.pool_id = n.name + "/worker0";
    wo.kv_transfer = fabric->factory(n.name);
    n.worker = spawn_worker(*sys, model, wo, lg("worker"));
    n.worker.gate->set_fault(shared_self());
    cache_tier_options co;
    co.n_pages = n.n_pages;
    co.page_size = lim.page_size;
    co.prefix_cache = lim.prefix_cache && n.role == role_kind::prefill;
    co.mailbox_bound = lim.cache_tier_mailbox;
    co.layout = layout;
    n.cache = spawn_cache_tier(*sys, co, n.worker, lg("cache_tier"));
    n.cache.gate->set_fault(shared_self());
    scheduler_options so;
    so.lim = lim;
    so.lim.prefix_cache = co.prefix_cache;
    so.model = model_facts{-1, 512, 64};
    so.layout = layout;
    so.pool_id = wo.pool_id;
    so.node = n.name;
    so.transfer_failure_policy = f.failure_policy;
    auto router = proxy("router", with(role_kind::router), false, "", false);
    bounded_actor prefill, decode;
    if (n.role == role_kind::prefill) {
      so.remote_decode_node = nodes[size_t(with(role_kind::decode).front())].name;
      n.sched = spawn_prefill_scheduler(*sys, so, clk, lg("prefill"));
      prefill = n.sched;
      decode = proxy("decode", with(role_kind::decode), false, "", true);
    } else {
      n.sched = spawn_decode_scheduler(*sys, so, clk, lg("decode"));
      decode = n.sched;
      prefill = proxy("prefill", with(role_kind::prefill), false, "", true);
    }
    n.sched.gate->set_fault(shared_self());
    peer_set peers{router, prefill, decode, n.worker, n.cache};
    caf::anon_send(n.sched.handle, peers_atom::value, peers);
    for (auto& p : n.proxies) caf::anon_send(p.handle, peers_atom::value, peers);
    caf::anon_send(n.ingress, peers_atom::value, peers);
    cut_unreachable(i);
  }

  /// A (re)started node whose peer is down or cut off: its proxies hear `down` and redial (in
  /// production link_nodes would wait for the peer; the other nodes' proxies redial it).
  void cut_unreachable(int32_t i) {
    for (size_t j = 0; j < nodes.size(); ++j)
      if (int32_t(j) != i && (!nodes[j].up || !link_ok(i, int32_t(j)))) cut(i, int32_t(j));
  }

  void kill_node(int32_t i, const char* why, bool fault = true) {
    auto& n = nodes[size_t(i)];
    if (!n.up) return;
    if (fault) {
      ++faults;
      note(fmt::format("fault: node {} {}", n.name, why));
    }
    n.up = false;
    fabric->node_down(n.name);
    for (size_t j = 0; j < nodes.size(); ++j) {
      cut(i, int32_t(j));
      cut(int32_t(j), i);
    }
    for (auto* a : n.gated()) caf::anon_send_exit(a->handle, caf::exit_reason::kill);
    caf::anon_send_exit(n.ingress, caf::exit_reason::kill);
    caf::anon_send_exit(n.dialer, caf::exit_reason::kill);
    n.sched = n.worker = n.cache = bounded_actor{};
    n.proxies.clear();
  }

  void restart_node(int32_t i) {
    auto& n = nodes[size_t(i)];
    if (n.up) return;
    ++restarts;
    ++n.incarnation;
    note(fmt::format("node {} restarts", n.name));
    spawn_node(i);
  }

  void flap(int32_t a, int32_t b, int64_t ms) {
    ++faults;
    note(fmt::format("fault: link {}<->{} down for {} ms", nodes[size_t(a)].name, nodes[size_t(b)].name, ms));
    down_until[{std::min(a, b), std::max(a, b)}] = now() + ms;
    fabric->partition(nodes[size_t(a)].name, nodes[size_t(b)].name, now() + ms);  // the KV connection too
    cut(a, b);
    cut(b, a);
  }

  void start() {
    cfg.set("scheduler.policy", caf::atom("testing"));
    cfg.set("logger.verbosity", caf::atom("quiet"));
    cfg.set("logger.console", caf::atom("none"));
    cfg.add_message_type<wire>("tandem_wire");
    sys = std::make_unique<caf::actor_system>(cfg);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(sys->scheduler());
    sched->clock().current_time += std::chrono::hours(1);
    clk = std::make_shared<sim_clock>(sched->clock());
    model = std::make_shared<test::fake_model>();
    layout = model->layout(lim.page_size);
    kv_fault_menu kf;
    kf.drop = f.kv_drop;
    kf.delay = f.kv_delay;
    kf.max_delay_ms = f.kv_max_delay_ms;
    kf.duplicate = f.kv_duplicate;
    kf.corrupt = f.kv_corrupt;
    kf.put_fail = f.kv_put_fail;
    ucx::transfer_limits tl;
    tl.bootstrap_ms = rng.between(100, 1000);
    tl.waiting_ms = rng.between(200, 2000);
    tl.transferring_ms = rng.between(100, 1000);
    tl.quarantine_ms = rng.between(100, 1000);
    tl.max_transfers = size_t(rng.between(1, 8));
    fabric = std::make_unique<kv_fabric>(*clk, rng, kf, tl, [this](std::string s) { note(std::move(s)); });
    nodes.push_back({"r", role_kind::router});
    for (int i = 0; i < f.prefill_nodes; ++i) nodes.push_back({fmt::format("p{}", i), role_kind::prefill});
    for (int i = 0; i < f.decode_nodes; ++i) nodes.push_back({fmt::format("d{}", i), role_kind::decode});
    for (auto& n : nodes) n.n_pages = static_cast<int32_t>(rng.between(6, 32));
    for (size_t i = 0; i < nodes.size(); ++i) fabric->factory(nodes[i].name);  // stable peer ids
    for (size_t i = 0; i < nodes.size(); ++i) spawn_node(int32_t(i));
  }

  void submit(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens, int64_t deadline_in_ms) {
    auto& rec = reqs[id];
    rec.prompt = prompt;
    rec.max_tokens = max_tokens;
    event_callback cb = [this, id](token_event ev) { on_event(id, std::move(ev)); };
    note(fmt::format("submit {} ({} prompt tokens, max_tokens {})", id, prompt.size(), max_tokens));
    seq_request r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    if (deadline_in_ms > 0) r.deadline_ms = now() + deadline_in_ms;
    auto& router = nodes[0].sched;
    if (!router.gate->try_enter()) {
      cb(error_event(id, router.gate->overloaded_error()));
      return;
    }
    caf::anon_send(router.handle, submit_atom::value,
                   make_wire([&](schema::Envelope::Builder env) { r.write(env.initSubmit()); }),
                   callback_box{std::move(cb), id, static_cast<int32_t>(r.prompt.size())});
  }

  void on_event(const std::string& id, token_event ev) {
    auto& r = reqs[id];
    if (r.finished > 0) violate(fmt::format("request {}: event after its finished event", id));
    r.tokens.insert(r.tokens.end(), ev.tokens.begin(), ev.tokens.end());
    if (!ev.finished) return;
    r.finished += 1;
    r.reason = ev.reason;
    r.error = ev.err ? ev.err->what() : "";
    static const char* names[] = {"none", "stop", "length", "abort", "error"};
    note(fmt::format("finished {}: {} after {} tokens{}", id, names[int(ev.reason)], r.tokens.size(),
                     r.error.empty() ? "" : " (" + r.error.substr(0, 100) + ")"));
  }

  void step() {
    auto& jobs = sched->jobs;
    auto i = jobs.begin() + static_cast<std::ptrdiff_t>(rng.below(jobs.size()));
    std::rotate(jobs.begin(), i, i + 1);
    sched->run_once();
  }
  void drain() {
    for (int i = 0; i < 100000 && sched->has_job(); ++i) step();
  }
  std::optional<stats_snapshot> stats_of(const caf::actor& a) {
    auto out = std::make_shared<std::optional<stats_snapshot>>();
    spawn_fn<caf::event_based_actor>(*sys, [a, out](caf::event_based_actor* self) {
      self->request(a, caf::infinite, stats_atom::value).then([out](const wire& w) { *out = read_stats(w); });
    });
    drain();
    return *out;
  }
};

cluster_menu pick_menu(sim_rng& r) {
  cluster_menu f;
  f.prefill_nodes = static_cast<int32_t>(r.between(1, 2));
  f.decode_nodes = static_cast<int32_t>(r.between(1, 2));
  f.failure_policy = r.chance(0.7) ? "recompute" : "fail";
  f.max_time_step_ms = static_cast<int32_t>(r.between(1, 20));
  f.time_step = 0.05 + 0.2 * double(r.below(4)) / 4.0;
  // One run in eight is fault free (a baseline the others must match).
  if (r.below(8) == 0) return f;
  auto some = [&](double p) { return r.chance(0.6) ? p * double(r.between(1, 4)) / 4.0 : 0.0; };
  f.gate_reject = some(0.04);
  f.link_delay = some(0.4);
  f.max_link_delay_ms = static_cast<int32_t>(r.between(1, 40));
  f.node_losses = r.chance(0.35) ? static_cast<int32_t>(r.between(1, 2)) : 0;
  f.restart_lost = r.chance(0.5);
  f.link_flaps = r.chance(0.4) ? static_cast<int32_t>(r.between(1, 3)) : 0;
  f.max_flap_ms = static_cast<int32_t>(r.between(1, 400));
  f.kv_drop = some(0.1);
  f.kv_delay = some(0.3);
  f.kv_max_delay_ms = static_cast<int32_t>(r.between(1, 60));
  f.kv_duplicate = some(0.2);
  f.kv_corrupt = some(0.1);
  f.kv_put_fail = some(0.1);
  // TANDEM_SIM_OFF=reject,delay,loss,flap,kv: the same run without those faults (every choice is still drawn).
  if (const char* off = std::getenv("TANDEM_SIM_OFF")) {
    std::string o = off;
    auto has = [&](const char* k) { return o.find(k) != std::string::npos; };
    if (has("reject")) f.gate_reject = 0;
    if (has("delay")) f.link_delay = 0;
    if (has("loss")) f.node_losses = 0;
    if (has("flap")) f.link_flaps = 0;
    if (has("kv")) f.kv_drop = f.kv_delay = f.kv_duplicate = f.kv_corrupt = f.kv_put_fail = 0;
  }
  return f;
}

limits pick_limits(sim_rng& r) {
  limits l;
  l.page_size = 4;
  l.prefill_chunk_tokens = static_cast<int32_t>(r.between(2, 12));
  l.max_running_seqs = static_cast<int32_t>(r.between(1, 4));
  l.max_prefill_batch_seqs = static_cast<int32_t>(r.between(1, 3));
  l.max_queued_requests = static_cast<int32_t>(r.between(2, 8));
  l.max_inflight_requests = static_cast<int32_t>(r.between(3, 16));
  l.router_mailbox = static_cast<int32_t>(r.between(2, 16));
  l.prefill_mailbox = static_cast<int32_t>(r.between(2, 16));
  l.decode_mailbox = static_cast<int32_t>(r.between(2, 16));
  l.worker_mailbox = static_cast<int32_t>(r.between(2, 8));
  l.cache_tier_mailbox = static_cast<int32_t>(r.between(2, 16));
  l.prefix_cache = r.chance(0.5);
  l.request_timeout_ms = static_cast<int32_t>(r.between(300, 3000));
  l.max_new_tokens = 64;
  return l;
}

}  // namespace

sim_result run_cluster_seed(uint64_t seed, const cluster_menu* menu) {
  cworld w(seed);
  w.lim = pick_limits(w.rng);
  w.f = pick_menu(w.rng);
  if (menu) w.f = *menu;
  w.start();
  const auto& f = w.f;
  w.note(fmt::format("cluster seed {}: {} prefill, {} decode nodes, policy {}, chunk {}, running {}, prefix cache {}, "
                     "timeout {} ms; faults: reject {:.3f} link delay {:.2f}/{}ms losses {}{} flaps {}/{}ms kv drop "
                     "{:.2f} delay {:.2f}/{}ms dup {:.2f} corrupt {:.2f} put fail {:.2f}",
                     seed, f.prefill_nodes, f.decode_nodes, f.failure_policy, w.lim.prefill_chunk_tokens,
                     w.lim.max_running_seqs, w.lim.prefix_cache ? "on" : "off", w.lim.request_timeout_ms,
                     f.gate_reject, f.link_delay, f.max_link_delay_ms, f.node_losses,
                     f.restart_lost ? " (restarted)" : "", f.link_flaps, f.max_flap_ms, f.kv_drop, f.kv_delay,
                     f.kv_max_delay_ms, f.kv_duplicate, f.kv_corrupt, f.kv_put_fail));

  // The workload (as the one-node simulation's) and the faults' times within the busy period.
  struct arrival {
    int64_t at_ms;
    std::string id;
    std::vector<int32_t> prompt;
    int32_t max_tokens;
    int64_t deadline_in_ms;
  };
  std::vector<arrival> arrivals;
  const int n_req = static_cast<int>(w.rng.between(2, 10));
  std::vector<int32_t> shared;
  for (int i = 0, n = int(w.rng.between(1, 9)); i < n; ++i) shared.push_back(int32_t(w.rng.below(64)));
  const int64_t t0 = w.now();
  for (int i = 0; i < n_req; ++i) {
    arrival a;
    // Some arrive after the faults (to nodes that came back, over links that recovered).
    a.at_ms = t0 + (w.rng.chance(0.6) ? w.rng.between(0, 40) : w.rng.between(40, 800));
    a.id = fmt::format("r{}", i);
    if (w.rng.chance(0.5)) a.prompt = shared;
    for (int j = 0, n = int(w.rng.between(1, 10)); j < n; ++j) a.prompt.push_back(int32_t(w.rng.below(64)));
    a.max_tokens = static_cast<int32_t>(w.rng.between(1, 10));
    a.deadline_in_ms = w.rng.chance(0.2) ? w.rng.between(5, 300) : 0;
    arrivals.push_back(std::move(a));
  }
  std::stable_sort(arrivals.begin(), arrivals.end(), [](auto& a, auto& b) { return a.at_ms < b.at_ms; });
  struct fault_event {
    int64_t at_ms;
    int kind;  // 0 loss, 1 restart, 2 flap
    int32_t a, b;
    int64_t ms;
  };
  std::vector<fault_event> events;
  const int32_t n_nodes = int32_t(w.nodes.size());
  for (int i = 0; i < f.node_losses; ++i) {
    const int32_t victim = int32_t(w.rng.between(1, n_nodes - 1));  // never the router node
    const int64_t at = t0 + w.rng.between(0, 300);
    events.push_back({at, 0, victim, 0, 0});
    if (f.restart_lost) events.push_back({at + w.rng.between(20, 400), 1, victim, 0, 0});
  }
  for (int i = 0; i < f.link_flaps; ++i) {
    int32_t a = int32_t(w.rng.below(uint64_t(n_nodes))), b = int32_t(w.rng.below(uint64_t(n_nodes - 1)));
    if (b >= a) ++b;
    events.push_back({t0 + w.rng.between(0, 400), 2, a, b, w.rng.between(1, f.max_flap_ms)});
  }
  std::stable_sort(events.begin(), events.end(), [](auto& x, auto& y) { return x.at_ms < y.at_ms; });

  sim_result res;
  res.seed = seed;
  res.replay = fmt::format("TANDEM_SIM_CLUSTER_SEED={} build/dev/tests/test_sim -tc='sim cluster: replay*'   "
                           "(TANDEM_SIM_OFF=reject,delay,loss,flap,kv: the same run without those faults)",
                           seed);
  size_t next_arrival = 0, next_event = 0;
  const int64_t max_steps = 300000;
  const int64_t settle_ms = 5000;
  int64_t settle_until = -1, steps = 0;
  auto& sched = *w.sched;
  while (true) {
    if (++steps > max_steps) {
      w.violate(fmt::format("no quiescence after {} steps", max_steps));
      break;
    }
    while (next_arrival < arrivals.size() && arrivals[next_arrival].at_ms <= w.now()) {
      auto& a = arrivals[next_arrival++];
      w.submit(a.id, a.prompt, a.max_tokens, a.deadline_in_ms);
    }
    while (next_event < events.size() && events[next_event].at_ms <= w.now()) {
      auto& e = events[next_event++];
      if (e.kind == 0) w.kill_node(e.a, "is lost");
      if (e.kind == 1) w.restart_node(e.a);
      if (e.kind == 2) w.flap(e.a, e.b, e.ms);
    }
    if (sched.has_job()) {
      if (w.rng.chance(w.f.time_step))
        sched.advance_time(std::chrono::milliseconds(w.rng.between(1, w.f.max_time_step_ms)));
      w.step();
      continue;
    }
    int64_t next = INT64_MAX;
    if (next_arrival < arrivals.size()) next = arrivals[next_arrival].at_ms;
    if (next_event < events.size()) next = std::min(next, events[next_event].at_ms);
    if (next != INT64_MAX) {
      sched.advance_time(std::chrono::milliseconds(std::max<int64_t>(1, next - w.now())));
      continue;
    }
    bool all_done = true;
    for (const auto& a : arrivals) all_done = all_done && w.reqs[a.id].finished > 0;
    if (all_done && settle_until < 0) settle_until = w.now() + settle_ms;
    if (settle_until >= 0 && w.now() >= settle_until) {
      bool quiet = true;
      for (auto& n : w.nodes)
        for (auto* a : n.gated()) quiet = quiet && a->gate->depth() == 0;
      if (quiet || w.now() >= settle_until + 10 * settle_ms) break;
    }
    if (sched.has_pending_timeout()) {
      sched.trigger_timeout();
      continue;
    }
    break;
  }
  res.steps = steps;
  res.sim_ms = w.now() - t0;

  // --- invariants
  for (const auto& a : arrivals) {
    const auto& r = w.reqs[a.id];
    if (r.finished != 1) w.violate(fmt::format("request {}: {} finished events (want exactly 1)", a.id, r.finished));
    auto want = test::expected_greedy(a.prompt, a.max_tokens);
    if (r.reason == finish_reason::length && r.tokens != want)
      w.violate(fmt::format("request {}: completed output differs from the fault-free greedy output", a.id));
    if (r.tokens.size() > want.size() || !std::equal(r.tokens.begin(), r.tokens.end(), want.begin()))
      w.violate(fmt::format("request {}: streamed tokens are not a prefix of the greedy output", a.id));
    if (r.reason != finish_reason::length && r.reason != finish_reason::error)
      w.violate(fmt::format("request {}: unexpected finish reason {}", a.id, int(r.reason)));
    if (r.reason == finish_reason::length) ++res.completed;
    if (r.reason == finish_reason::error) ++res.errors;
  }
  for (auto& n : w.nodes) {
    if (!n.up) continue;
    if (n.cache.handle) {
      if (auto st = w.stats_of(n.cache.handle)) {
        const double free = st->value("kv_pages_free"), cached = st->value("kv_pages_evictable");
        if (free + cached != n.n_pages)
          w.violate(fmt::format("node {}: {} free + {} evictable of {} pages (leak)", n.name, free, cached, n.n_pages));
      } else {
        w.violate(fmt::format("node {}: the cache tier does not answer a stats query", n.name));
      }
    }
    for (auto* a : n.gated())
      if (a->gate->depth() != 0)
        w.violate(fmt::format("node {}: mailbox gate of {}: depth {} after quiescence (accounting leak)", n.name,
                              a->gate->actor_name(), a->gate->depth()));
  }
  for (const auto& s : w.fabric->in_flight()) w.violate("KV transfer left in flight: " + s);
  for (const auto& s : w.fabric->violations()) w.violate(s);

  // --- shutdown
  res.faults = w.faults + int32_t(w.fabric->faults());
  res.kv_transfers = w.fabric->transfers_done();
  for (size_t i = 0; i < w.nodes.size(); ++i) w.kill_node(int32_t(i), "shuts down", false);
  w.drain();
  w.sys->await_actors_before_shutdown(false);
  res.requests = n_req;
  res.restarts = w.restarts;
  res.violations = w.violations;
  res.trace.assign(w.trace.begin(), w.trace.end());
  w.sys.reset();
  return res;
}

}  // namespace tandem::sim
