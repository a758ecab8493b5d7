#include "tests/sim/world_base.h"

#include <algorithm>

#include "actors/common/protocol.h"
#include "actors/common/wire.h"
#include "actors/router/router.h"
#include "tests/actors/support.h"

namespace tandem::sim {

void world_base::note(std::string s) {
  trace.push_back(fmt::format("t={} {}", now(), s));
  if (trace.size() > trace_len_) trace.pop_front();
}

void world_base::violate(std::string s) {
  note("VIOLATION " + s);
  violations.push_back(std::move(s));
}

void world_base::on_event(const std::string& id, token_event ev) {
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

seq_request world_base::make_request(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens,
                                     int64_t deadline_in_ms) {
  auto& rec = reqs[id];
  rec.prompt = prompt;
  rec.max_tokens = max_tokens;
  note(fmt::format("submit {} ({} prompt tokens, max_tokens {})", id, prompt.size(), max_tokens));
  seq_request r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling.temperature = 0.0f;  // greedy: the output is known (expected_greedy)
  if (deadline_in_ms > 0) r.deadline_ms = now() + deadline_in_ms;
  return r;
}

void world_base::send_submit(const bounded_actor& router, const seq_request& r) {
  const std::string id = r.id;
  event_callback cb = [this, id](token_event ev) { on_event(id, std::move(ev)); };
  if (!router.gate->try_enter()) {
    cb(error_event(id, router.gate->overloaded_error()));
    return;
  }
  caf::anon_send(router.handle, submit_atom::value,
                 make_role_wire<router_role, msg::submit>([&](schema::SubmitRequest::Builder b) { r.write(b); }),
                 callback_box{std::move(cb), id, static_cast<int32_t>(r.prompt.size())});
}

node_plan sim_plan(const node_spec& spec, const llama_model& model) {
  node_plan p = plan_node(spec, shape_of(model, -1), 0);
  if (!p.ok()) throw tandem::error(error_kind::failed, "simulated node " + spec.node_name + ": " + p.error);
  return p;
}

void draw_limits(sim_rng& r, limits& l, int32_t timeout_min_ms) {
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
  l.request_timeout_ms = static_cast<int32_t>(r.between(timeout_min_ms, 3000));
}

void world_base::start_system() { start(); }

void world_base::step() {
  auto& jobs = sched->jobs;
  auto i = jobs.begin() + static_cast<std::ptrdiff_t>(rng.below(jobs.size()));
  std::rotate(jobs.begin(), i, i + 1);
  sched->run_once();
}

void world_base::drain() {
  for (int i = 0; i < 100000 && sched->has_job(); ++i) step();
}

std::optional<stats_snapshot> world_base::stats_of(const caf::actor& a) {
  auto out = std::make_shared<std::optional<stats_snapshot>>();
  spawn_fn<caf::event_based_actor>(*sys, [a, out](caf::event_based_actor* self) {
    self->request(a, caf::infinite, stats_atom::value).then([out](const wire& w) { *out = read_stats(w); });
  });
  drain();
  return *out;
}

std::vector<arrival> world_base::make_workload(const workload_shape& shape) {
  std::vector<arrival> arrivals;
  const int n_req = static_cast<int>(rng.between(shape.n_min, shape.n_max));
  std::vector<int32_t> shared;
  for (int i = 0, n = int(rng.between(1, 9)); i < n; ++i) shared.push_back(int32_t(rng.below(64)));
  const int64_t t0 = now();
  for (int i = 0; i < n_req; ++i) {
    arrival a;
    a.at_ms = t0 + (shape.early >= 1 || rng.chance(shape.early) ? rng.between(0, 40) : rng.between(40, shape.late_until_ms));
    a.id = fmt::format("r{}", i);
    if (rng.chance(0.5)) a.prompt = shared;
    for (int j = 0, n = int(rng.between(1, 10)); j < n; ++j) a.prompt.push_back(int32_t(rng.below(64)));
    a.max_tokens = static_cast<int32_t>(rng.between(1, 10));
    a.deadline_in_ms = rng.chance(shape.deadline) ? rng.between(5, 300) : 0;
    arrivals.push_back(std::move(a));
  }
  std::stable_sort(arrivals.begin(), arrivals.end(), [](auto& a, auto& b) { return a.at_ms < b.at_ms; });
  return arrivals;
}

void world_base::check_requests(const std::vector<arrival>& arrivals, sim_result& res) {
  for (const auto& a : arrivals) {
    const auto& r = reqs[a.id];
    if (r.finished != 1) violate(fmt::format("request {}: {} finished events (want exactly 1)", a.id, r.finished));
    auto want = test::expected_greedy(a.prompt, a.max_tokens);
    if (r.reason == finish_reason::length && r.tokens != want)
      violate(fmt::format("request {}: completed output differs from the fault-free greedy output", a.id));
    if (r.tokens.size() > want.size() || !std::equal(r.tokens.begin(), r.tokens.end(), want.begin()))
      violate(fmt::format("request {}: streamed tokens are not a prefix of the greedy output", a.id));
    if (r.reason != finish_reason::length && r.reason != finish_reason::error)
      violate(fmt::format("request {}: unexpected finish reason {}", a.id, int(r.reason)));
    if (r.reason == finish_reason::length) ++res.completed;
    if (r.reason == finish_reason::error) ++res.errors;
  }
}

void world_base::check_pages(const caf::actor& cache, int32_t n_pages, const std::string& where) {
  if (auto st = stats_of(cache)) {
    const double free = st->value("kv_pages_free"), cached = st->value("kv_pages_evictable");
    if (free + cached != n_pages)
      violate(fmt::format("{}: {} free + {} evictable of {} pages (leak)", where, free, cached, n_pages));
  } else {
    violate(fmt::format("{}: the cache tier does not answer a stats query", where));
  }
}

void world_base::check_gate(const mailbox_gate& g, int64_t slack, const std::string& where, bool depth) {
  if (depth && g.depth() != 0)
    violate(fmt::format("{}mailbox gate of {}: depth {} after quiescence (accounting leak)", where, g.actor_name(),
                        g.depth()));
  // Work-creating messages stop at the bound; control messages (frees, events, aborts of
  // admitted requests) may pass it: at most one event per token plus a few per request.
  if (g.high_water() > g.bound() + slack)
    violate(fmt::format("{}mailbox of {}: {} messages waiting, bound {} (+{} control)", where, g.actor_name(),
                        g.high_water(), g.bound(), slack));
}

}  // namespace tandem::sim
