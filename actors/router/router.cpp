#include "actors/router/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <map>
#include <optional>
#include <unordered_map>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

token_event error_event(const std::string& request_id, const tandem::error& e, int32_t prompt_tokens) {
  token_event ev;
  ev.request_id = request_id;
  ev.finished = true;
  ev.reason = finish_reason::error;
  ev.err = e;
  ev.prompt_tokens = prompt_tokens;
  return ev;
}

struct callback_box::guard {
  event_callback cb;
  std::string id;
  int32_t prompt_tokens = 0;
  bool taken = false;
  ~guard() {
    if (taken || !cb) return;
    try {
      cb(error_event(id,
                     tandem::error(error_kind::disconnected,
                                   "the router failed before it read the request; retry it"),
                     prompt_tokens));
    } catch (...) {  // a destructor must not throw; the callback's failure has nowhere to go
    }
  }
};

callback_box::callback_box(event_callback cb, std::string request_id, int32_t prompt_tokens)
    : g_(std::make_shared<guard>()) {
  g_->cb = std::move(cb);
  g_->id = std::move(request_id);
  g_->prompt_tokens = prompt_tokens;
}

event_callback callback_box::take() const {
  if (!g_ || g_->taken) return {};
  g_->taken = true;
  return std::move(g_->cb);
}

namespace {

/// One stage event, read off the wire (kept while an earlier one is missing).
struct stage_event {
  std::vector<int32_t> tokens;
  bool finished = false;
  finish_reason reason = finish_reason::none;
  std::optional<tandem::error> err;
};

struct entry {
  event_callback cb;
  int64_t submit_ms = 0;
  int64_t first_token_ms = -1;
  int64_t last_token_ms = -1;
  int64_t deadline_ms = 0;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  std::string state = "queued";
  /// Events that overtook an earlier one, by completion index (at most max_new_tokens + 1).
  std::map<int32_t, stage_event> early;
};

struct router_state {
  router_options opt;
  bounded_actor prefill;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::unordered_map<std::string, entry> table;
  uint64_t next_order = 1;
  bool tick_pending = false;
  bool stopped = false;
  int64_t requests_total = 0, tokens_generated = 0, prompt_tokens_total = 0;
  std::unordered_map<std::string, int64_t> finished_by_reason;
  std::unordered_map<std::string, int64_t> rejected_by_reason;
  histogram ttft{"ttft_ms", "Time to first token (ms)", histogram::latency_ms_buckets()};
  histogram tpot{"tpot_ms", "Time per output token after the first (ms)", histogram::latency_ms_buckets()};
  histogram e2e{"e2e_ms", "Request latency from submit to finish (ms)", histogram::latency_ms_buckets()};
  static inline const char* name = "router";

  static void deliver(const event_callback& cb, token_event ev, spdlog::logger& log) {
    try {
      if (cb) cb(std::move(ev));
    } catch (const std::exception& e) {
      log.error("request {}: event callback threw: {}", ev.request_id, e.what());
    }
  }

  void reject(const std::string& id, const event_callback& cb, const tandem::error& e,
              const std::string& reason, int32_t prompt_tokens) {
    rejected_by_reason[reason] += 1;
    finished_by_reason["error"] += 1;
    log->info("request {}: rejected ({}): {}", id, reason, e.what());
    deliver(cb, error_event(id, e, prompt_tokens), *log);
  }

  /// Ends an in-flight request with a final event it did not get from a stage.
  void finish_here(const std::string& id, finish_reason reason, const tandem::error* err) {
    auto it = table.find(id);
    if (it == table.end()) return;
    token_event ev;
    ev.request_id = id;
    ev.finished = true;
    ev.reason = reason;
    if (err) ev.err = *err;
    ev.prompt_tokens = it->second.prompt_tokens;
    ev.completion_tokens = it->second.completion_tokens;
    ev.cached_tokens = it->second.cached_tokens;
    account_finish(it->second, reason);
    auto cb = std::move(it->second.cb);
    table.erase(it);
    deliver(cb, std::move(ev), *log);
  }

  /// A router that exits with requests in flight (a failure, or the supervisor restarting the
  /// node's actors) ends each with `disconnected`, so no client waits for events that never come.
  ~router_state() {
    if (table.empty()) return;
    tandem::error err(error_kind::disconnected,
                      "the node's actors failed and were restarted before the request finished; retry it");
    std::vector<std::string> ids;
    for (const auto& kv : table) ids.push_back(kv.first);
    for (const auto& id : ids) finish_here(id, finish_reason::error, &err);
  }

  void account_finish(const entry& e, finish_reason reason) {
    static const char* names[] = {"none", "stop", "length", "abort", "error"};
    finished_by_reason[names[static_cast<int>(reason)]] += 1;
    int64_t now = clk->now_ms();
    e2e.observe(double(now - e.submit_ms));
    if (e.completion_tokens > 1 && e.first_token_ms >= 0)
      tpot.observe(double(e.last_token_ms - e.first_token_ms) / double(e.completion_tokens - 1));
  }

  std::string validate(const seq_request& r) const {
    const auto& m = opt.model;
    if (r.id.empty()) return "request_id is empty; the front end must set a unique id";
    if (r.prompt.empty())
      return fmt::format("request {}: the prompt has no tokens; send at least one token", r.id);
    for (auto t : r.prompt)
      if (t < 0 || t >= m.n_vocab)
        return fmt::format("request {}: prompt token id {} is outside the vocabulary [0, {})", r.id, t,
                           m.n_vocab);
    if (m.max_context > 0 && static_cast<int32_t>(r.prompt.size()) >= m.max_context)
      return fmt::format("request {}: prompt of {} tokens does not fit the context of {} tokens; shorten it",
                         r.id, r.prompt.size(), m.max_context);
    if (r.max_tokens <= 0 || r.max_tokens > opt.lim.max_new_tokens)
      return fmt::format("request {}: max_tokens = {} must be in [1, {}] (limits.max_new_tokens)", r.id,
                         r.max_tokens, opt.lim.max_new_tokens);
    auto sv = r.sampling.validate();
    if (!sv.empty()) return fmt::format("request {}: {}", r.id, sv);
    return "";
  }
};

using router_actor_t = caf::stateful_actor<router_state>;

void schedule_tick(router_actor_t* self) {
  auto& s = self->state;
  if (s.tick_pending || s.table.empty()) return;
  s.tick_pending = true;
  self->delayed_send(self, std::chrono::milliseconds(s.opt.tick_ms), tick_atom::value);
}

void on_submit(router_actor_t* self, const wire& w, event_callback cb) {
  auto& s = self->state;
  seq_request r;
  try {
    wire_reader rd(w);
    r = seq_request::read(rd.root().getSubmit());
  } catch (const tandem::error& e) {
    s.reject("?", cb, e, "malformed", 0);
    return;
  }
  const auto prompt_len = static_cast<int32_t>(r.prompt.size());
  if (s.stopped) {
    s.reject(r.id, cb,
             tandem::error(error_kind::disconnected, "the cluster is shutting down; retry on another node"),
             "shutdown", prompt_len);
    return;
  }
  auto bad = s.validate(r);
  if (!bad.empty()) {
    s.reject(r.id, cb, tandem::error(error_kind::failed, bad), "invalid", prompt_len);
    return;
  }
  if (s.table.count(r.id)) {
    s.reject(r.id, cb,
             tandem::error(error_kind::failed,
                           fmt::format("request id {} is already in flight; use unique ids", r.id)),
             "duplicate_id", prompt_len);
    return;
  }
  if (static_cast<int32_t>(s.table.size()) >= s.opt.lim.max_inflight_requests) {
    s.reject(r.id, cb,
             tandem::error(
                 error_kind::overloaded,
                 fmt::format("router in-flight table is full ({} requests, limits.max_inflight_requests); "
                             "retry later",
                             s.table.size())),
             "inflight_full", prompt_len);
    return;
  }
  const int64_t now = s.clk->now_ms();
  const int64_t def = now + s.opt.lim.request_timeout_ms;
  r.deadline_ms = r.deadline_ms > 0 ? std::min(r.deadline_ms, def) : def;
  r.admit_order = s.next_order++;
  if (!s.prefill.gate->try_enter()) {
    s.reject(r.id, cb, s.prefill.gate->overloaded_error(), "prefill_mailbox", prompt_len);
    return;
  }
  entry e;
  e.cb = std::move(cb);
  e.submit_ms = now;
  e.deadline_ms = r.deadline_ms;
  e.prompt_tokens = prompt_len;
  s.table.emplace(r.id, std::move(e));
  s.requests_total += 1;
  s.prompt_tokens_total += prompt_len;
  s.log->debug("request {}: accepted ({} prompt tokens, max_tokens {}, deadline in {} ms)", r.id, prompt_len,
               r.max_tokens, r.deadline_ms - now);
  self->send(s.prefill.handle, wire_atom::value,
             make_wire([&](schema::Envelope::Builder env) { r.write(env.initSubmit()); }));
  schedule_tick(self);
}

/// Delivers `ev`, whose tokens start at completion index `first`, trimming tokens delivered
/// already (a duplicate). Returns true if the request ended.
bool deliver_in_order(router_state& s, std::unordered_map<std::string, entry>::iterator it, int32_t first,
                      stage_event ev) {
  auto& e = it->second;
  const auto skip = static_cast<size_t>(std::max(0, e.completion_tokens - first));
  if (skip >= ev.tokens.size()) ev.tokens.clear();
  else ev.tokens.erase(ev.tokens.begin(), ev.tokens.begin() + static_cast<std::ptrdiff_t>(skip));
  const int64_t now = s.clk->now_ms();
  if (!ev.tokens.empty()) {
    if (e.first_token_ms < 0) {
      e.first_token_ms = now;
      s.ttft.observe(double(now - e.submit_ms));
    }
    e.last_token_ms = now;
    e.completion_tokens += static_cast<int32_t>(ev.tokens.size());
    s.tokens_generated += static_cast<int64_t>(ev.tokens.size());
  }
  if (ev.tokens.empty() && !ev.finished) return false;  // a duplicate
  token_event out;
  out.request_id = it->first;
  out.tokens = std::move(ev.tokens);
  out.finished = ev.finished;
  out.reason = ev.reason;
  out.err = std::move(ev.err);
  out.prompt_tokens = e.prompt_tokens;
  out.completion_tokens = e.completion_tokens;
  out.cached_tokens = e.cached_tokens;
  if (!out.finished) {
    router_state::deliver(e.cb, std::move(out), *s.log);
    return false;
  }
  s.account_finish(e, out.reason);
  if (out.err) s.log->info("request {}: ended with error: {}", it->first, out.err->what());
  auto cb = std::move(e.cb);
  s.table.erase(it);
  router_state::deliver(cb, std::move(out), *s.log);
  return true;
}

void on_event(router_actor_t* self, schema::TokenEvent::Reader r) {
  auto& s = self->state;
  std::string id = r.getId().cStr();
  auto it = s.table.find(id);
  if (it == s.table.end()) return;  // already ended here (abort, deadline): the stage's late event is moot
  auto& e = it->second;
  e.state = r.getState().cStr();
  if (r.getCachedTokens() > 0) e.cached_tokens = r.getCachedTokens();
  stage_event ev;
  ev.tokens = to_vector(r.getTokens());
  ev.finished = r.getFinished();
  ev.reason = from_schema(r.getReason());
  if (ev.reason == finish_reason::error) ev.err = read_error(r.getError());
  if (ev.tokens.empty() && !ev.finished) return;  // progress only
  // Prefill and decode (possibly on other nodes) send on different links: an event may
  // overtake an earlier one, or come twice. Hold it until the tokens before it arrived; a gap
  // that never fills ends the request at its deadline, never as a wrong completion.
  const int32_t first = r.getFirstIndex();
  if (first > e.completion_tokens) {
    if (static_cast<int32_t>(e.early.size()) <= s.opt.lim.max_new_tokens) e.early.emplace(first, std::move(ev));
    return;
  }
  if (deliver_in_order(s, it, first, std::move(ev))) return;
  while (!it->second.early.empty() && it->second.early.begin()->first <= it->second.completion_tokens) {
    auto nh = it->second.early.extract(it->second.early.begin());
    if (deliver_in_order(s, it, nh.key(), std::move(nh.mapped()))) return;
  }
}

void send_abort(router_actor_t* self, const std::string& id) {
  auto& s = self->state;
  s.prefill.gate->enter_control();
  self->send(s.prefill.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
               auto a = env.initAbort();
               a.setId(id);
               a.setHops(0);
             }));
}

void on_tick(router_actor_t* self) {
  auto& s = self->state;
  s.tick_pending = false;
  const int64_t now = s.clk->now_ms();
  std::vector<std::string> expired;
  for (const auto& [id, e] : s.table)
    if (now >= e.deadline_ms) expired.push_back(id);
  for (const auto& id : expired) {
    const auto& e = s.table.at(id);
    tandem::error err(
        error_kind::overloaded,
        fmt::format("request deadline exceeded after {} ms in state {}; raise request_timeout_ms or "
                    "reduce load",
                    now - e.submit_ms, e.state));
    s.log->warn("request {}: {}", id, err.what());
    s.rejected_by_reason["deadline"] += 1;
    s.finish_here(id, finish_reason::error, &err);
    send_abort(self, id);
  }
  schedule_tick(self);
}

caf::behavior router_actor(router_actor_t* self, router_options opt, bounded_actor prefill,
                           std::shared_ptr<mailbox_gate> gate, std::shared_ptr<const cluster_clock> clk,
                           std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.prefill = std::move(prefill);
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  // Every reason the router can refuse for is exported from the start (at 0), so dashboards
  // and alerts see the series before the first rejection.
  for (const char* r : {"malformed", "shutdown", "invalid", "duplicate_id", "inflight_full", "prefill_mailbox", "deadline"})
    st.rejected_by_reason[r] = 0;
  return {
      [self](submit_atom, const wire& w, const callback_box& cb) {
        self->state.gate->leave();
        on_submit(self, w, cb.take());
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isEvent()) {
            on_event(self, env.getEvent());
          } else if (env.isAbort()) {
            std::string id = env.getAbort().getId().cStr();
            if (!s.table.count(id)) return;
            s.log->info("request {}: aborted by the client", id);
            s.finish_here(id, finish_reason::abort, nullptr);
            send_abort(self, id);
          } else {
            s.log->error("router: unexpected message dropped");
          }
        } catch (const tandem::error& e) {
          s.log->error("router: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("router: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](tick_atom) { on_tick(self); },
      [self](stop_atom) -> bool {
        auto& s = self->state;
        s.stopped = true;
        std::vector<std::string> ids;
        for (const auto& [id, e] : s.table) ids.push_back(id);
        tandem::error err(error_kind::disconnected,
                          "the cluster shut down before the request finished; retry");
        for (const auto& id : ids) s.finish_here(id, finish_reason::error, &err);
        return true;
      },
      [self](inflight_atom) -> inflight_list {
        auto& s = self->state;
        inflight_list out;
        int64_t now = s.clk->now_ms();
        out.requests.reserve(s.table.size());
        for (const auto& [id, e] : s.table)
          out.requests.push_back({id, e.state, now - e.submit_ms, e.prompt_tokens, e.completion_tokens});
        std::sort(out.requests.begin(), out.requests.end(),
                  [](const request_report& a, const request_report& b) { return a.age_ms > b.age_ms; });
        return out;
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"requests_total", "", double(s.requests_total), "counter", "Requests accepted by the router"},
            {"requests_inflight", "", double(s.table.size()), "gauge",
             "Requests in the router's in-flight table"},
            {"requests_inflight_bound", "", double(s.opt.lim.max_inflight_requests), "gauge",
             "Bound of the in-flight table"},
            {"tokens_generated_total", "", double(s.tokens_generated), "counter",
             "Completion tokens delivered"},
            {"prompt_tokens_total", "", double(s.prompt_tokens_total), "counter",
             "Prompt tokens of the requests accepted by the router"},
        };
        for (const auto& [r, n] : s.finished_by_reason)
          m.push_back({"requests_finished_total", fmt::format("reason=\"{}\"", r), double(n), "counter",
                       "Requests ended, by finish reason"});
        for (const auto& [r, n] : s.rejected_by_reason)
          m.push_back({"rejections_total", fmt::format("actor=\"router\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("router", m, {&s.ttft, &s.tpot, &s.e2e});
      },
  };
}

}  // namespace

bounded_actor spawn_router(caf::actor_system& sys, const router_options& opt, bounded_actor prefill,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("router", opt.lim.router_mailbox);
  auto h = sys.spawn(router_actor, opt, std::move(prefill), gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
