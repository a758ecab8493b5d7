#include "tests/sim/sim.h"

#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "actors/cache_tier/cache_tier.h"
#include "actors/common/logging.h"
#include "actors/common/metrics.h"
#include "actors/common/request.h"
#include "actors/common/wire.h"
#include "actors/decode_scheduler/decode_scheduler.h"
#include "actors/prefill_scheduler/prefill_scheduler.h"
#include "actors/router/router.h"
#include "actors/runtime/node_plan_views.h"
#include "actors/supervisor/supervisor.h"
#include "actors/worker/worker.h"
#include "tests/actors/support.h"
#include "tests/sim/world_base.h"

namespace tandem::sim {

namespace {

using link_atom = caf::atom_constant<caf::atom("simlink")>;

struct world;

/// The fake model of tests/actors, failing a forward pass when the world says so.
class flaky_model final : public llama_model {
 public:
  explicit flaky_model(world& w) : w_(w) {}
  const model_config& config() const override { return inner_.config(); }
  kv_layout layout(int32_t page_size) const override { return inner_.layout(page_size); }
  void forward(std::span<const batch_seq> batch, kv_pools& pools, std::vector<float>& logits) override;

 private:
  world& w_;
  test::fake_model inner_;
};

/// One link between two roles: everything a role sends to another goes through its link
/// actor, which delivers it (keeping the link's order), delays, drops or duplicates it.
struct link_state {
  struct held {
    int64_t due_ms;
    caf::response_promise rp;
    caf::message msg;
    bool copy = false;  ///< a duplicate (sent as the link's own message)
  };
  world* w = nullptr;
  std::string link_name;
  caf::actor dest;
  std::shared_ptr<mailbox_gate> gate;
  bool cross_node = false;
  std::deque<held> q;
  bool timer = false;
  static inline const char* name = "sim_link";
};
using link_actor_t = caf::stateful_actor<link_state>;

/// One actor set (replaced whole on every restart) and its links.
struct actor_set {
  bounded_actor router, prefill, decode, worker, cache;
  std::vector<caf::actor> links;
};

struct world : gate_fault, world_base {
  uint64_t seed;
  fault_menu f;
  limits lim;
  std::shared_ptr<flaky_model> model;
  int32_t n_pages = 0;
  actor_set cur;
  caf::actor supervisor;
  bool escalated = false;
  int32_t restarts = 0;
  int32_t faults = 0;
  int64_t copies = 0;  ///< duplicates the links delivered

  explicit world(uint64_t s) : world_base(s * 0x2545F4914F6CDD1Dull + 1, 60), seed(s) {}

  bool reject(const std::string& actor_name) override {
    if (!rng.chance(f.gate_reject)) return false;
    if (!f.reject_only.empty() && f.reject_only != actor_name) return false;
    ++faults;
    note(fmt::format("fault: {} mailbox full", actor_name));
    return true;
  }

  /// What the link may do to this message: a loss or a second copy only on cross-node links,
  /// and only where the protocol survives it (see docs/architecture.md, "Deterministic simulation").
  struct kind_info {
    std::string what;
    bool droppable = false, duplicable = false;
  };
  static kind_info classify(const caf::message& m) {
    kind_info k;
    if (m.match_elements<call_atom, wire>()) {
      k.what = "call";
      return k;
    }
    if (m.match_elements<submit_atom, wire, callback_box>()) {
      k.what = "submit";
      return k;
    }
    if (!m.match_elements<wire_atom, wire>()) {
      k.what = "other";
      return k;
    }
    try {
      wire_reader rd(m.get_as<wire>(1));
      auto env = rd.root();
      k = {"wire", false, false};
      // Loss: the router's deadline ends the request. Copies: the receiver ignores an id it holds.
      const kind_info submit{"Submit", true, true}, abort{"Abort", true, true};  // an aborted request ends anyway
      const kind_info requeue{"Requeue", true, true};  // its pages were freed before
      if (env.isPrefill()) {
        auto p = env.getPrefill();
        if (p.isSubmit()) k = submit;
        else if (p.isAbort()) k = abort;
        else if (p.isRequeue()) k = requeue;
      } else if (env.isDecode()) {
        auto d = env.getDecode();
        if (d.isSubmit()) k = submit;
        else if (d.isAbort()) k = abort;
        // A lost handoff would lose the page ownership it carries (the cross-node transfer
        // protocol, transport/ucx/transfer_state, owns that case); a copy is ignored by the decode
        // scheduler.
        else if (d.isHandoff()) k = {"Handoff", false, true};
      } else if (env.isRouter()) {
        auto r = env.getRouter();
        if (r.isAbort()) k = abort;
        else if (r.isRequeue()) k = requeue;
        // The router orders events by firstIndex, drops copies, and holds back after a gap.
        else if (r.isEvent()) k = {"Event", true, true};
      } else if (env.isCacheTier()) {
        auto c = env.getCacheTier();
        if (c.isFree()) k = {"Free", false, false};
        else if (c.isInsert()) k = {"Insert", false, false};
      }
    } catch (const std::exception&) {
      k.what = "malformed";
    }
    return k;
  }

  void deliver(link_actor_t* self, link_state::held& h) {
    if (h.copy)
      self->send(self->state.dest, std::move(h.msg));  // nobody waits for a copy's answer
    else
      h.rp.delegate(self->state.dest, std::move(h.msg));
  }

  void flush(link_actor_t* self) {
    auto& s = self->state;
    while (!s.q.empty() && s.q.front().due_ms <= now()) {
      deliver(self, s.q.front());
      s.q.pop_front();
    }
    if (!s.q.empty() && !s.timer) {
      s.timer = true;
      self->delayed_send(self, std::chrono::milliseconds(s.q.front().due_ms - now()), link_atom::value);
    }
  }

  caf::result<caf::message> on_link(link_actor_t* self, caf::message msg) {
    auto& s = self->state;
    auto rp = self->make_response_promise();
    auto k = classify(msg);
    if (s.cross_node && k.droppable && rng.chance(f.drop)) {
      ++faults;
      note(fmt::format("fault: {} lost on {}", k.what, s.link_name));
      s.gate->leave();  // it never reaches the mailbox it was counted into
      return rp;
    }
    const bool twice = s.cross_node && k.duplicable && rng.chance(f.duplicate);
    int64_t due = now();
    // In one process CAF enqueues at send time, so local links keep causal order (an Insert the
    // prefill sent before its handoff reaches the cache tier before the decode's Free): only a
    // cross-node link may hold a message back.
    if (s.cross_node && rng.chance(f.delay)) {
      due += rng.between(1, std::max(1, f.max_delay_ms));
      ++faults;
      note(fmt::format("fault: {} delayed to t={} on {}", k.what, due, s.link_name));
    }
    if (!s.q.empty()) due = std::max(due, s.q.back().due_ms);
    std::optional<caf::message> copy;
    if (twice) {
      // A retransmission: the copy follows the original on the link (the link keeps its order).
      ++faults;
      note(fmt::format("fault: {} duplicated on {}", k.what, s.link_name));
      s.gate->enter_control();
      ++copies;
      copy = msg;
    }
    if (due <= now() && s.q.empty()) {
      rp.delegate(s.dest, std::move(msg));
      if (copy) self->send(s.dest, std::move(*copy));
      return rp;
    }
    s.q.push_back({due, rp, std::move(msg), false});
    if (copy) s.q.push_back({due, caf::response_promise{}, std::move(*copy), true});
    flush(self);
    return rp;
  }

  caf::actor spawn_link(std::string name, const bounded_actor& dest, bool cross_node) {
    auto h = spawn_fn<link_actor_t>(*sys, [this, name, dest, cross_node](link_actor_t* self) -> caf::behavior {
      auto& s = self->state;
      s.w = this;
      s.link_name = name;
      s.dest = dest.handle;
      s.gate = dest.gate;
      s.cross_node = cross_node;
      self->set_default_handler([self](caf::scheduled_actor*, caf::message_view& x) -> caf::result<caf::message> {
        return self->state.w->on_link(self, x.move_content_to_message());
      });
      return {[self](link_atom) {
        self->state.timer = false;
        self->state.w->flush(self);
      }};
    });
    cur.links.push_back(h);
    return h;
  }
  bounded_actor via(std::string name, const bounded_actor& dest, bool cross_node) {
    return bounded_actor{spawn_link(std::move(name), dest, cross_node), dest.gate};
  }

  void spawn_set() {
    cur = actor_set{};
    auto lg = [&](const char* n) { return make_actor_logger(n, sink, "off"); };
    // The options serve would plan for one node with these limits (its sizes: the drawn
    // limits.device_pages and page_size).
    node_spec spec;
    spec.lim = lim;
    const node_plan plan = sim_plan(spec, *model);
    worker_options wo = worker_options_of(plan);
    wo.detached = false;
    cur.worker = spawn_worker(*sys, model, wo, lg("worker"));
    cur.worker.gate->set_fault(shared_self());

    const cache_tier_options co = cache_tier_options_of(plan);
    cur.cache = spawn_cache_tier(*sys, co, via("cache->worker", cur.worker, false), lg("cache_tier"));
    cur.cache.gate->set_fault(shared_self());

    scheduler_options so = scheduler_options_of(plan);
    // Links stand between the schedulers as if they ran on two nodes: the prefill does not
    // pause for a decode backlog on a shared worker.
    so.shares_worker = false;
    cur.prefill = spawn_prefill_scheduler(*sys, so, clk, lg("prefill"));
    cur.prefill.gate->set_fault(shared_self());
    cur.decode = spawn_decode_scheduler(*sys, so, clk, lg("decode"));
    cur.decode.gate->set_fault(shared_self());

    const router_options ro = router_options_of(plan);
    cur.router = spawn_router(*sys, ro, via("router->prefill", cur.prefill, true), clk, lg("router"));
    cur.router.gate->set_fault(shared_self());

    // In a disaggregated deployment router, prefill and decode may sit on different nodes;
    // worker and cache tier are always local to their scheduler.
    peer_set pp{via("prefill->router", cur.router, true), cur.prefill, via("prefill->decode", cur.decode, true),
                via("prefill->worker", cur.worker, false), via("prefill->cache", cur.cache, false)};
    peer_set dp{via("decode->router", cur.router, true), via("decode->prefill", cur.prefill, true), cur.decode,
                via("decode->worker", cur.worker, false), via("decode->cache", cur.cache, false)};
    caf::anon_send(cur.prefill.handle, peers_atom::value, pp);
    caf::anon_send(cur.decode.handle, peers_atom::value, dp);
  }

  std::vector<supervised_child> children() const {
    return {{"router", cur.router.handle},
            {"prefill", cur.prefill.handle},
            {"decode", cur.decode.handle},
            {"worker", cur.worker.handle},
            {"cache_tier", cur.cache.handle}};
  }

  void kill_set(const actor_set& s) {
    for (auto* a : {&s.router, &s.prefill, &s.decode, &s.worker, &s.cache})
      if (a->handle) caf::anon_send_exit(a->handle, caf::exit_reason::user_shutdown);
    for (const auto& l : s.links) caf::anon_send_exit(l, caf::exit_reason::user_shutdown);
  }

  std::shared_ptr<gate_fault> shared_self() {
    // The world outlives every actor (it shuts the system down first): a non-owning pointer.
    return std::shared_ptr<gate_fault>(std::shared_ptr<void>{}, this);
  }

  void start() {
    start_system();
    model = std::make_shared<flaky_model>(*this);
    n_pages = lim.device_pages;
    spawn_set();
    supervisor_options sv;
    sv.max_restarts = lim.supervisor_max_restarts;
    sv.period_ms = lim.supervisor_period_ms;
    sv.restart_all = [this] {
      ++restarts;
      note("supervisor: restart of the actor set");
      kill_set(cur);
      spawn_set();
      return children();
    };
    sv.escalate = [this](const std::string& why) {
      escalated = true;
      note("supervisor: escalated: " + why);
    };
    supervisor = spawn_supervisor(*sys, sv, children(), clk, make_actor_logger("supervisor", sink, "off"));
  }

  void submit(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens, int64_t deadline_in_ms) {
    seq_request r = make_request(id, std::move(prompt), max_tokens, deadline_in_ms);
    if (escalated) return on_event(id, error_event(id, tandem::error(error_kind::disconnected, "node escalated")));
    send_submit(cur.router, r);
  }

  void crash_one() {
    static const char* roles[] = {"router", "prefill", "decode", "worker", "cache_tier"};
    const auto* role = roles[rng.below(5)];
    for (const auto& c : children()) {
      if (c.name != role) continue;
      ++faults;
      note(fmt::format("fault: {} crashes", role));
      c.handle->enqueue(nullptr, caf::make_message_id(),
                        caf::make_message(caf::exit_msg{c.handle->address(),
                                                        caf::make_error(caf::sec::runtime_error, "sim crash")}),
                        nullptr);
    }
  }

  /// Runs one job chosen by the RNG (any actor with mail may go next).
};

void flaky_model::forward(std::span<const batch_seq> batch, kv_pools& pool, std::vector<float>& logits) {
  if (w_.rng.chance(w_.f.forward_fail)) {
    ++w_.faults;
    w_.note(fmt::format("fault: forward pass of {} sequence(s) fails", batch.size()));
    throw tandem::error(error_kind::failed, "sim: injected forward failure");
  }
  inner_.forward(batch, pool, logits);
}

fault_menu pick_faults(sim_rng& r) {
  fault_menu f;
  // One run in eight is fault free (a baseline the others must match).
  if (r.below(8) == 0) return f;
  auto some = [&](double p) { return r.chance(0.6) ? p * double(r.between(1, 4)) / 4.0 : 0.0; };
  f.gate_reject = some(0.05);
  f.delay = some(0.3);
  f.max_delay_ms = static_cast<int32_t>(r.between(1, 50));
  f.drop = some(0.2);
  f.duplicate = some(0.3);
  f.forward_fail = some(0.05);
  f.crashes = r.chance(0.3) ? static_cast<int32_t>(r.between(1, 3)) : 0;
  f.time_step = some(0.2);
  f.max_time_step_ms = static_cast<int32_t>(r.between(1, 30));
  // TANDEM_SIM_OFF=reject,delay,drop,dup,forward,crash,time: the same run without those faults
  // (every random choice is still drawn), to find which fault a failure needs.
  if (const char* off = std::getenv("TANDEM_SIM_OFF")) {
    std::string o = off;
    auto has = [&](const char* k) { return o.find(k) != std::string::npos; };
    if (has("reject")) f.gate_reject = 0;
    if (has("delay")) f.delay = 0;
    if (has("drop")) f.drop = 0;
    if (has("dup")) f.duplicate = 0;
    if (has("forward")) f.forward_fail = 0;
    if (has("time")) f.time_step = 0;
    if (has("crash")) f.crashes = 0;
  }
  return f;
}

limits pick_limits(sim_rng& r) {
  limits l;
  l.page_size = 4;
  l.device_pages = static_cast<int32_t>(r.between(6, 32));
  draw_limits(r, l, 200);
  l.supervisor_max_restarts = static_cast<int32_t>(r.between(1, 3));
  l.supervisor_period_ms = 60000;
  l.max_new_tokens = 64;
  return l;
}

}  // namespace

std::string sim_result::report() const {
  std::string out = fmt::format(
      "simulation seed {} failed ({} steps, {} simulated ms, {} requests, {} faults, {} restarts)\n"
      "replay: {}\n",
      seed, steps, sim_ms, requests, faults, restarts,
      !replay.empty() ? replay
                      : fmt::format("TANDEM_SIM_SEED={} build/dev/tests/test_sim -tc='sim: replay*'   (TANDEM_SIM_OFF="
                                    "reject,delay,drop,dup,forward,crash,time: the same run without those faults)",
                                    seed));
  for (const auto& v : violations) out += "  violation: " + v + "\n";
  out += "  last events:\n";
  for (const auto& t : trace) out += "    " + t + "\n";
  return out;
}

sim_result run_seed(uint64_t seed, const fault_menu* menu) {
  world w(seed);
  w.lim = pick_limits(w.rng);
  w.f = pick_faults(w.rng);
  if (menu) w.f = *menu;
  w.start();
  w.note(fmt::format("seed {}: {} pages, chunk {}, running {}, prefix cache {}, timeout {} ms; faults: reject {:.3f} "
                     "delay {:.2f}/{}ms drop {:.2f} dup {:.2f} forward {:.3f} crashes {} time {:.2f}/{}ms",
                     seed, w.lim.device_pages, w.lim.prefill_chunk_tokens, w.lim.max_running_seqs,
                     w.lim.prefix_cache ? "on" : "off", w.lim.request_timeout_ms, w.f.gate_reject, w.f.delay,
                     w.f.max_delay_ms, w.f.drop, w.f.duplicate, w.f.forward_fail, w.f.crashes, w.f.time_step,
                     w.f.max_time_step_ms));

  // The workload: a few requests arriving over the first ~40 simulated ms; some share a prefix.
  const int64_t t0 = w.now();
  const std::vector<arrival> arrivals = w.make_workload(workload_shape{2, 7, 1, 0, 0.3});
  const int n_req = static_cast<int>(arrivals.size());
  // Crashes at random simulated times within the busy period.
  std::vector<int64_t> crash_at;
  for (int i = 0; i < w.f.crashes; ++i) crash_at.push_back(t0 + w.rng.between(0, 120));
  std::sort(crash_at.begin(), crash_at.end());

  sim_result res;
  res.seed = seed;
  size_t next_arrival = 0, next_crash = 0;
  const int64_t max_steps = 400000;
  const int64_t settle_ms = 5000;  // simulated: several heartbeats and retry backoffs
  int64_t settle_until = -1;
  int64_t steps = 0;
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
    while (next_crash < crash_at.size() && crash_at[next_crash] <= w.now()) {
      ++next_crash;
      w.crash_one();
    }
    if (sched.has_job()) {
      if (w.rng.chance(w.f.time_step)) sched.advance_time(std::chrono::milliseconds(w.rng.between(1, w.f.max_time_step_ms)));
      w.step();
      continue;
    }
    int64_t next_event = INT64_MAX;
    if (next_arrival < arrivals.size()) next_event = arrivals[next_arrival].at_ms;
    if (next_crash < crash_at.size()) next_event = std::min(next_event, crash_at[next_crash]);
    if (next_event != INT64_MAX) {
      // Timeouts due before the next arrival fire on the way there.
      sched.advance_time(std::chrono::milliseconds(std::max<int64_t>(1, next_event - w.now())));
      continue;
    }
    // Periodic timers (the router's heartbeat and deadline ticks) never stop, so once every
    // request has its finished event the run settles for a bounded simulated time (frees and
    // late copies land, heartbeats run) and then ends.
    bool all_done = true;
    for (const auto& a : arrivals) all_done = all_done && w.reqs[a.id].finished > 0;
    if (all_done && settle_until < 0) settle_until = w.now() + settle_ms;
    if (settle_until >= 0 && w.now() >= settle_until) {
      // End at a quiet point: no message (a delayed link copy, a heartbeat) inside a gate.
      bool quiet = true;
      for (auto* a : {&w.cur.router, &w.cur.prefill, &w.cur.decode, &w.cur.worker, &w.cur.cache})
        quiet = quiet && (!a->gate || a->gate->depth() == 0);
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
  w.check_requests(arrivals, res);
  if (!w.escalated) w.check_pages(w.cur.cache.handle, w.n_pages, "device pool");
  // Control messages may pass a bound: at most one event per token plus a few per request and
  // per preemption, and the copies a link made.
  int64_t slack = w.copies;
  for (const auto& a : arrivals) slack += a.max_tokens + 6;
  for (auto* a : {&w.cur.router, &w.cur.prefill, &w.cur.decode, &w.cur.worker, &w.cur.cache})
    w.check_gate(*a->gate, slack, "", !w.escalated);

  // --- shutdown: stop the supervisor first so the exits are not failures
  caf::anon_send_exit(w.supervisor, caf::exit_reason::user_shutdown);
  w.kill_set(w.cur);
  w.drain();
  w.sys->await_actors_before_shutdown(false);
  res.requests = n_req;
  res.restarts = w.restarts;
  res.faults = w.faults;
  res.violations = w.violations;
  res.trace.assign(w.trace.begin(), w.trace.end());
  w.sys.reset();
  return res;
}

}  // namespace tandem::sim
