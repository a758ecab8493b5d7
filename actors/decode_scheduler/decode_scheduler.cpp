#include "actors/decode_scheduler/decode_state.h"

namespace tandem {

namespace decode_detail {

/// Conditional disaggregation: the router sent a short prompt here to be prefilled in the
/// decode batch (no prefill queue, no KV transfer). Its pages come from this node's pool; it
/// joins the batch like a handoff and runs as prefill chunks until its first token.
void on_local_submit(decode_actor_t* self, seq_request r) {
  auto& s = self->state;
  bool held = s.find(r.id) != nullptr || s.local_acquiring.count(r.id) > 0;
  for (const auto& x : s.waiting) held = held || x.req.id == r.id;
  if (held) {
    s.rejected["duplicate_submit"] += 1;
    s.log->warn("request {}: duplicate local prefill ignored", r.id);
    return;
  }
  dseq d;
  d.req = std::move(r);
  const int64_t taken = int64_t(s.running.size() + s.waiting.size() + s.local_acquiring.size());
  if (taken >= s.opt.lim.max_running_seqs) {
    // Bounded like the batch it joins; the router retries it on the prefill path.
    s.fail(d,
           tandem::error(error_kind::overloaded,
                         fmt::format("decode node {} has no free batch slot for a local prefill ({} sequences, "
                                     "limits.max_running_seqs = {}); retry on a prefill node",
                                     s.opt.node, taken, s.opt.lim.max_running_seqs)),
           "local_prefill_slots");
    return;
  }
  auto ticket = s.peers.cache.admit<msg::acquire>();
  if (!ticket) {
    s.fail(d, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    return;
  }
  d.fill = d.req.all_tokens();
  const std::string id = d.req.id;
  s.local_acquiring[id] = false;
  auto fill = [&](schema::AcquireRequest::Builder a) {
    a.setId(id);
    fill_list([&](unsigned n) { return a.initTokens(n); }, d.fill);
    a.setUsePrefixCache(s.opt.lim.prefix_cache);
  };
  s.peers.cache.call<msg::acquire>(
          self, std::move(ticket), fill,
          [self, d](const wire& reply) mutable {
            auto& st = self->state;
            auto it = st.local_acquiring.find(d.req.id);
            const bool aborted = it != st.local_acquiring.end() && it->second;
            if (it != st.local_acquiring.end()) st.local_acquiring.erase(it);
            std::string why = "the cache tier sent an unexpected reply";
            int32_t cached = 0;
            try {
              wire_reader rd(reply);
              auto env = rd.reply();
              if (env.isAcquireReply() && env.getAcquireReply().getOk()) {
                d.pages = read_pool_pages(env.getAcquireReply());
                cached = env.getAcquireReply().getCachedTokens();
                d.owned_from = cached / st.page_size();
                why.clear();
              } else if (env.isAcquireReply()) {
                why = read_error(env.getAcquireReply().getError()).what();
              } else if (env.isError()) {
                why = read_error(env.getError()).what();
              }
            } catch (const tandem::error& e) {
              why = e.what();
            }
            if (aborted) {
              st.free_pages(d.req.id, d.pages);
              return;
            }
            if (!why.empty()) {
              st.fail(d,
                      tandem::error(error_kind::overloaded,
                                    fmt::format("no KV pages on decode node {} for a local prefill of {} tokens: {}; "
                                                "retry on a prefill node",
                                                st.opt.node, d.fill.size(), why)),
                      "kv_pages");
              return;
            }
            // At least the last token is computed: its step samples the first completion token.
            d.kv_len = std::clamp(cached, 0, static_cast<int32_t>(d.fill.size()) - 1);
            d.req.cached_tokens = d.kv_len;
            d.prefilling = true;
            st.local_prefills += 1;
            st.log->debug("request {}: local prefill ({} tokens, {} cached)", d.req.id, d.fill.size(), d.kv_len);
            st.emit(d, {}, finish_reason::none, nullptr, request_stage::prefill);
            st.waiting.push_back(std::move(d));
            pump(self);
          },
          [self, d](caf::error& e) mutable {
            auto& st = self->state;
            st.local_acquiring.erase(d.req.id);
            st.fail(d,
                    tandem::error(error_kind::disconnected,
                                  fmt::format("cache tier unreachable: {}", self->system().render(e))),
                    "cache_error");
          });
}

void on_abort(decode_actor_t* self, const std::string& id, int32_t hops, int32_t choice) {
  auto& s = self->state;
  // n > 1: the request's forks (every choice, or one whose stop string matched).
  if (abort_forks(self, id, choice)) {
    s.log->info("request {}: {} aborted", id, choice < 0 ? std::string("every choice") : fmt::format("choice {}", choice));
    pump(self);
    return;
  }
  if (choice >= 0) return;  // that choice ended here already
  if (auto it = s.local_acquiring.find(id); it != s.local_acquiring.end()) {
    it->second = true;  // its pages are freed when the acquisition returns
    return;
  }
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->req.id != id) continue;
    s.page_retry_due = true;
    s.free_pages(id, it->pages);
    s.waiting.erase(it);
    pump(self);
    return;
  }
  for (auto it = s.page_waiting.begin(); it != s.page_waiting.end(); ++it) {
    if (it->req.id != id) continue;
    release_source(self, *it);  // its KV pages are still on the source node
    s.page_waiting.erase(it);
    s.send_credit(false);
    return;
  }
  if (auto it = s.allocating.find(id); it != s.allocating.end()) {
    it->second.aborted = true;  // its pages are freed when the allocation returns
    return;
  }
  for (auto& [tid, d] : s.receiving) {
    if (d.req.id != id) continue;
    if (!d.aborted) {
      d.aborted = true;  // pages come back by kvDone (after quarantine if a put may still land)
      const uint64_t t = tid;
      s.peers.worker.send<msg::kv_abort>(self, [&](schema::KvTransferOrder::Builder o) {
        o.setId(id);
        o.setTransferId(t);
      });
    }
    return;
  }
  if (dseq* d = s.find(id)) {
    s.log->info("request {}: decode aborted after {} tokens", id, d->req.generated.size());
    d->aborted = true;  // leaves at the next pump (after the batch in flight, if any)
    pump(self);
    return;
  }
  if (hops < 8) {  // on its way back to prefill (preempted): follow it
    s.peers.prefill.send<msg::abort>(self, [&](schema::Abort::Builder a) {
      a.setId(id);
      a.setHops(hops + 1);
    });
  }
}

/// A prefill node went down (this node's prefill proxy saw it): the handoffs whose KV is still
/// there (parked for pages, or arriving) fail now by the transfer policy (recompute through the
/// router, or an error), at node-down instead of when their transfer times out.
void on_source_down(decode_actor_t* self, const std::string& node, const std::string& why) {
  auto& s = self->state;
  for (auto it = s.page_waiting.begin(); it != s.page_waiting.end();) {
    if (it->source_node != node) {
      ++it;
      continue;
    }
    dseq d = std::move(*it);
    it = s.page_waiting.erase(it);
    transfer_failed(self, std::move(d), why);
  }
  for (auto& [tid, d] : s.receiving) {
    if (d.source_node != node || d.aborted) continue;
    const uint64_t t = tid;  // the worker answers with a failed kvDone: the policy applies there
    s.peers.worker.send<msg::kv_abort>(self, [&](schema::KvTransferOrder::Builder o) {
      o.setId(d.req.id);
      o.setTransferId(t);
    });
  }
  s.send_credit(false);
}

caf::behavior decode_actor(decode_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  // One form for every caller: no layout set given means the one-pool set of opt.layout.
  if (st.opt.pools.pools.empty()) st.opt.pools = kv_pools_layout::single(st.opt.layout);
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.box = inbox{"decode", st.gate, st.log};
  return {
      [self](peers_atom, const peer_set& p) {
        self->state.peers = p;
        self->state.send_credit(true);
      },
      [self](wire_atom, const wire& w) {
        receive<decode_role>(
            self->state.box, w,
            overloaded{
                [self](msg::handoff, schema::KvHandoff::Reader h) {
                  auto& s = self->state;
                  // The prefill scheduler sharing the worker counts this handoff as on its way
                  // until a credit counts it taken, changed or not (a refused one changes nothing).
                  if (h.getTransferId() == 0) s.local_handoffs += 1;
                  on_handoff(self, h);
                  s.send_credit(false);
                },
                [self](msg::submit, schema::SubmitRequest::Reader r) { on_local_submit(self, seq_request::read(r)); },
                [self](msg::abort, schema::Abort::Reader a) {
                  on_abort(self, a.getId().cStr(), a.getHops(), a.getChoice());
                },
                [self](msg::credit_query, schema::StatsQuery::Reader q) {
                  self->state.drain.on_query(q.getHolds());
                  self->state.send_credit(true);
                },
            });
      },
      [self](tick_atom) {
        self->state.page_stall = false;
        pump(self);
      },
      [self](kv_atom, const wire& w) {
        receive<decode_role, kv_atom>(self->state.box, w,
                                      overloaded{[self](msg::kv_done, schema::KvTransferDone::Reader k) {
                                        on_kv_done(self, k);
                                      }});
      },
      [self](node_down_atom, const std::string& role, const std::string& target, const std::string& why) {
        if (role == "prefill") on_source_down(self, target.substr(0, target.rfind('/')), why);
      },
      [self](node_up_atom, const std::string&, const std::string&) {},
      [self](drain_atom, bool on) -> bool {
        self->state.drain.set(on);
        self->state.send_credit(true);  // the router stops (or resumes) routing here
        return true;
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"drain_router_clear", "actor=\"decode\"", s.drain.router_clear() ? 1.0 : 0.0, "gauge",
             "1 while draining once the router routes nothing here any more, else 0"},
            {"decode_running_requests", "", double(s.running.size()), "gauge",
             "Sequences in the decode batch"},
            {"decode_running_tokens", "", double(s.running_tokens()), "gauge",
             "Context tokens (with KV) of the sequences in the decode batch"},
            {"decode_running_bound", "", double(s.opt.lim.max_running_seqs), "gauge",
             "limits.max_running_seqs"},
            {"decode_waiting_requests", "", double(s.waiting.size()), "gauge",
             "Handed-off sequences waiting for a batch slot"},
            {"decode_waiting_requests_high_water", "", double(s.waiting_high_water), "gauge",
             "Most sequences ever waiting for a decode batch slot (limits.max_decode_waiting_seqs refuses beyond)"},
            {"decode_steps_total", "", double(s.steps), "counter", "Decode forward steps"},
            {"decode_tokens_total", "", double(s.tokens), "counter", "Tokens sampled by decode steps"},
            {"decode_preemptions_total", "", double(s.preemptions), "counter",
             "Sequences preempted on KV page exhaustion (requeued for recompute)"},
            {"decode_page_stalls_total", "", double(s.page_stalls), "counter",
             "Allocations retried later: the lone sequence fits the pool but others held the pages"},
            {"decode_kv_receiving_requests", "", double(s.receiving.size() + s.allocating.size()), "gauge",
             "Cross-node handoffs waiting for their KV pages (allocation or transfer)"},
            {"decode_kv_page_waiting_requests", "", double(s.page_waiting.size()), "gauge",
             "Cross-node handoffs waiting for a sequence here to end and free KV pages (bound: "
             "limits.max_running_seqs)"},
            {"decode_kv_handoffs_parked_total", "", double(s.handoffs_parked), "counter",
             "Cross-node handoffs that found the KV pool full and waited for pages"},
            {"decode_kv_receives_total", "", double(s.transfers_done), "counter",
             "Cross-node handoffs whose KV pages arrived"},
            {"decode_kv_receive_failures_total", "", double(s.transfers_failed), "counter",
             "Cross-node handoffs whose KV transfer failed (then recomputed or failed by policy)"},
            {"decode_kv_recomputes_total", "", double(s.transfer_recomputes), "counter",
             "Requests re-prefilled after a failed KV transfer (transfer.failure_policy = recompute)"},
            {"decode_forks_total", "", double(s.forks), "counter",
             "Sequences forked from another (n > 1: n - 1 per request, sharing its prompt's KV pages)"},
            {"decode_fork_failures_total", "", double(s.fork_failures), "counter",
             "Forks that got no KV pages (the request failed with overloaded)"},
            {"decode_fork_tokens_total", "", double(s.fork_tokens), "counter",
             "Last prompt positions recomputed by forks (one per fork) in decode steps"},
            {"decode_local_prefills_total", "", double(s.local_prefills), "counter",
             "Requests prefilled in the decode batch (conditional disaggregation)"},
            {"decode_local_prefill_tokens_total", "", double(s.local_prefill_tokens), "counter",
             "Prompt tokens computed by local prefill chunks in decode steps"},
            {"decode_credits_sent_total", "", double(s.credits_sent), "counter",
             "Credits sent to the router and a prefill scheduler sharing the worker (batch/page changes, handoffs taken, heartbeat answers)"},
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"decode\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        for (auto& x : s.box.metrics()) m.push_back(std::move(x));
        return make_stats_wire("decode", m, {});
      },
  };
}


}  // namespace decode_detail


bounded_actor spawn_decode_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                     std::shared_ptr<const cluster_clock> clk,
                                     std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("decode", opt.lim.decode_mailbox);
  auto h = sys.spawn(decode_detail::decode_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
