#include "actors/decode_scheduler/decode_scheduler.h"

#include <fmt/format.h>

#include <algorithm>
#include <caf/all.hpp>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

namespace {

struct dseq {
  seq_request req;
  std::vector<int32_t> pages;
  int32_t kv_len = 0;  ///< positions with KV; the last token (tokens.back()) is the next input
  bool aborted = false;
  int32_t total_len() const { return req.total_len(); }
};

struct decode_state {
  scheduler_options opt;
  peer_set peers;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<const cluster_clock> clk;
  std::shared_ptr<spdlog::logger> log;
  std::vector<dseq> running;
  std::deque<dseq> waiting;  ///< handed off, holding pages, waiting for a batch slot
  bool busy = false;         ///< an allocation or a forward is outstanding
  std::vector<std::string> in_flight;
  int64_t steps = 0, tokens = 0, preemptions = 0, joined = 0;
  std::unordered_map<std::string, int64_t> rejected;
  /// The last `handoff_window` handoffs taken ("node/seq"), to recognize a link's late copies.
  static constexpr size_t handoff_window = 4096;
  std::unordered_set<std::string> taken_handoffs;
  std::deque<std::string> taken_order;
  static inline const char* name = "decode";

  int32_t page_size() const { return opt.layout.page_size; }
  int64_t running_tokens() const {
    int64_t t = 0;
    for (const auto& d : running) t += d.kv_len;
    return t;
  }
  int32_t pages_needed(const dseq& d) const {
    return (d.kv_len + 1 + page_size() - 1) / page_size() - static_cast<int32_t>(d.pages.size());
  }
  void emit(const dseq& d, const std::vector<int32_t>& toks, finish_reason reason, const tandem::error* err,
            const char* state) {
    peers.router.gate->enter_control();
    caf::anon_send(peers.router.handle, wire_atom::value,
                   make_event(d.req.id, toks, reason, err, static_cast<int32_t>(d.req.prompt.size()),
                              d.req.cached_tokens, state,
                              static_cast<int32_t>(d.req.generated.size() - toks.size())));
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
  void fail(dseq& d, const tandem::error& e, const std::string& reason) {
    rejected[reason] += 1;
    log->info("request {}: {}", d.req.id, e.what());
    free_pages(d.req.id, d.pages);
    emit(d, {}, finish_reason::error, &e, "decode");
  }
  dseq* find(const std::string& id) {
    for (auto& d : running)
      if (d.req.id == id) return &d;
    return nullptr;
  }
};

using decode_actor_t = caf::stateful_actor<decode_state>;

void pump(decode_actor_t* self);

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
    auto pages = to_vector(h.getKv().getPageIds());
    s.free_pages(d.req.id, pages);
    return;
  }
  auto kv = h.getKv();
  d.pages = to_vector(kv.getPageIds());
  d.kv_len = kv.getValidTokens();
  auto l = kv.getLayout();
  kv_layout got{l.getNLayers(), l.getNKvHeads(), l.getHeadDim(), l.getPageSize()};
  if (std::string(kv.getPoolId().cStr()) != s.opt.pool_id || !(got == s.opt.layout)) {
    // Cross-pool handoff needs a KV transfer this build does not do; the pages stay where they are.
    tandem::error e(
        error_kind::unimplemented,
        fmt::format("KV handoff from pool {} ({}) to pool {} ({}) needs a page transfer, which is not "
                    "implemented; run prefill and decode on the same worker",
                    kv.getPoolId().cStr(), got.describe(), s.opt.pool_id, s.opt.layout.describe()));
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

/// Frees the pages of the youngest sequence and sends it back for recompute; false if
/// `needy` is the only candidate (then it fails instead).
void preempt_or_fail(decode_actor_t* self) {
  auto& s = self->state;
  const size_t candidates = s.running.size() + s.waiting.size();
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
  if (candidates == 1) {
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
  s.emit(victim, {}, finish_reason::none, nullptr, "preempted");
  s.peers.prefill.gate->enter_control();  // already admitted: must not be dropped
  self->send(s.peers.prefill.handle, wire_atom::value,
             make_wire([&](schema::Envelope::Builder env) { victim.req.write(env.initRequeue()); }));
}

void on_step_done(decode_actor_t* self, const wire* w, const tandem::error* transport_err) {
  auto& s = self->state;
  s.busy = false;
  auto batch = std::move(s.in_flight);
  s.in_flight.clear();
  std::vector<int32_t> sampled;
  std::optional<tandem::error> err = read_forward_result(w, transport_err, sampled);
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it =
        std::find_if(s.running.begin(), s.running.end(), [&](const dseq& d) { return d.req.id == batch[i]; });
    if (it == s.running.end()) continue;
    if (it->aborted) {
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
    it->kv_len += 1;
    s.tokens += 1;
    const int32_t tok = sampled[i];
    auto reason = apply_token(it->req, tok, s.opt.model);
    std::vector<int32_t> out;
    if (reason == finish_reason::none || reason == finish_reason::length) out.push_back(tok);
    s.emit(*it, out, reason, nullptr, "decode");
    if (reason != finish_reason::none) {
      // Cache prompt ++ generated (the next turn of a conversation starts with them) before
      // the pages go back; the cache takes its own references.
      if (s.opt.lim.prefix_cache) {
        auto all = it->req.all_tokens();
        all.resize(static_cast<size_t>(std::min<int64_t>(int64_t(all.size()), it->kv_len)));
        s.peers.cache.gate->enter_control();
        caf::anon_send(s.peers.cache.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                         auto ins = env.initInsert();
                         ins.setId(it->req.id);
                         fill_list([&](unsigned n) { return ins.initTokens(n); }, all);
                         fill_list([&](unsigned n) { return ins.initPages(n); }, it->pages);
                       }));
      }
      s.free_pages(it->req.id, it->pages);
      s.running.erase(it);
    }
  }
  pump(self);
}

void start_step(decode_actor_t* self) {
  auto& s = self->state;
  capnp::MallocMessageBuilder mb;
  auto fb = mb.initRoot<schema::Envelope>().initForward();
  fb.setPhase("decode");
  auto seqs = fb.initSeqs(static_cast<unsigned>(s.running.size()));
  for (unsigned i = 0; i < s.running.size(); ++i) {
    auto& d = s.running[i];
    auto st = seqs[i];
    st.setId(d.req.id);
    const int32_t last = d.req.generated.back();
    fill_list([&](unsigned n) { return st.initTokens(n); }, std::span<const int32_t>(&last, 1));
    st.setPos(d.kv_len);
    fill_list([&](unsigned n) { return st.initPages(n); }, d.pages);
    st.setSample(true);
    auto sp = st.initSampling();
    sp.setTemperature(d.req.sampling.temperature);
    sp.setTopK(d.req.sampling.top_k);
    sp.setTopP(d.req.sampling.top_p);
    sp.setSeed(d.req.sampling.seed);
    st.setTokenIndex(static_cast<int32_t>(d.req.generated.size()));
    s.in_flight.push_back(d.req.id);
  }
  if (!s.peers.worker.gate->try_enter()) {
    auto e = s.peers.worker.gate->overloaded_error();
    on_step_done(self, nullptr, &e);
    return;
  }
  s.busy = true;
  s.steps += 1;
  self->request(s.peers.worker.handle, caf::infinite, call_atom::value, make_wire(mb))
      .then([self](const wire& r) { on_step_done(self, &r, nullptr); },
            [self](caf::error& e) {
              tandem::error te(error_kind::disconnected,
                               fmt::format("worker unreachable: {}", self->system().render(e)));
              on_step_done(self, nullptr, &te);
            });
}

void on_alloc(decode_actor_t* self, const wire& w,
              const std::vector<std::pair<std::string, int32_t>>& wants) {
  auto& s = self->state;
  s.busy = false;
  std::vector<int32_t> pages;
  bool ok = false;
  try {
    wire_reader rd(w);
    auto env = rd.root();
    if (env.isAllocReply() && env.getAllocReply().getOk()) {
      pages = to_vector(env.getAllocReply().getPages());
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
  size_t next = 0;
  std::vector<int32_t> spare;
  for (const auto& [id, n] : wants) {
    dseq* d = s.find(id);
    for (int32_t k = 0; k < n && next < pages.size(); ++k, ++next) {
      if (d && !d->aborted)
        d->pages.push_back(pages[next]);
      else
        spare.push_back(pages[next]);
    }
  }
  s.free_pages("decode", spare);
  pump(self);
}

void pump(decode_actor_t* self) {
  auto& s = self->state;
  if (s.busy) return;
  // Aborted sequences not in a batch leave now.
  for (auto it = s.running.begin(); it != s.running.end();) {
    if (it->aborted) {
      s.free_pages(it->req.id, it->pages);
      it = s.running.erase(it);
    } else {
      ++it;
    }
  }
  while (!s.waiting.empty() && static_cast<int32_t>(s.running.size()) < s.opt.lim.max_running_seqs) {
    s.running.push_back(std::move(s.waiting.front()));
    s.waiting.pop_front();
    s.joined += 1;
  }
  if (s.running.empty()) return;
  std::vector<std::pair<std::string, int32_t>> wants;
  int32_t total = 0;
  for (const auto& d : s.running) {
    const int32_t n = s.pages_needed(d);
    if (n > 0) {
      wants.emplace_back(d.req.id, n);
      total += n;
    }
  }
  if (total == 0) {
    start_step(self);
    return;
  }
  if (!s.peers.cache.gate->try_enter()) {
    // Treat a full cache-tier mailbox like an empty pool: shed the youngest.
    preempt_or_fail(self);
    pump(self);
    return;
  }
  s.busy = true;
  auto w = make_wire([&](schema::Envelope::Builder env) {
    auto a = env.initAlloc();
    a.setId(wants.front().first);
    a.setCount(total);
  });
  self->request(s.peers.cache.handle, caf::infinite, call_atom::value, std::move(w))
      .then([self, wants](const wire& r) { on_alloc(self, r, wants); },
            [self](caf::error& e) {
              auto& st = self->state;
              st.busy = false;
              st.log->error("decode: cache tier unreachable: {}", self->system().render(e));
              tandem::error te(error_kind::disconnected, "cache tier unreachable");
              for (auto& d : st.running) st.fail(d, te, "cache_error");
              st.running.clear();
            });
}

void on_abort(decode_actor_t* self, const std::string& id, int32_t hops) {
  auto& s = self->state;
  for (auto it = s.waiting.begin(); it != s.waiting.end(); ++it) {
    if (it->req.id != id) continue;
    s.free_pages(id, it->pages);
    s.waiting.erase(it);
    return;
  }
  if (dseq* d = s.find(id)) {
    s.log->info("request {}: decode aborted after {} tokens", id, d->req.generated.size());
    d->aborted = true;  // leaves at the next pump (after the batch in flight, if any)
    pump(self);
    return;
  }
  if (hops < 8) {  // on its way back to prefill (preempted): follow it
    s.peers.prefill.gate->enter_control();
    self->send(s.peers.prefill.handle, wire_atom::value, make_wire([&](schema::Envelope::Builder env) {
                 auto a = env.initAbort();
                 a.setId(id);
                 a.setHops(hops + 1);
               }));
  }
}

caf::behavior decode_actor(decode_actor_t* self, scheduler_options opt, std::shared_ptr<mailbox_gate> gate,
                           std::shared_ptr<const cluster_clock> clk, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.gate = std::move(gate);
  st.clk = std::move(clk);
  st.log = std::move(log);
  return {
      [self](peers_atom, const peer_set& p) { self->state.peers = p; },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isHandoff())
            on_handoff(self, env.getHandoff());
          else if (env.isAbort())
            on_abort(self, env.getAbort().getId().cStr(), env.getAbort().getHops());
          else
            s.log->error("decode: unexpected message dropped");
        } catch (const tandem::error& e) {
          s.log->error("decode: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("decode: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"decode_running_requests", "", double(s.running.size()), "gauge",
             "Sequences in the decode batch"},
            {"decode_running_tokens", "", double(s.running_tokens()), "gauge",
             "Context tokens (with KV) of the sequences in the decode batch"},
            {"decode_running_bound", "", double(s.opt.lim.max_running_seqs), "gauge",
             "limits.max_running_seqs"},
            {"decode_waiting_requests", "", double(s.waiting.size()), "gauge",
             "Handed-off sequences waiting for a batch slot"},
            {"decode_steps_total", "", double(s.steps), "counter", "Decode forward steps"},
            {"decode_tokens_total", "", double(s.tokens), "counter", "Tokens sampled by decode steps"},
            {"decode_preemptions_total", "", double(s.preemptions), "counter",
             "Sequences preempted on KV page exhaustion (requeued for recompute)"},
        };
        for (const auto& [r, n] : s.rejected)
          m.push_back({"rejections_total", fmt::format("actor=\"decode\",reason=\"{}\"", r), double(n),
                       "counter", "Requests refused or ended early, by reason"});
        return make_stats_wire("decode", m, {});
      },
  };
}

}  // namespace

bounded_actor spawn_decode_scheduler(caf::actor_system& sys, const scheduler_options& opt,
                                     std::shared_ptr<const cluster_clock> clk,
                                     std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("decode", opt.lim.decode_mailbox);
  auto h = sys.spawn(decode_actor, opt, gate, std::move(clk), std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
