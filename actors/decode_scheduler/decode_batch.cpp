/// The decode scheduler's continuous batch: page growth per pool, steps, their results,
/// preemption when the pool is full.
#include "actors/decode_scheduler/decode_state.h"

namespace tandem::decode_detail {

/// Frees the pages of the youngest sequence and sends it back for recompute; false if
/// `needy` is the only candidate (then it fails instead).
void preempt_or_fail(decode_actor_t* self) {
  auto& s = self->state;
  const size_t candidates = s.running.size() + s.waiting.size();
  if (candidates == 1) {
    // Alone here, but if it fits in the pool, the pages it lacks are held elsewhere (a
    // prefill, a transfer): they come back, or arrive here as a sequence that can be
    // preempted. Retry after opt.retry_ms rather than fail a request that fits (its deadline
    // still bounds the wait). Only a sequence larger than the whole pool fails now.
    const dseq& d = s.running.empty() ? s.waiting.front() : s.running.front();
    const int64_t need = int64_t(blocks_of(d.pages)) + std::max(0, s.pages_needed(d));
    if (s.pool_total_pages > 0 && need <= s.pool_total_pages) {
      if (!s.page_stall) {
        s.page_stall = true;
        s.page_stalls += 1;
        self->delayed_send(self, std::chrono::milliseconds(std::max(1, s.opt.retry_ms)), tick_atom::value);
      }
      return;
    }
  }
  // The youngest across running and waiting sequences.
  uint64_t best = 0;
  bool in_waiting = false;
  size_t idx = 0;
  for (size_t i = 0; i < s.running.size(); ++i)
    if (s.running[i].req.admit_order >= best)
      best = s.running[i].req.admit_order, idx = i, in_waiting = false;
  for (size_t i = 0; i < s.waiting.size(); ++i)
    if (s.waiting[i].req.admit_order >= best) best = s.waiting[i].req.admit_order, idx = i, in_waiting = true;
  if (candidates == 0) return;
  dseq victim = in_waiting ? std::move(s.waiting[idx]) : std::move(s.running[idx]);
  if (in_waiting)
    s.waiting.erase(s.waiting.begin() + static_cast<std::ptrdiff_t>(idx));
  else
    s.running.erase(s.running.begin() + static_cast<std::ptrdiff_t>(idx));
  if (candidates == 1 || !victim.group.empty() || victim.req.n > 1) {
    if (candidates > 1) {
      // n > 1: its forks share pages; recompute would need all of them back at prefill.
      s.fail(victim,
             tandem::error(error_kind::overloaded,
                           fmt::format("request {}: KV cache exhausted at {} tokens; a request with n = {} is not "
                                       "preempted for recompute; retry it, with a smaller n or max_tokens",
                                       victim.wire_id(), victim.total_len(), victim.req.n)),
             "kv_pages_n");
      return;
    }
    s.fail(
        victim,
        tandem::error(error_kind::overloaded,
                      fmt::format("request {}: KV cache exhausted at {} tokens and no other sequence can be "
                                  "preempted; lower max_tokens or raise limits.kv_cache_mb / device_pages",
                                  victim.req.id, victim.total_len())),
        "kv_pages");
    return;
  }
  s.preemptions += 1;
  s.log->info("request {}: preempted at {} tokens (KV cache full), requeued for recompute", victim.req.id,
              victim.total_len());
  s.free_pages(victim.req.id, victim.pages);
  s.emit(victim, {}, finish_reason::none, nullptr, request_stage::preempted);
  requeue(self, victim);
}

void on_step_done(decode_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  const std::vector<token_logprobs> lps = w && !err ? read_forward_logprobs(*w) : std::vector<token_logprobs>{};
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it = std::find_if(s.running.begin(), s.running.end(),
                           [&](const dseq& d) { return d.req.id == batch[i].first; });
    if (it == s.running.end()) continue;
    if (it->aborted) {
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      s.running.erase(it);
      continue;
    }
    if (err || i >= sampled.size()) {
      s.fail(*it, err ? *err : tandem::error(error_kind::failed, "worker returned too few tokens"),
             "worker_error");
      s.running.erase(it);
      continue;
    }
    it->kv_len += batch[i].second;
    if (it->prefilling) {
      (it->fork_first ? s.fork_tokens : s.local_prefill_tokens) += batch[i].second;
      if (it->kv_len < static_cast<int32_t>(it->fill.size())) continue;  // more chunks to go
      it->prefilling = false;  // the prompt is in; this step sampled the first token
      it->fill.clear();
    } else {
      s.tokens += 1;
    }
    if (it->pages.size() > 1) {
      // Window blocks the next token does not read go back (a sequence holds a ring of them).
      pool_pages dead;
      if (release_dead_pages(s.opt.pools, it->kv_len, it->pages, dead) > 0) s.free_pages(it->req.id, dead);
    }
    const int32_t tok = sampled[i];
    auto reason = apply_token(it->req, tok, s.opt.model);
    std::vector<int32_t> out;
    if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(tok);
    // The token's log-probabilities travel with it (none for a stop token, which is not emitted).
    std::span<const token_logprobs> lp;
    if (!out.empty() && it->req.logprobs >= 0 && i < lps.size()) lp = std::span<const token_logprobs>(&lps[i], 1);
    s.emit(*it, out, reason, nullptr, request_stage::decode, lp);
    if (reason != finish_reason::none) {
      // Cache prompt ++ generated (the next turn of a conversation starts with them) before
      // the pages go back; the cache takes its own references.
      if (s.opt.lim.prefix_cache) {
        auto all = it->req.all_tokens();
        all.resize(static_cast<size_t>(std::min<int64_t>(int64_t(all.size()), it->kv_len)));
        s.peers.cache.send_anon<msg::insert>([&](schema::InsertPrefix::Builder ins) {
          ins.setId(it->req.id);
          fill_list([&](unsigned n) { return ins.initTokens(n); }, all);
          write_pool_pages(ins, it->pages);
        });
      }
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      s.running.erase(it);
    }
  }
  pump(self);
}

void start_step(decode_actor_t* self) {
  auto& s = self->state;
  // Local prefills take chunks of at most prefill_chunk_tokens per step in all, so the decode
  // sequences beside them are not held up by a long prompt.
  int32_t budget = std::max(1, s.opt.lim.prefill_chunk_tokens);
  std::vector<std::pair<dseq*, int32_t>> chosen;
  for (auto& d : s.running) {
    if (!d.prefilling) {
      chosen.emplace_back(&d, 1);
      continue;
    }
    const int32_t n = std::min(budget, static_cast<int32_t>(d.fill.size()) - d.kv_len);
    if (n <= 0) continue;
    if (d.pages.size() > 1) {
      // Window pools: the blocks this chunk does not read give their pages to those it writes.
      pool_pages freed;
      try {
        rotate_window_pages(s.opt.pools, d.kv_len, d.kv_len + n, d.owned_from, s.page_size(), d.pages, freed);
      } catch (const tandem::error& e) {
        s.free_pages(d.req.id, freed);
        d.aborted = true;  // leaves at the next pump, its pages freed
        s.fail(d, e, "kv_pages");
        continue;
      }
      s.free_pages(d.req.id, freed);
    }
    chosen.emplace_back(&d, n);
    budget -= n;
  }
  for (const auto& [d, n] : chosen) s.in_flight.emplace_back(d->req.id, n);
  // The step message, built once the worker's gate took it.
  auto fill = [&](schema::ForwardBatch::Builder fb) {
    fb.setPhase(schema::StageRole::DECODE);
    auto seqs = fb.initSeqs(static_cast<unsigned>(chosen.size()));
    for (unsigned i = 0; i < chosen.size(); ++i) {
      auto& d = *chosen[i].first;
      const int32_t n = chosen[i].second;
      auto st = seqs[i];
      st.setId(d.req.id);
      const int32_t last = d.req.generated.empty() ? 0 : d.req.generated.back();
      std::span<const int32_t> toks = d.prefilling ? std::span<const int32_t>(d.fill.data() + d.kv_len, size_t(n))
                                                   : std::span<const int32_t>(&last, 1);
      fill_list([&](unsigned k) { return st.initTokens(k); }, toks);
      st.setPos(d.kv_len);
      write_pool_pages(st, d.pages);
      st.setSample(!d.prefilling || d.kv_len + n == static_cast<int32_t>(d.fill.size()));
      write_step_sampling(st, d.req);
    }
  };
  if (!send_forward(self, s.peers.worker, fill,
                    [self](const wire* r, const tandem::error* e) { on_step_done(self, r, e); }))
    return;
  s.busy = true;
  s.steps += 1;
}

void on_alloc(decode_actor_t* self, const wire& w,
              const std::vector<std::pair<std::string, std::vector<int32_t>>>& wants) {
  auto& s = self->state;
  s.busy = false;
  pool_pages pages;
  bool ok = false;
  try {
    wire_reader rd(w);
    auto env = rd.reply();
    if (env.isAllocReply()) {
      s.pool_free_pages = env.getAllocReply().getFree();
      if (env.getAllocReply().getTotal() > 0) s.pool_total_pages = env.getAllocReply().getTotal();
    }
    if (env.isAllocReply() && env.getAllocReply().getOk()) {
      pages = read_pool_pages(env.getAllocReply());
      ok = true;
    }
  } catch (const tandem::error& e) {
    s.log->error("decode: bad allocation reply: {}", e.what());
  }
  if (!ok) {
    preempt_or_fail(self);
    pump(self);
    return;
  }
  std::vector<size_t> next(pages.size(), 0);
  pool_pages spare(pages.size());
  for (const auto& [id, n] : wants) {
    dseq* d = s.find(id);
    if (d && !d->aborted && d->pages.size() < pages.size()) d->pages.resize(pages.size());
    for (size_t p = 0; p < pages.size() && p < n.size(); ++p)
      for (int32_t k = 0; k < n[p] && next[p] < pages[p].size(); ++k, ++next[p]) {
        if (d && !d->aborted)
          d->pages[p].push_back(pages[p][next[p]]);
        else
          spare[p].push_back(pages[p][next[p]]);
      }
  }
  s.free_pages("decode", spare);
  pump(self);
}

void pump_once(decode_actor_t* self);

void pump(decode_actor_t* self) {
  pump_once(self);
  self->state.send_credit(false);
}

void pump_once(decode_actor_t* self) {
  auto& s = self->state;
  start_forks(self);  // n > 1: waiting sequences that have their prompt's KV fork now
  if (s.busy || s.page_stall) return;
  // Aborted sequences not in a batch leave now.
  for (auto it = s.running.begin(); it != s.running.end();) {
    if (it->aborted) {
      s.page_retry_due = true;
      s.free_pages(it->req.id, it->pages);
      it = s.running.erase(it);
    } else {
      ++it;
    }
  }
  // A parked handoff asks again once a sequence has ended (not on preemptions: pages freed to
  // make room for the batch are not for newcomers), or when nothing is left that could free any.
  if (!s.page_waiting.empty() && !s.page_retry_in_flight && (s.page_retry_due || !s.pages_will_free())) {
    s.page_retry_due = false;
    s.page_retry_in_flight = true;
    dseq q = std::move(s.page_waiting.front());
    s.page_waiting.pop_front();
    request_handoff_pages(self, std::move(q));
  }
  while (!s.waiting.empty() && static_cast<int32_t>(s.running.size()) < s.opt.lim.max_running_seqs) {
    s.running.push_back(std::move(s.waiting.front()));
    s.waiting.pop_front();
    s.joined += 1;
  }
  if (s.running.empty()) return;
  std::vector<std::pair<std::string, std::vector<int32_t>>> wants;
  int32_t total = 0;
  std::vector<int32_t> totals;
  for (const auto& d : s.running) {
    auto n = s.pool_pages_needed(d);
    int32_t any = 0;
    for (auto x : n) any += x;
    if (any > 0) {
      if (totals.size() < n.size()) totals.resize(n.size(), 0);
      for (size_t p = 0; p < n.size(); ++p) totals[p] += n[p];
      total += any;
      wants.emplace_back(d.req.id, std::move(n));
    }
  }
  if (total == 0) {
    start_step(self);
    return;
  }
  auto ticket = s.peers.cache.admit<msg::alloc>();
  if (!ticket) {
    // Treat a full cache-tier mailbox like an empty pool: shed the youngest.
    preempt_or_fail(self);
    pump(self);
    return;
  }
  s.busy = true;
  auto fill = [&](schema::AllocRequest::Builder a) {
    a.setId(wants.front().first);
    a.setCount(totals.empty() ? 0 : totals[0]);
    if (totals.size() > 1) {
      auto xc = a.initExtraCounts(static_cast<unsigned>(totals.size() - 1));
      for (size_t p = 1; p < totals.size(); ++p) xc.set(static_cast<unsigned>(p - 1), totals[p]);
    }
  };
  s.peers.cache.call<msg::alloc>(
      self, std::move(ticket), fill, [self, wants](const wire& r) { on_alloc(self, r, wants); },
            [self](caf::error& e) {
              auto& st = self->state;
              st.busy = false;
              st.log->error("decode: cache tier unreachable: {}", self->system().render(e));
              tandem::error te(error_kind::disconnected, "cache tier unreachable");
              for (auto& d : st.running) st.fail(d, te, "cache_error");
              st.running.clear();
            });
}

}  // namespace tandem::decode_detail
