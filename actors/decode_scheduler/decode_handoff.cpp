/// KV handoffs into the decode scheduler: same-node page moves, cross-node transfers (destination
/// pages, the receive order, its end), requeue and the transfer failure policy.
#include "actors/decode_scheduler/decode_state.h"

namespace tandem::decode_detail {

/// Sends `d` back for recompute (prompt ++ generated) through the router, after its
/// "preempted" event. The router places it on a prefill target it knows to be alive: this
/// node may not know yet that a prefill node died (a failed KV transfer from it is often the
/// first sign here), and a requeue sent to a dead node would be lost with nobody to end it.
void requeue(decode_actor_t* self, const dseq& d) {
  auto& s = self->state;
  // Control (already admitted: must not be dropped), as the table in protocol.h says.
  s.peers.router.send<msg::requeue>(self, [&](schema::SubmitRequest::Builder b) { d.req.write(b); });
}

/// A cross-node handoff whose KV transfer failed (or could not start): the configured policy.
void transfer_failed(decode_actor_t* self, dseq d, const std::string& why) {
  auto& s = self->state;
  s.transfers_failed += 1;
  s.free_pages(d.req.id, d.pages);
  if (d.aborted) return;
  // n > 1 is not recomputed (its first token went out; the forks need a fresh prefill): it fails.
  const bool recompute = s.opt.transfer_failure_policy == kv_failure_policy::recompute;
  if (recompute && d.req.n <= 1 &&
      d.req.transfer_retries < s.opt.max_transfer_retries) {
    s.transfer_recomputes += 1;
    d.req.transfer_retries += 1;
    s.log->info("request {}: KV transfer from node {} failed ({}); re-prefilling (retry {} of {})", d.req.id,
                d.source_node, why, d.req.transfer_retries, s.opt.max_transfer_retries);
    // Like a preemption: the tokens so far were emitted; prefill recomputes prompt ++ generated.
    s.emit(d, {}, finish_reason::none, nullptr, request_stage::preempted);
    requeue(self, d);
    return;
  }
  s.rejected["kv_transfer"] += 1;
  s.fail(d,
         tandem::error(error_kind::disconnected,
                       fmt::format("KV transfer of request {} from prefill node {} to decode node {} failed: {}{}; "
                                   "retry the request",
                                   d.req.id, d.source_node, s.opt.node, why,
                                   recompute ? fmt::format(" (after {} re-prefills)", d.req.transfer_retries)
                                       : std::string(" (transfer.failure_policy = fail)"))),
         "kv_transfer");
}

/// Destination pages for a cross-node handoff, then the transfer order to the worker.
void start_remote_handoff(decode_actor_t* self, dseq d, uint64_t tid, std::string source,
                          const kv_pools_layout& got) {
  auto& s = self->state;
  d.transfer_id = tid;
  d.source_node = std::move(source);
  d.source_pages = static_cast<int32_t>(blocks_of(d.pages));
  d.source = std::move(d.pages);  // the source's page ids: not ours (their -1s say which blocks move)
  d.pages.clear();
  const kv_pools_layout& here = s.opt.pools;
  if (!(got == here) || d.source.size() != here.pools.size()) {
    const std::string why = got.pools.empty() ? std::string("the handoff's KV layout is malformed")
                            : !(got == here)  ? explain_kv_pools_mismatch(here, got, "the source node " + d.source_node)
                                              : fmt::format("the handoff carries pages of {} pools, the layout has {}",
                                                            d.source.size(), here.pools.size());
    transfer_failed(self, std::move(d), fmt::format("KV layout of the source differs: {}", why));
    return;
  }
  const int32_t need = (d.kv_len + s.page_size() - 1) / s.page_size();
  if (d.kv_len != d.total_len() - 1 || need != d.source_pages || s.allocating.count(d.req.id)) {
    transfer_failed(self, std::move(d),
                    fmt::format("handoff with {} valid tokens in {} pages for {} tokens of sequence", d.kv_len,
                                d.source_pages, d.total_len()));
    return;
  }
  request_handoff_pages(self, std::move(d));
}

/// Tells the source node to let go of a handoff's pages (its transfer will not happen).
void release_source(decode_actor_t* self, const dseq& q) {
  auto& st = self->state;
  st.peers.prefill.send<msg::abort>(self, [&](schema::Abort::Builder a) {
    a.setId(q.req.id);
    a.setHops(8);  // only the prefill's transfer: do not chase it back here
  });
}

/// Destination pages for a validated handoff; a full pool parks it (see page_waiting).
void request_handoff_pages(decode_actor_t* self, dseq d) {
  auto& s = self->state;
  const int32_t need = d.source_pages;
  const std::vector<int32_t> held = pages_held(d.source);
  auto ticket = s.peers.cache.admit<msg::alloc>();
  if (!ticket) {
    release_source(self, d);
    transfer_failed(self, std::move(d), "the cache tier's mailbox is full");
    return;
  }
  std::string id = d.req.id;
  s.allocating.emplace(id, std::move(d));
  auto fill = [&](schema::AllocRequest::Builder a) {
    a.setId(id);
    a.setCount(need);
    if (held.size() > 1) {
      auto xc = a.initExtraCounts(static_cast<unsigned>(held.size() - 1));
      for (size_t p = 1; p < held.size(); ++p) xc.set(static_cast<unsigned>(p - 1), held[p]);
    }
  };
  s.peers.cache.call<msg::alloc>(
          self, std::move(ticket), fill,
          [self, id](const wire& r) {
            auto& st = self->state;
            auto it = st.allocating.find(id);
            if (it == st.allocating.end()) return;
            dseq q = std::move(it->second);
            st.allocating.erase(it);
            const bool retry = q.parked;
            if (retry) st.page_retry_in_flight = false;
            std::string why = "no free KV pages on the decode node";
            bool exhausted = false;
            try {
              wire_reader rd(r);
              auto env = rd.reply();
              if (env.isAllocReply()) st.pool_free_pages = env.getAllocReply().getFree();
              if (env.isAllocReply() && env.getAllocReply().getOk()) {
                // Our pages on the blocks the source sends: the same -1s as its tables.
                pool_pages got = read_pool_pages(env.getAllocReply());
                q.pages.assign(q.source.size(), {});
                for (size_t p = 0; p < q.source.size(); ++p) {
                  size_t k = 0;
                  for (auto x : q.source[p])
                    q.pages[p].push_back(x < 0 || p >= got.size() || k >= got[p].size() ? -1 : got[p][k++]);
                }
                why.clear();
              } else if (env.isAllocReply()) {
                auto e = read_error(env.getAllocReply().getError());
                why = e.what();
                exhausted = e.kind() == error_kind::overloaded;
              }
            } catch (const tandem::error& e) {
              why = e.what();
            }
            if (q.aborted) {
              st.free_pages(q.req.id, q.pages);
              release_source(self, q);
              pump(self);
              return;
            }
            // A full pool while sequences here will end and free pages: wait for them instead
            // of failing (a preempted sequence's recompute lands here while its batch is busy,
            // or while the pages are held by handoffs whose KV is still arriving).
            const bool can_free = st.pages_will_free();
            if (!why.empty() && exhausted && can_free &&
                (retry || static_cast<int32_t>(st.page_waiting.size()) < st.opt.lim.max_running_seqs)) {
              if (!q.parked) {
                st.handoffs_parked += 1;
                st.log->info("request {}: no KV pages for its handoff yet ({}); it waits for a sequence to end",
                             q.req.id, why);
              }
              q.parked = true;
              if (retry)
                st.page_waiting.push_front(std::move(q));
              else
                st.page_waiting.push_back(std::move(q));
              st.send_credit(false);
              return;
            }
            if (!why.empty()) {
              release_source(self, q);
              transfer_failed(self, std::move(q), why);
              pump(self);
              return;
            }
            const uint64_t tid = q.transfer_id;
            st.peers.worker.send<msg::kv_receive>(self, [&](schema::KvTransferOrder::Builder o) {
              o.setTransferId(tid);
              o.setId(q.req.id);
              o.setPeerNode(q.source_node);
              write_pool_pages(o, q.pages);
            });
            st.receiving.emplace(tid, std::move(q));
            if (retry) pump(self);  // the next parked one may fit too
          },
          [self, id](caf::error& e) {
            auto& st = self->state;
            auto it = st.allocating.find(id);
            if (it == st.allocating.end()) return;
            dseq q = std::move(it->second);
            st.allocating.erase(it);
            if (q.parked) st.page_retry_in_flight = false;
            release_source(self, q);
            transfer_failed(self, std::move(q), fmt::format("cache tier unreachable: {}", self->system().render(e)));
          });
}

/// The worker's answer for a transfer: the KV is in the pages (join the batch) or it failed.
void on_kv_done(decode_actor_t* self, schema::KvTransferDone::Reader k) {
  auto& s = self->state;
  auto it = s.receiving.find(k.getTransferId());
  if (it == s.receiving.end()) {
    s.log->warn("kv transfer {:#x}: completion for no handoff of this scheduler ignored", k.getTransferId());
    return;
  }
  dseq d = std::move(it->second);
  s.receiving.erase(it);
  d.pages = read_pool_pages(k);
  if (d.aborted || !k.getDelivered()) {
    // Its pages come back: a parked handoff may fit now (it waited for them).
    if (d.aborted) s.free_pages(d.req.id, d.pages);
    else transfer_failed(self, std::move(d), k.getError().cStr());
    s.page_retry_due = true;
    pump(self);
    return;
  }
  s.transfers_done += 1;
  s.waiting.push_back(std::move(d));
  pump(self);
}

void on_handoff(decode_actor_t* self, schema::KvHandoff::Reader h) {
  auto& s = self->state;
  dseq d;
  d.req = seq_request::read(h.getRequest());
  // A link that delivers twice (a retry across nodes) must not make two sequences share the
  // pages. A copy of a handoff already taken (even one whose sequence has ended since) is
  // ignored; a second computation of a sequence held here (a duplicated submission) is freed.
  const std::string key = fmt::format("{}/{}", h.getKv().getNode().cStr(), h.getHandoffSeq());
  if (s.taken_handoffs.count(key)) {
    s.rejected["duplicate_handoff"] += 1;
    s.log->warn("request {}: copy of KV handoff {} ignored", d.req.id, key);
    return;
  }
  s.taken_handoffs.insert(key);
  s.taken_order.push_back(key);
  if (s.taken_order.size() > decode_state::handoff_window) {
    s.taken_handoffs.erase(s.taken_order.front());
    s.taken_order.pop_front();
  }
  bool held = s.find(d.req.id) != nullptr;
  for (const auto& x : s.waiting) held = held || x.req.id == d.req.id;
  if (held) {
    s.rejected["duplicate_handoff"] += 1;
    s.log->warn("request {}: second KV handoff of a running sequence; its pages are freed", d.req.id);
    auto pages = read_pool_pages(h.getKv().getPageIds(), h.getKv());
    s.free_pages(d.req.id, pages);
    return;
  }
  auto kv = h.getKv();
  d.pages = read_pool_pages(kv.getPageIds(), kv);
  d.kv_len = kv.getValidTokens();
  kv_pools_layout got;  // a malformed layout stays empty: refused below as differing from ours
  try {
    got = read_kv_pools_layout(kv.getLayout());
  } catch (const tandem::error& e) {
    s.log->warn("request {}: KV handoff with a malformed layout: {}", d.req.id, e.what());
  }
  if (h.getTransferId() != 0) {
    start_remote_handoff(self, std::move(d), h.getTransferId(), kv.getNode().cStr(), got);
    return;
  }
  if (std::string(kv.getPoolId().cStr()) != s.opt.pool_id || !(got == s.opt.pools) ||
      d.pages.size() != s.opt.pools.pools.size()) {
    // Cross-pool handoff needs a KV transfer this build does not do; the pages stay where they are.
    tandem::error e(
        error_kind::unimplemented,
        fmt::format("KV handoff from pool {} ({}) to pool {} ({}) needs a page transfer, which is not "
                    "implemented; run prefill and decode on the same worker",
                    kv.getPoolId().cStr(), got.describe(), s.opt.pool_id, s.opt.pools.describe()));
    d.pages.clear();
    s.fail(d, e, "handoff");
    return;
  }
  if (d.kv_len != d.total_len() - 1) {
    s.fail(d,
           tandem::error(error_kind::failed,
                         fmt::format("handoff with {} valid tokens for {} tokens of sequence", d.kv_len,
                                     d.total_len())),
           "handoff");
    return;
  }
  s.waiting.push_back(std::move(d));
  pump(self);
}

}  // namespace tandem::decode_detail
