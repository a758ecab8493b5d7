/// The prefill scheduler's batch: pages acquired, window pages rotated per chunk, chunked
/// forward batches, the first token, the handoff to decode (same node or a KV transfer).
#include "actors/prefill_scheduler/prefill_state.h"

namespace tandem::prefill_detail {

void on_acquired(prefill_actor_t* self, const wire& w) {
  auto& s = self->state;
  pseq q = std::move(*s.acquiring);
  s.acquiring.reset();
  try {
    wire_reader rd(w);
    auto env = rd.reply();
    if (!env.isAcquireReply()) {
      auto e = env.isError() ? read_error(env.getError())
                             : tandem::error(error_kind::failed, "cache tier sent an unexpected reply");
      s.fail(q, e, "cache_error");
      return;
    }
    auto r = env.getAcquireReply();
    if (r.getOk()) {
      q.pages = read_pool_pages(r);
      q.owned_from = r.getCachedTokens() / s.page_size();
      if (q.aborted) {
        s.free_pages(q.req.id, q.pages);
        return;
      }
      q.computed = r.getCachedTokens();
      if (!q.requeued) q.req.cached_tokens = r.getCachedTokens();
      q.start_ms = s.clk->now_ms();
      if (!q.requeued) s.queue_wait_ms.observe(double(q.start_ms - q.arrival_ms));
      s.log->debug("request {}: prefill starts ({} tokens, {} cached)", q.req.id, q.tokens.size(),
                   q.computed);
      s.emit_event(q, {}, finish_reason::none, nullptr, request_stage::prefill);
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

void finish_prefill(prefill_actor_t* self, pseq& q, int32_t token, const token_logprobs* lp) {
  auto& s = self->state;
  const int32_t computed = q.computed;
  // Window blocks the next token does not read go back before the cache sees the tables.
  // n > 1: the forks recompute the last prompt position, which reads one position further back.
  {
    pool_pages dead;
    const int64_t next = int64_t(q.tokens.size()) - (q.req.n > 1 ? 1 : 0);
    if (release_dead_pages(s.opt.pools, next, q.pages, dead) > 0) s.free_pages(q.req.id, dead);
  }
  // Cache the full pages of what was computed before ownership moves on.
  if (s.opt.lim.prefix_cache) {
    s.peers.cache.send<msg::insert>(self, [&](schema::InsertPrefix::Builder ins) {
      ins.setId(q.req.id);
      fill_list([&](unsigned n) { return ins.initTokens(n); }, q.tokens);
      write_pool_pages(ins, q.pages);
    });
  }
  if (!q.requeued && q.start_ms >= 0) s.compute_ms.observe(double(s.clk->now_ms() - q.start_ms));
  auto reason = apply_token(q.req, token, s.opt.model);
  std::vector<int32_t> out;
  if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(token);
  // The token's log-probabilities travel with it (none for a stop token, which is not emitted).
  std::span<const token_logprobs> lps;
  if (lp && !out.empty() && q.req.logprobs >= 0) lps = std::span<const token_logprobs>(lp, 1);
  if (reason != finish_reason::none && q.req.n > 1 && q.req.choice == 0) {
    // n choices: choice 0 ended at its first token, but its forks still need the prompt's KV.
    // Its end goes out now; the handoff carries the KV for the forks alone (decode_fork.cpp).
    s.emit_event(q, out, reason, nullptr, request_stage::decode, lps);
    if (q.req.generated.empty()) q.req.generated.push_back(token);  // the handoff's shape: KV + one token
    q.req.fork_only = true;
  } else if (reason != finish_reason::none) {
    s.free_pages(q.req.id, q.pages);
    s.emit_event(q, out, reason, nullptr, request_stage::prefill, lps);
    return;
  } else {
    s.emit_event(q, out, finish_reason::none, nullptr, request_stage::decode, lps);
  }
  auto ticket = s.peers.decode.admit<msg::handoff>();
  if (!ticket) {
    s.fail(q, s.peers.decode.gate->overloaded_error(), "decode_mailbox");
    return;
  }
  // Across nodes the decode scheduler allocates its own pages and pulls the KV with this
  // transfer id; the worker writes this node's pages there and frees them when it is done.
  const uint64_t tid = s.opt.remote_decode_node.empty() ? 0 : s.transfer_ids->next();
  s.handoffs += 1;
  if (tid != 0) {
    // The decode node the router chose ("node/decode"), or the configured first one. The
    // handoff names it too, so the decode proxy delivers it where the pages go.
    auto& dt = q.req.decode_target;
    if (dt.empty()) dt = s.opt.remote_decode_node + "/decode";
    const auto slash = dt.rfind('/');
    const std::string dst = slash == std::string::npos ? dt : dt.substr(0, slash);
    // "Hand these pages of request R to node X": they are the worker's from now on.
    s.peers.worker.send<msg::kv_send>(self, [&](schema::KvTransferOrder::Builder o) {
      o.setTransferId(tid);
      o.setId(q.req.id);
      o.setPeerNode(dst);
      write_pool_pages(o, q.pages);
    });
  }
  if (tid == 0) s.local_handoffs += 1;
  s.peers.decode.send<msg::handoff>(self, std::move(ticket), [&](schema::KvHandoff::Builder h) {
               h.setHandoffSeq(s.next_handoff++);
               q.req.write(h.initRequest());
               auto kv = h.initKv();
               kv.setPoolId(s.opt.pool_id);
               kv.setNode(s.opt.node);
               fill_list([&](unsigned n) { return kv.initPageIds(n); }, q.pages.empty() ? std::vector<int32_t>{} : q.pages[0]);
               write_extra_pools(kv, q.pages);
               write_kv_pools_layout(kv.initLayout(), s.opt.pools);
               kv.setValidTokens(computed);
               h.setTransferId(tid);
             });
  q.pages.clear();  // ownership moved to the decode scheduler (same node) or the worker
}

void on_forward_done(prefill_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  const std::vector<token_logprobs> lps = w && !err ? read_forward_logprobs(*w) : std::vector<token_logprobs>{};
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
      finish_prefill(self, *it, i < sampled.size() ? sampled[i] : -1, i < lps.size() ? &lps[i] : nullptr);
      s.active.erase(it);
    }
  }
  if (!err)
    for (const auto& b : batch) s.drain_pending_tokens += b.second;
  pump(self);
}

void start_batch(prefill_actor_t* self) {
  auto& s = self->state;
  int32_t budget = s.opt.lim.prefill_chunk_tokens;
  std::vector<pseq*> chosen;
  std::vector<int32_t> counts;
  for (;;) {
    chosen.clear();
    counts.clear();
    budget = s.opt.lim.prefill_chunk_tokens;
    std::optional<std::pair<std::string, tandem::error>> broken;
    for (auto& q : s.active) {
      if (budget <= 0) break;
      const int32_t left = static_cast<int32_t>(q.tokens.size()) - q.computed;
      const int32_t n = std::min(left, budget);
      if (n <= 0) continue;
      if (q.pages.size() > 1) {
        // Window pools: the blocks this chunk does not read give their pages to those it writes.
        pool_pages freed;
        try {
          rotate_window_pages(s.opt.pools, q.computed, q.computed + n, q.owned_from, s.page_size(), q.pages, freed);
        } catch (const tandem::error& e) {
          broken.emplace(q.req.id, e);
        }
        s.free_pages(q.req.id, freed);
        if (broken) break;
      }
      chosen.push_back(&q);
      counts.push_back(n);
      budget -= n;
    }
    if (!broken) break;
    // A sequence whose pages do not cover its chunk ends (a bug if it ever happens: the
    // acquisition sizes the window pages); the selection runs again without it.
    auto it = std::find_if(s.active.begin(), s.active.end(), [&](const pseq& q) { return q.req.id == broken->first; });
    s.fail(*it, broken->second, "kv_pages");
    s.active.erase(it);
  }
  if (chosen.empty()) return;
  for (unsigned i = 0; i < chosen.size(); ++i) s.in_flight.emplace_back(chosen[i]->req.id, counts[i]);
  // The batch message, built once the worker's gate took it.
  auto fill = [&](schema::ForwardBatch::Builder fb) {
    fb.setPhase(schema::StageRole::PREFILL);
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
      write_pool_pages(st, first_blocks(q.pages, n_pages));
      const bool last = end == static_cast<int32_t>(q.tokens.size());
      st.setSample(last);
      // Only the sampling step needs the sampling (and the penalties their history).
      if (last) write_step_sampling(st, q.req);
      else st.setTokenIndex(static_cast<int32_t>(q.req.generated.size()));
    }
  };
  // On a refusal the batch's sequences end with the error (on_forward_done takes `in_flight`);
  // clearing it first failed nobody and pump() retried at once, recursing while the mailbox
  // stayed full.
  if (!send_forward(self, s.peers.worker, fill,
                    [self](const wire* r, const tandem::error* e) { on_forward_done(self, r, e); }))
    return;
  s.busy = true;
  s.batches += 1;
}


}  // namespace tandem::prefill_detail
