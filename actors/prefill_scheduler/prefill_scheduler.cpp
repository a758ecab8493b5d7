#include "actors/prefill_scheduler/prefill_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <deque>
#include <unordered_map>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

namespace {

struct pseq {
  seq_request req;
  std::vector<int32_t> tokens;  ///< prompt ++ generated: everything to compute
  std::vector<int32_t> pages;
  int32_t computed = 0;  ///< tokens whose KV is in the pages
  bool aborted = false;
  bool requeued = false;  ///< came back from decode (already admitted)
};

struct prefill_state {
  scheduler_options opt;
  peer_set peers;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::deque<pseq> waiting;
  int64_t queued_tokens = 0;      ///< tokens of `waiting` that count against max_queued_tokens
  std::optional<pseq> acquiring;  ///< the one request whose pages are being acquired
  std::vector<pseq> active;       ///< holding pages, being prefilled
  bool busy = false;              ///< a forward batch is at the worker
  std::vector<std::pair<std::string, int32_t>> in_flight;  ///< (id, tokens) of that batch
  bool retry_wait = false;
  /// Numbers the handoffs; starts at the spawn time (ms << 20) so a restarted prefill does not
  /// reuse the numbers of its predecessor.
  uint64_t next_handoff = 0;
  int64_t admitted = 0, requeues = 0, prompt_tokens_computed = 0, handoffs = 0, batches = 0;
  std::unordered_map<std::string, int64_t> rejected;
  static inline const char* name = "prefill";

  int32_t page_size() const { return opt.layout.page_size; }

  void emit(const wire& w) {
    peers.router.gate->enter_control();
    caf::anon_send(peers.router.handle, wire_atom::value, w);
  }
  void emit_event(const pseq& s, const std::vector<int32_t>& toks, finish_reason reason,
                  const tandem::error* err, const char* state) {
    emit(make_event(s.req.id, toks, reason, err, static_cast<int32_t>(s.req.prompt.size()),
                    s.req.cached_tokens, state, static_cast<int32_t>(s.req.generated.size() - toks.size())));
  }
  void free_pages(const std::string& id, std::vector<int32_t>& pages) {
    if (pages.empty()) return;
    peers.cache.gate->enter_control();
    caf::anon_send(peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                     auto f = env.initFree();
                     f.setId(id);
                     fill_list([&](unsigned n) { return f.initPages(n); }, pages);
                   }));
    pages.clear();
  }
  void fail(pseq& s, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", s.req.id, e.what());
    free_pages(s.req.id, s.pages);
    emit_event(s, {}, finish_reason::error, &e, "prefill");
  }
};

using prefill_actor_t = caf::stateful_actor<prefill_state>;

void pump(prefill_actor_t* self);

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
  if (requeue) {
    // Already admitted: preempted sequences go first (they are older than anything waiting).
    s.requeues += 1;
    s.log->info("request {}: requeued for recompute ({} tokens)", q.req.id, q.tokens.size());
    s.waiting.push_front(std::move(q));
    pump(self);
    return;
  }
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
  pump(self);
}

void on_acquired(prefill_actor_t* self, const wire& w) {
  auto& s = self->state;
  pseq q = std::move(*s.acquiring);
  s.acquiring.reset();
  try {
    wire_reader rd(w);
    auto env = rd.root();
    if (!env.isAcquireReply()) {
      auto e = env.isError() ? read_error(env.getError())
                             : tandem::error(error_kind::failed, "cache tier sent an unexpected reply");
      s.fail(q, e, "cache_error");
      return;
    }
    auto r = env.getAcquireReply();
    if (r.getOk()) {
      q.pages = to_vector(r.getPages());
      if (q.aborted) {
        s.free_pages(q.req.id, q.pages);
        return;
      }
      q.computed = r.getCachedTokens();
      if (!q.requeued) q.req.cached_tokens = r.getCachedTokens();
      s.log->debug("request {}: prefill starts ({} tokens, {} cached)", q.req.id, q.tokens.size(),
                   q.computed);
      s.emit_event(q, {}, finish_reason::none, nullptr, "prefill");
      s.active.push_back(std::move(q));
      return;
    }
    if (q.aborted) return;
    auto err = read_error(r.getError());
    if (r.getRetryable()) {
      // Pages are held by running requests and will come back: wait at the head of the queue
      // (the request's deadline bounds the wait).
      if (!q.requeued) s.queued_tokens += static_cast<int64_t>(q.tokens.size());
      s.waiting.push_front(std::move(q));
      schedule_retry(self);
      return;
    }
    s.fail(q,
           tandem::error(error_kind::overloaded,
                         fmt::format("{}; the prompt needs more pages than the whole pool", err.what())),
           "kv_pages");
  } catch (const tandem::error& e) {
    s.fail(q, e, "cache_error");
  }
}

void finish_prefill(prefill_actor_t* self, pseq& q, int32_t token) {
  auto& s = self->state;
  const int32_t computed = q.computed;
  // Cache the full pages of what was computed before ownership moves on.
  if (s.opt.lim.prefix_cache) {
    s.peers.cache.gate->enter_control();
    self->send(s.peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto ins = env.initInsert();
                 ins.setId(q.req.id);
                 fill_list([&](unsigned n) { return ins.initTokens(n); }, q.tokens);
                 fill_list([&](unsigned n) { return ins.initPages(n); }, q.pages);
               }));
  }
  auto reason = apply_token(q.req, token, s.opt.model);
  std::vector<int32_t> out;
  if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(token);
  if (reason != finish_reason::none) {
    s.free_pages(q.req.id, q.pages);
    s.emit_event(q, out, reason, nullptr, "prefill");
    return;
  }
  s.emit_event(q, out, finish_reason::none, nullptr, "decode");
  if (!s.peers.decode.gate->try_enter()) {
    s.fail(q, s.peers.decode.gate->overloaded_error(), "decode_mailbox");
    return;
  }
  s.handoffs += 1;
  self->send(s.peers.decode.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
               auto h = env.initHandoff();
               h.setHandoffSeq(s.next_handoff++);
               q.req.write(h.initRequest());
               auto kv = h.initKv();
               kv.setPoolId(s.opt.pool_id);
               kv.setNode(s.opt.node);
               fill_list([&](unsigned n) { return kv.initPageIds(n); }, q.pages);
               auto l = kv.initLayout();
               l.setNLayers(s.opt.layout.n_layers);
               l.setNKvHeads(s.opt.layout.n_kv_heads);
               l.setHeadDim(s.opt.layout.head_dim);
               l.setPageSize(s.opt.layout.page_size);
               kv.setValidTokens(computed);
             }));
  q.pages.clear();  // ownership moved to the decode scheduler
}

void on_forward_done(prefill_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it = std::find_if(s.active.begin(), s.active.end(),
                           [&](const pseq& q) { return q.req.id == batch[i].first; });
    if (it == s.active.end()) continue;
    if (it->aborted) {
      s.free_pages(it->req.id, it->pages);
      s.active.erase(it);
      continue;
    }
    if (err) {
      s.fail(*it, *err, "worker_error");
      s.active.erase(it);
      continue;
    }
    it->computed += batch[i].second;
    s.prompt_tokens_computed += batch[i].second;
    if (it->computed == static_cast<int32_t>(it->tokens.size())) {
      finish_prefill(self, *it, i < sampled.size() ? sampled[i] : -1);
      s.active.erase(it);
    }
  }
  pump(self);
}

void start_batch(prefill_actor_t* self) {
  auto& s = self->state;
  int32_t budget = s.opt.lim.prefill_chunk_tokens;
  capnp::MallocMessageBuilder mb;
  auto env = mb.initRoot<schema::Envelope>();
  auto fb = env.initForward();
  fb.setPhase("prefill");
  std::vector<pseq*> chosen;
  std::vector<int32_t> counts;
  for (auto& q : s.active) {
    if (budget <= 0) break;
    const int32_t left = static_cast<int32_t>(q.tokens.size()) - q.computed;
    const int32_t n = std::min(left, budget);
    if (n <= 0) continue;
    chosen.push_back(&q);
    counts.push_back(n);
    budget -= n;
  }
  if (chosen.empty()) return;
  auto seqs = fb.initSeqs(static_cast<unsigned>(chosen.size()));
  for (unsigned i = 0; i < chosen.size(); ++i) {
    auto& q = *chosen[i];
    auto st = seqs[i];
    st.setId(q.req.id);
    std::span<const int32_t> toks(q.tokens.data() + q.computed, static_cast<size_t>(counts[i]));
    fill_list([&](unsigned n) { return st.initTokens(n); }, toks);
    st.setPos(q.computed);
    const int32_t end = q.computed + counts[i];
    const size_t n_pages = static_cast<size_t>((end + s.page_size() - 1) / s.page_size());
    fill_list([&](unsigned n) { return st.initPages(n); }, std::span<const int32_t>(q.pages.data(), n_pages));
    const bool last = end == static_cast<int32_t>(q.tokens.size());
    st.setSample(last);
    auto sp = st.initSampling();
    sp.setTemperature(q.req.sampling.temperature);
    sp.setTopK(q.req.sampling.top_k);
    sp.setTopP(q.req.sampling.top_p);
    sp.setSeed(q.req.sampling.seed);
    st.setTokenIndex(static_cast<int32_t>(q.req.generated.size()));
    s.in_flight.emplace_back(q.req.id, counts[i]);
  }
  if (!s.peers.worker.gate->try_enter()) {
    // The batch's sequences end with the error (on_forward_done takes `in_flight`); clearing it
    // first failed nobody and pump() retried at once, recursing while the mailbox stayed full.
    auto e = s.peers.worker.gate->overloaded_error();
    on_forward_done(self, nullptr, &e);
    return;
  }
  s.busy = true;
  s.batches += 1;
  self->request(s.peers.worker.handle, caf::infinite, call_atom::value, make_wire(mb))
      .then([self](const wire& r) { on_forward_done(self, &r, nullptr); },
            [self](caf::error& e) {
              tandem::error te(error_kind::disconnected,
                               fmt::format("worker unreachable: {}", self->system().render(e)));
              on_forward_done(self, nullptr, &te);
            });
}

void pump(prefill_actor_t* self) {
  auto& s = self->state;
  if (!s.retry_wait && !s.acquiring && !s.waiting.empty() &&
      static_cast<int32_t>(s.active.size()) < s.opt.lim.max_prefill_batch_seqs) {
    s.acquiring = std::move(s.waiting.front());
    s.waiting.pop_front();
    auto& q = *s.acquiring;
    if (!q.requeued) s.queued_tokens -= static_cast<int64_t>(q.tokens.size());
    if (!s.peers.cache.gate->try_enter()) {
      pseq f = std::move(*s.acquiring);
      s.acquiring.reset();
      s.fail(f, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    } else {
      auto w = make_wire([&](schema::Envelope::Builder env) {
        auto a = env.initAcquire();
        a.setId(q.req.id);
        fill_list([&](unsigned n) { return a.initTokens(n); }, q.tokens);
        a.setUsePrefixCache(s.opt.lim.prefix_cache);
      });
      self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
          .then(
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
    }
  }
  if (!s.busy && !s.active.empty()) start_batch(self);
}

void on_abort(prefill_actor_t* self, const std::string& id, int32_t hops) {
  auto& s = self->state;
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
  // Not here: it moved on to decode (or is on its way back); follow it.
  if (hops < 8) {
    s.peers.decode.gate->enter_control();
    self->send(s.peers.decode.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto a = env.initAbort();
                 a.setId(id);
                 a.setHops(hops + 1);
               }));
  }
}

caf::behavior prefill_actor(prefill_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                            std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  st.next_handoff = (static_cast<uint64_t>(st.clk->now_ms()) << 20) + 1;
  return {
      [self](peers_atom, const peer_set& p) { self->state.peers = p; },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isSubmit())
            on_submit(self, seq_request::read(env.getSubmit()), false);
          else if (env.isRequeue())
            on_submit(self, seq_request::read(env.getRequeue()), true);
          else if (env.isAbort())
            on_abort(self, env.getAbort().getId().cStr(), env.getAbort().getHops());
          else
            s.log->error("prefill: unexpected message dropped");
        } catch (const tandem::error& e) {
          s.log->error("prefill: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("prefill: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](tick_atom) {
        self->state.retry_wait = false;
        pump(self);
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
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
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"prefill\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("prefill", m, {});
      },
  };
}

}  // namespace

bounded_actor spawn_prefill_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                      std::shared_ptr<const cluster_clock> clk,
                                      std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("prefill", opt.lim.prefill_mailbox);
  auto h = sys.spawn(prefill_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
