/// n > 1 (OpenAI's n): the decode scheduler forks a handed-off sequence into n once it has the
/// prompt's KV and its first token. One prefill ran; each fork k = 1..n-1 shares the prompt's
/// pages before the block of the last prompt position (a reference each), gets its own copy of
/// that block (made by the worker through the cache tier before the fork runs), recomputes the
/// last prompt position in a one-token step and samples its first token there with seed + k
/// (its own RNG stream; choice 0 keeps the request's seed), then decodes on its own: stop
/// tokens, grammar, penalties, logprobs and max_tokens are per fork. Forks are never preempted
/// for recompute: on a full pool the request fails with `overloaded` (the router ends every
/// choice and aborts the rest).
#include "actors/common/seq_fork.h"
#include "actors/decode_scheduler/decode_state.h"

namespace tandem::decode_detail {

namespace {

void on_forked(decode_actor_t* self, const std::string& id, const fork_plan& plan, int32_t forks, const wire* w,
               const std::string& transport_err) {
  auto& s = self->state;
  auto it = s.forking.find(id);
  if (it == s.forking.end()) return;
  dseq p = std::move(it->second);
  s.forking.erase(it);
  std::string why = transport_err;
  pool_pages got;
  if (w) {
    try {
      wire_reader rd(*w);
      auto env = rd.reply();
      if (env.isAllocReply()) {
        auto r = env.getAllocReply();
        s.pool_free_pages = r.getFree();
        if (r.getOk()) got = read_pool_pages(r);
        else why = read_error(r.getError()).what();
      } else {
        why = env.isError() ? read_error(env.getError()).what() : "the cache tier sent an unexpected reply";
      }
    } catch (const tandem::error& e) {
      why = e.what();
    }
  }
  if (!why.empty()) {
    s.fork_failures += 1;
    if (p.aborted) {
      s.page_retry_due = true;
      s.free_pages(p.req.id, p.pages);
    } else {
      s.fail(p,
             tandem::error(error_kind::overloaded,
                           fmt::format("request {}: no KV pages to fork it into n = {} choices on decode node {}: {}; "
                                       "retry later, or with a smaller n",
                                       p.req.id, p.req.n, s.opt.node, why)),
             "fork_pages");
    }
    pump(self);
    return;
  }
  const int32_t prompt_len = static_cast<int32_t>(p.req.prompt.size());
  std::vector<dseq> made;
  made.reserve(size_t(forks));
  for (int32_t k = 1; k <= forks; ++k) {
    dseq f;
    f.req = p.req;
    f.req.id = fmt::format("{}#c{}", id, k);
    f.req.choice = k;
    f.req.fork_only = false;
    f.req.generated.clear();
    f.req.sampling.seed = p.req.sampling.seed + static_cast<uint64_t>(k);
    f.group = id;
    f.fork_first = true;
    f.prefilling = true;
    f.fill = p.req.prompt;
    f.kv_len = prompt_len - 1;
    f.owned_from = static_cast<int32_t>(plan.copy_block);
    const auto copies = fork_copies(plan, got, k - 1);
    f.pages = fork_tables(p.pages, plan, copies);
    made.push_back(std::move(f));
  }
  if (p.aborted) {
    // Every reference the forks took goes back with the sequence's own.
    s.page_retry_due = true;
    for (auto& f : made) s.free_pages(f.req.id, f.pages);
    s.free_pages(p.req.id, p.pages);
    pump(self);
    return;
  }
  s.forks += forks;
  s.log->debug("request {}: forked into {} choices", id, forks + 1);
  if (p.req.fork_only) {
    // Choice 0 ended at its first token (the prefill reported it): only the forks go on.
    s.page_retry_due = true;
    s.free_pages(p.req.id, p.pages);
  } else {
    s.waiting.push_front(std::move(p));
  }
  for (auto& f : made) s.waiting.push_back(std::move(f));
  pump(self);
}

void fork_one(decode_actor_t* self, dseq d) {
  auto& s = self->state;
  const int32_t prompt_len = static_cast<int32_t>(d.req.prompt.size());
  if (d.kv_len != prompt_len || d.req.generated.size() != 1 || prompt_len < 1) {
    s.fail(d,
           tandem::error(error_kind::failed,
                         fmt::format("request {}: cannot fork into n = {} choices: {} tokens with KV of a {}-token "
                                     "prompt and {} generated (a fork needs the prompt's KV and one token)",
                                     d.req.id, d.req.n, d.kv_len, prompt_len, d.req.generated.size())),
           "fork");
    return;
  }
  auto ticket = s.peers.cache.admit<msg::alloc>();
  if (!ticket) {
    s.fail(d, s.peers.cache.gate->overloaded_error(), "cache_mailbox");
    return;
  }
  const int32_t forks = d.req.n - 1;
  const fork_plan plan = plan_fork(d.pages, prompt_len - 1, s.page_size());
  const fork_request fr = make_fork_request(plan, forks);
  const std::string id = d.req.id;
  d.group = id;  // forked: its events and aborts go by the request's id with a choice
  s.forking.emplace(id, std::move(d));
  auto fill = [&](schema::AllocRequest::Builder a) {
    a.setId(id);
    a.setCount(fr.counts.empty() ? 0 : fr.counts[0]);
    if (fr.counts.size() > 1) {
      auto xc = a.initExtraCounts(static_cast<unsigned>(fr.counts.size() - 1));
      for (size_t p = 1; p < fr.counts.size(); ++p) xc.set(static_cast<unsigned>(p - 1), fr.counts[p]);
    }
    auto put = [](auto init0, auto initx, const pool_pages& pp) {
      if (pp.empty()) return;
      fill_list(init0, pp[0]);
      if (pp.size() < 2) return;
      auto ex = initx(static_cast<unsigned>(pp.size() - 1));
      for (size_t k = 1; k < pp.size(); ++k)
        fill_list([&](unsigned n) { return ex[static_cast<unsigned>(k - 1)].initPages(n); }, pp[k]);
    };
    put([&](unsigned n) { return a.initHolds(n); }, [&](unsigned n) { return a.initExtraHolds(n); }, fr.holds);
    put([&](unsigned n) { return a.initCopyFrom(n); }, [&](unsigned n) { return a.initExtraCopyFrom(n); },
        fr.copy_from);
  };
  s.peers.cache.call<msg::alloc>(
      self, std::move(ticket), fill, [self, id, plan, forks](const wire& r) { on_forked(self, id, plan, forks, &r, ""); },
      [self, id, plan, forks](caf::error& e) {
        on_forked(self, id, plan, forks, nullptr, fmt::format("cache tier unreachable: {}", self->system().render(e)));
      });
}

}  // namespace

void start_forks(decode_actor_t* self) {
  auto& s = self->state;
  for (;;) {
    auto it = std::find_if(s.waiting.begin(), s.waiting.end(), [](const dseq& d) {
      return d.req.n > 1 && d.group.empty() && !d.aborted && !d.prefilling;
    });
    if (it == s.waiting.end()) return;
    dseq d = std::move(*it);
    s.waiting.erase(it);
    fork_one(self, std::move(d));
  }
}

bool abort_forks(decode_actor_t* self, const std::string& id, int32_t choice) {
  auto& s = self->state;
  bool any = false;
  if (auto it = s.forking.find(id); it != s.forking.end()) {
    any = true;
    if (choice < 0) it->second.aborted = true;              // every page goes back at the reply
    else if (choice == 0) it->second.req.fork_only = true;  // choice 0 stopped: only its forks go on
  }
  auto match = [&](const dseq& d) { return d.group == id && (choice < 0 || d.req.choice == choice); };
  for (auto& d : s.running)
    if (match(d)) {
      d.aborted = true;  // leaves at the next pump (after the batch in flight, if any)
      any = true;
    }
  for (auto it = s.waiting.begin(); it != s.waiting.end();) {
    if (!match(*it)) {
      ++it;
      continue;
    }
    any = true;
    s.page_retry_due = true;
    s.free_pages(it->req.id, it->pages);
    it = s.waiting.erase(it);
  }
  return any;
}

}  // namespace tandem::decode_detail
