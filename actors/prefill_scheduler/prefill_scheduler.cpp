#include "actors/prefill_scheduler/prefill_state.h"

namespace tandem {

namespace prefill_detail {

void schedule_retry(prefill_actor_t* self) {
  auto& s = self->state;
  if (s.retry_wait) return;
  s.retry_wait = true;
  self->delayed_send(self, std::chrono::milliseconds(s.opt.retry_ms), tick_atom::value);
}

void on_submit(prefill_actor_t* self, seq_request r, bool requeue) {
  auto& s = self->state;
  // A link that delivers twice (a retry across nodes) must not start the request twice.
  auto same = [&](const pseq& x) { return x.req.id == r.id; };
  if ((s.acquiring && same(*s.acquiring)) || std::any_of(s.waiting.begin(), s.waiting.end(), same) ||
      std::any_of(s.active.begin(), s.active.end(), same)) {
    s.rejected["duplicate_submit"] += 1;
    s.log->warn("request {}: duplicate {} ignored", r.id, requeue ? "requeue" : "submission");
    return;
  }
  pseq q;
  q.req = std::move(r);
  q.tokens = q.req.all_tokens();
  q.requeued = requeue;
  q.arrival_ms = s.clk->now_ms();
  if (requeue) {
    // Already admitted: preempted sequences go first (they are older than anything waiting).
    s.requeues += 1;
    s.log->info("request {}: requeued for recompute ({} tokens)", q.req.id, q.tokens.size());
    s.waiting.push_front(std::move(q));
    pump(self);
    return;
  }
  s.received += 1;
  const auto& lim = s.opt.lim;
  const int64_t n = static_cast<int64_t>(q.tokens.size());
  if (static_cast<int32_t>(s.waiting.size()) >= lim.max_queued_requests) {
    s.fail(q,
           tandem::error(
               error_kind::overloaded,
               fmt::format("prefill queue is full ({} requests waiting, limits.max_queued_requests = {}); "
                           "retry later",
                           s.waiting.size(), lim.max_queued_requests)),
           "queue_requests");
    return;
  }
  if (s.queued_tokens + n > lim.max_queued_tokens) {
    s.fail(q,
           tandem::error(error_kind::overloaded,
                         fmt::format("prefill queue holds {} prompt tokens; {} more would exceed "
                                     "limits.max_queued_tokens = {}; retry later",
                                     s.queued_tokens, n, lim.max_queued_tokens)),
           "queue_tokens");
    return;
  }
  s.admitted += 1;
  s.queued_tokens += n;
  s.waiting.push_back(std::move(q));
  s.queued_tokens_high_water = std::max(s.queued_tokens_high_water, s.queued_tokens);
  s.queued_requests_high_water = std::max(s.queued_requests_high_water, static_cast<int32_t>(s.waiting.size()));
  pump(self);
}

void pump(prefill_actor_t* self) {
  auto& s = self->state;
  if (!s.retry_wait && !s.acquiring && !s.waiting.empty() &&
      static_cast<int32_t>(s.active.size()) < s.opt.lim.max_prefill_batch_seqs) {
    s.acquiring = std::move(s.waiting.front());
    s.waiting.pop_front();
    auto& q = *s.acquiring;
    if (!q.requeued) s.queued_tokens -= static_cast<int64_t>(q.tokens.size());
    const bool sent = s.peers.cache.call<msg::acquire>(
        self,
        [&](schema::AcquireRequest::Builder a) {
          a.setId(q.req.id);
          fill_list([&](unsigned n) { return a.initTokens(n); }, q.tokens);
          a.setUsePrefixCache(s.opt.lim.prefix_cache);
        },
        [self](const wire& r) {
          on_acquired(self, r);
          pump(self);
        },
        [self](caf::error& e) {
          auto& st = self->state;
          pseq f = std::move(*st.acquiring);
          st.acquiring.reset();
          st.fail(f,
                  tandem::error(error_kind::disconnected,
                                fmt::format("cache tier unreachable: {}", self->system().render(e))),
                  "cache_error");
          pump(self);
        });
    if (!sent) {
      pseq f = std::move(*s.acquiring);
      s.acquiring.reset();
      s.fail(f, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    }
  }
  if (!s.busy && !s.active.empty()) {
    const bool hold = s.decode_backed_up();
    if (hold && !s.paused) {
      s.paused = true;
      s.pauses += 1;
      s.pause_start_ms = s.clk->now_ms();
    } else if (!hold && s.paused) {
      s.paused = false;
      s.paused_ms += s.clk->now_ms() - s.pause_start_ms;
    }
    if (!hold) start_batch(self);
  }
  s.observe_drain();
  s.send_credit(false);
}

void on_abort(prefill_actor_t* self, const std::string& id, int32_t hops, int32_t choice) {
  auto& s = self->state;
  // One choice of an n > 1 request (its stop string): only its fork at decode stops.
  if (choice >= 0) {
    s.peers.decode.send<msg::abort>(self, [&](schema::Abort::Builder a) {
      a.setId(id);
      a.setHops(8);
      a.setStopString(true);
      a.setChoice(choice);
    });
    return;
  }
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->req.id != id) continue;
    if (!it->requeued) s.queued_tokens -= static_cast<int64_t>(it->tokens.size());
    s.log->info("request {}: dropped from the prefill queue (abort)", id);
    s.waiting.erase(it);
    return;
  }
  if (s.acquiring && s.acquiring->req.id == id) {
    s.acquiring->aborted = true;
    return;
  }
  for (auto it = s.active.begin(); it != s.active.end(); ++it) {
    if (it->req.id != id) continue;
    s.log->info("request {}: prefill aborted at {}/{} tokens", id, it->computed, it->tokens.size());
    const bool running =
        std::any_of(s.in_flight.begin(), s.in_flight.end(), [&](auto& p) { return p.first == id; });
    if (running) {
      it->aborted = true;  // freed when the batch returns
    } else {
      s.free_pages(id, it->pages);
      s.active.erase(it);
    }
    return;
  }
  if (!s.opt.remote_decode_node.empty()) {
    // Its KV send may still be live at the worker: the worker stops it by request id (and
    // frees its pages); an id it does not hold is ignored there.
    s.peers.worker.send<msg::kv_abort>(self, [&](schema::KvTransferOrder::Builder o) { o.setId(id); });
  }
  // Not here: it moved on to decode (or is on its way back); follow it.
  if (hops < 8) {
    s.peers.decode.send<msg::abort>(self, [&](schema::Abort::Builder a) {
      a.setId(id);
      a.setHops(hops + 1);
    });
  }
}

caf::behavior prefill_actor(prefill_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                            std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  // One form for every caller: no layout set given means the one-pool set of opt.layout.
  if (st.opt.pools.pools.empty()) st.opt.pools = kv_pools_layout::single(st.opt.layout);
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.box = inbox{"prefill", st.gate, st.log};
  st.next_handoff = (static_cast<uint64_t>(st.clk->now_ms()) << 20) + 1;
  st.transfer_ids.emplace(st.opt.node, static_cast<uint64_t>(st.clk->now_ms()) * 64);
  return {
      [self](peers_atom, const peer_set& p) {
        self->state.peers = p;
        self->state.send_credit(true);  // the router's first view of this target
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        receive<prefill_role>(
            s.box, w,
            overloaded{
                [self](msg::submit, schema::SubmitRequest::Reader r) {
                  on_submit(self, seq_request::read(r), false);
                  // A refused submission changes no queue pump() saw: report it here.
                  self->state.send_credit(false);
                },
                [self](msg::requeue, schema::SubmitRequest::Reader r) { on_submit(self, seq_request::read(r), true); },
                [self](msg::abort, schema::Abort::Reader a) {
                  on_abort(self, a.getId().cStr(), a.getHops(), a.getChoice());
                  self->state.send_credit(false);
                },
                [self](msg::credit_query, schema::StatsQuery::Reader q) {
                  self->state.drain_ctl.on_query(q.getHolds());
                  self->state.send_credit(true);
                },
                [self](msg::credit, schema::Credit::Reader c) {
                  // The decode scheduler on this worker: a step held back for it may go now.
                  auto& st = self->state;
                  if (c.getRole() != schema::StageRole::DECODE) {
                    st.box.count_unexpected("a credit that is not a decode scheduler's");
                    return;
                  }
                  st.decode_running = c.getRunningSeqs();
                  st.decode_waiting = c.getWaitingSeqs();
                  st.decode_max_running = c.getMaxRunningSeqs();
                  st.decode_took_handoffs = c.getReceived();
                  pump(self);
                },
            });
      },
      [self](tick_atom) {
        self->state.retry_wait = false;
        pump(self);
      },
      [self](drain_atom, bool on) -> bool {
        self->state.drain_ctl.set(on);
        self->state.send_credit(true);  // the router stops (or resumes) routing here
        return true;
      },
      // The node's decode proxy lost (or regained) a decode node: the router must not pair
      // this prefill target with it until it is back (Credit.unreachable).
      [self](node_down_atom, const std::string&, const std::string& target, const std::string&) {
        if (self->state.unreachable_decode.insert(target).second) self->state.send_credit(true);
      },
      [self](node_up_atom, const std::string&, const std::string& target) {
        if (self->state.unreachable_decode.erase(target)) self->state.send_credit(true);
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"drain_router_clear", "actor=\"prefill\"", s.drain_ctl.router_clear() ? 1.0 : 0.0, "gauge",
             "1 while draining once the router routes nothing here any more, else 0"},
            {"prefill_unreachable_decode_targets", "", double(s.unreachable_decode.size()), "gauge",
             "Decode nodes this node's KV handoffs cannot reach now (the router pairs no request of this "
             "prefill target with them)"},
            {"prefill_queued_requests", "", double(s.waiting.size()), "gauge",
             "Requests waiting for prefill"},
            {"prefill_queued_requests_bound", "", double(s.opt.lim.max_queued_requests), "gauge",
             "limits.max_queued_requests"},
            {"prefill_queued_tokens", "", double(s.queued_tokens), "gauge",
             "Prompt tokens waiting for prefill"},
            {"prefill_queued_tokens_bound", "", double(s.opt.lim.max_queued_tokens), "gauge",
             "limits.max_queued_tokens"},
            {"prefill_active_requests", "", double(s.active.size() + (s.acquiring ? 1 : 0)), "gauge",
             "Requests being prefilled"},
            {"prefill_admitted_total", "", double(s.admitted), "counter",
             "Requests admitted to the prefill queue"},
            {"prefill_requeues_total", "", double(s.requeues), "counter",
             "Preempted sequences taken back for recompute"},
            {"prefill_tokens_total", "", double(s.prompt_tokens_computed), "counter",
             "Tokens computed by prefill"},
            {"prefill_batches_total", "", double(s.batches), "counter", "Prefill forward batches"},
            {"kv_handoffs_total", "", double(s.handoffs), "counter", "KV handoffs to the decode scheduler"},
            {"prefill_queued_requests_high_water", "", double(s.queued_requests_high_water), "gauge",
             "Most requests ever waiting for prefill (never above limits.max_queued_requests)"},
            {"prefill_queued_tokens_high_water", "", double(s.queued_tokens_high_water), "gauge",
             "Most prompt tokens ever waiting for prefill (never above limits.max_queued_tokens)"},
            {"prefill_drain_tokens_per_s", "", s.tokens_per_s, "gauge",
             "Measured rate the prefill queue drains at (prompt tokens per wall second while requests wait; while it has work until a queue was seen)"},
            {"prefill_credits_sent_total", "", double(s.credits_sent), "counter",
             "Credits sent to the router (queue changes and heartbeat answers)"},
            {"prefill_decode_pauses_total", "", double(s.pauses), "counter",
             "Times a prefill step waited for the decode scheduler sharing the worker (limits.prefill_pause_decode_waiting_seqs)"},
            {"prefill_decode_paused_ms_total", "", double(s.paused_ms + (s.paused ? s.clk->now_ms() - s.pause_start_ms : 0)),
             "counter", "Time prefill steps waited for the decode scheduler sharing the worker (ms)"},
            {"prefill_decode_paused", "", s.paused ? 1.0 : 0.0, "gauge",
             "1 while a prefill step waits for the decode scheduler sharing the worker"},
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"prefill\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        for (auto& x : s.box.metrics()) m.push_back(std::move(x));
        return make_stats_wire("prefill", m, {&s.queue_wait_ms, &s.compute_ms});
      },
  };
}


}  // namespace prefill_detail

bounded_actor spawn_prefill_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                      std::shared_ptr<const cluster_clock> clk,
                                      std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("prefill", opt.lim.prefill_mailbox);
  auto h = sys.spawn(prefill_detail::prefill_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
