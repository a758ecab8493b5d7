#include "actors/cache_tier/cache_tier.h"

#include <fmt/format.h>

#include <caf/all.hpp>
#include <chrono>
#include <unordered_set>

#include "actors/cache_tier/page_allocator.h"
#include "actors/cache_tier/page_file.h"
#include "actors/cache_tier/radix_cache.h"
#include "actors/common/metrics.h"
#include "actors/common/pool_pages_wire.h"
#include "actors/common/wire.h"
#include "actors/cache_tier/cache_tier_state.h"

namespace tandem {

namespace {

using namespace cache_detail;


void fill_copy(schema::CacheCopy::Builder cc, const std::string& id, const std::vector<copy_op>& ops) {
  cc.setId(id);
  {
    auto l = cc.initOps(static_cast<unsigned>(ops.size()));
    for (unsigned i = 0; i < ops.size(); ++i) {
      auto o = l[i];
      const auto& op = ops[i];
      switch (op.kind) {
        case copy_op::device_to_host: o.setKind(schema::CacheOpKind::DEVICE_TO_HOST); break;
        case copy_op::host_to_device: o.setKind(schema::CacheOpKind::HOST_TO_DEVICE); break;
        case copy_op::host_to_disk: o.setKind(schema::CacheOpKind::HOST_TO_DISK); break;
        case copy_op::disk_to_host: o.setKind(schema::CacheOpKind::DISK_TO_HOST); break;
        case copy_op::drop_disk: o.setKind(schema::CacheOpKind::DROP_DISK); break;
        case copy_op::device_to_device: o.setKind(schema::CacheOpKind::DEVICE_TO_DEVICE); break;
      }
      o.setDeviceTo(op.device_to);
      o.setDevice(op.device);
      o.setHost(op.host);
      o.setHash(op.hash);
      o.setParent(op.parent);
      o.setPool(op.pool);
      fill_list([&](unsigned n) { return o.initTokens(n); }, op.tokens);
    }
  }
}

/// Has the worker run `ops` (in order, after everything already in its mailbox) and calls
/// `done` with the result; an unreachable worker fails every op.
template <class F>
void run_copies(cache_actor_t* self, const std::string& id, std::vector<copy_op> ops, F done) {
  auto& s = self->state;
  auto extra = s.cache->take_pending_ops();
  ops.insert(ops.end(), extra.begin(), extra.end());
  const size_t n = ops.size();
  auto t0 = std::chrono::steady_clock::now();
  s.copy_batches += 1;
  // A control message (the table in protocol.h): already decided, the copy must run (bounded
  // by the callers' bounds).
  s.worker.call<msg::cache_copy>(
          self, [&](schema::CacheCopy::Builder cc) { fill_copy(cc, id, ops); },
          [self, done, t0](const wire& w) mutable {
            auto& st = self->state;
            copy_done r;
            r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            try {
              wire_reader rd(w);
              auto env = rd.reply();
              if (!env.isCacheCopyReply()) throw tandem::error("worker sent an unexpected reply to a cache copy");
              auto cr = env.getCacheCopyReply();
              for (auto i : cr.getFailed()) r.failed.push_back(i);
              r.bytes = cr.getBytes();
              r.worker_us = cr.getElapsedUs();
            } catch (const std::exception& e) {
              st.log->error("cache copy: {}", e.what());
            }
            st.copy_bytes += static_cast<int64_t>(r.bytes);
            st.copy_s += double(r.worker_us) / 1e6;
            done(r);
          },
          [self, done, n, t0](caf::error& e) mutable {
            self->state.log->warn("cache copy: worker unreachable: {}", self->system().render(e));
            copy_done r;
            r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            for (uint32_t i = 0; i < n; ++i) r.failed.push_back(i);
            done(r);
          });
}

void run_background(cache_actor_t* self, const std::string& id, std::vector<copy_op> ops) {
  auto& s = self->state;
  s.background_in_flight += 1;
  run_copies(self, id, std::move(ops), [self](const copy_done&) { self->state.background_in_flight -= 1; });
}

void flush_pending(cache_actor_t* self) {
  auto ops = self->state.cache->take_pending_ops();
  if (!ops.empty()) run_background(self, "drop", std::move(ops));
}

/// Counts a prefix hit per tier (device, host, disk: the cached tokens from each) and the
/// load-back it took.
void count_hits(cache_state& st, const radix_cache::match_result& m, int32_t cached, double wall_s) {
  int32_t left = cached;
  const int32_t parts[3] = {m.device_tokens, m.host_tokens, m.disk_tokens};
  for (int t = 0; t < 3; ++t) {
    const int32_t got = std::min(left, parts[t]);
    left -= got;
    if (got > 0) {
      st.tier_hits[t] += 1;
      st.tier_hit_tokens[t] += got;
    }
  }
  const int32_t loaded = cached - std::min(cached, m.device_tokens);
  if (loaded > 0) {
    st.load_back_tokens += loaded;
    st.load_back_s += wall_s;
  }
  st.load_back_skipped_tokens += m.skipped_tokens;
  if (cached > 0) {
    ++st.hits;
    st.hit_tokens += cached;
  }
}

/// An acquisition's page tables: pool 0's cached then fresh pages; each other pool's cached
/// blocks, then its fresh pages from the first uncached block (-1 where it holds none).
pool_pages acquired_pages(const radix_cache::match_result& m, const std::vector<int32_t>& fresh,
                          const std::vector<std::vector<int32_t>>& xfresh) {
  std::vector<int32_t> all = m.pages;
  all.insert(all.end(), fresh.begin(), fresh.end());
  pool_pages out{all};
  for (size_t p = 1; p <= xfresh.size(); ++p) {
    std::vector<int32_t> t(all.size(), -1);
    const auto& c = p - 1 < m.xpages.size() ? m.xpages[p - 1] : std::vector<int32_t>{};
    std::copy(c.begin(), c.end(), t.begin());
    const size_t from = m.pages.size();
    for (size_t i = 0; i < xfresh[p - 1].size() && from + i < t.size(); ++i) t[from + i] = xfresh[p - 1][i];
    out.push_back(std::move(t));
  }
  return out;
}

/// The refusal of an acquisition (its pages already given back).
wire acquire_failed(cache_state& st, const std::string& id, const tandem::error& err, int32_t total) {
  st.log->warn("{}", err.what());
  return make_reply([&](schema::Reply::Builder env) {
    auto r = env.initAcquireReply();
    r.setId(id);
    r.setOk(false);
    set_error(r.initError(), err);
    r.setRetryable(total <= st.alloc->n_pages());
  });
}

caf::result<wire> acquire(cache_actor_t* self, schema::AcquireRequest::Reader rq) {
  auto& s = self->state;
  auto tokens = to_vector(rq.getTokens());
  std::string id = rq.getId().cStr();
  const int32_t ps = s.opt.layout.page_size;
  const int32_t total = (static_cast<int32_t>(tokens.size()) + ps - 1) / ps;
  std::vector<copy_op> ops;
  auto m = std::make_shared<radix_cache::match_result>();
  const bool use = s.opt.prefix_cache && rq.getUsePrefixCache();
  if (use) {
    ++s.lookups;
    *m = s.cache->match(tokens, static_cast<int32_t>(tokens.size()) - 1, ops);
  }
  const int32_t fresh = total - static_cast<int32_t>(m->pages.size());
  auto pages = std::make_shared<std::optional<std::vector<int32_t>>>(s.cache->alloc_device(fresh, ops));
  // Other pools: fresh pages for the blocks after the cached prefix, as many as one sequence
  // holds at once while it is prefilled chunk by chunk (all of them for a full pool).
  const size_t X = s.xalloc.size();
  auto xfresh = std::make_shared<std::vector<std::vector<int32_t>>>(X);
  auto xfail = std::make_shared<std::string>();
  if (*pages)
    for (size_t p = 1; p <= X; ++p) {
      const int32_t want = std::min(s.opt.pools.pools[p].max_pages(int64_t(tokens.size()), s.opt.chunk_tokens),
                                    fresh);
      auto x = s.cache->alloc_pool(p, want, ops);
      if (!x) {
        *xfail = fmt::format("request {}: KV pool '{}' exhausted ({} pages wanted, {} of {} free); retry later "
                             "or raise limits.kv_cache_mb / device_pages",
                             id, s.pool_name(p), want, s.pool(p).n_free(), s.pool(p).n_pages());
        break;
      }
      (*xfresh)[p - 1] = std::move(*x);
    }
  auto finish = [self, m, pages, xfresh, xfail, id, total, use](const copy_done& d) -> wire {
    auto& st = self->state;
    int32_t cached = use ? st.cache->finish_match(*m, d.failed) : 0;
    flush_pending(self);
    // Several pools, a disk read failed: the match is given up (its file is dropped) and the
    // request retries; see radix_cache::finish_match.
    const bool retry = cached < 0;
    if (!*pages || !xfail->empty() || retry) {
      pool_pages held{m->pages};
      for (auto& x : m->xpages) held.push_back(x);
      st.unref_pools(held, id);
      if (*pages) st.alloc->unref_all(**pages);
      for (size_t p = 1; p <= xfresh->size(); ++p) st.pool(p).unref_all((*xfresh)[p - 1]);
      ++st.alloc_failures;
      auto err = retry ? tandem::error(error_kind::overloaded,
                                       fmt::format("request {}: a disk tier file of its cached prefix failed to "
                                                   "read and was dropped; retry",
                                                   id))
                 : !xfail->empty() ? tandem::error(error_kind::overloaded, *xfail)
                                   : st.exhausted(id, total - static_cast<int32_t>(m->pages.size()));
      return acquire_failed(st, id, err, total);
    }
    if (use) count_hits(st, *m, cached, d.wall_s);
    pool_pages reply_pages = acquired_pages(*m, **pages, *xfresh);
    st.log->debug("request {}: acquired {} pages ({} cached tokens: {} device, {} host, {} disk)", id,
                  reply_pages[0].size(), cached, m->device_tokens, m->host_tokens, m->disk_tokens);
    return make_reply([&](schema::Reply::Builder env) {
      auto r = env.initAcquireReply();
      r.setId(id);
      r.setOk(true);
      write_pool_pages(r, reply_pages);
      r.setCachedTokens(cached);
    });
  };
  if (ops.empty()) return finish(copy_done{});
  auto rp = self->make_response_promise<wire>();
  run_copies(self, id, std::move(ops), [rp, finish](const copy_done& d) mutable { rp.deliver(finish(d)); });
  return rp;
}

/// A fork shares the pages of `holds`: its references are taken before any allocation, so no
/// eviction the allocation makes can take them (they are in use by the sequence anyway). A page
/// it does not hold refuses the fork (the references taken so far go back).
std::optional<wire> take_holds(cache_state& s, const std::string& id, pool_pages& holds) {
  for (size_t p = 0; p < holds.size(); ++p)
    for (size_t i = 0; i < holds[p].size(); ++i) {
      if (holds[p][i] < 0) continue;
      try {
        if (p > s.xalloc.size()) throw tandem::error(error_kind::failed, fmt::format("no KV pool {}", p));
        s.pool(p).ref(holds[p][i]);
      } catch (const tandem::error& e) {
        ++s.bad_frees;
        holds[p].resize(i);  // the references taken so far go back
        s.unref_pools(holds, id);
        return make_reply([&](schema::Reply::Builder env) {
          auto r = env.initAllocReply();
          r.setOk(false);
          set_error(r.initError(), tandem::error(error_kind::failed,
                                                 fmt::format("request {}: fork of pages the sequence does not hold: {}",
                                                             id, e.what())));
        });
      }
    }
  return std::nullopt;
}

/// `count` pages of pool 0 and `counts[i]` of pool i + 1: every pool or none (a sequence steps
/// only with a page in each pool it writes). None: `why` says which pool ran out (empty: pool 0).
std::optional<pool_pages> alloc_every_pool(cache_state& s, const std::string& id, int32_t count,
                                           capnp::List<int32_t>::Reader counts, std::vector<copy_op>& ops,
                                           std::string& why) {
  auto first = s.cache->alloc_device(count, ops);
  std::optional<pool_pages> pages;
  if (!first) return pages;
  pages.emplace(pool_pages{std::move(*first)});
  for (unsigned i = 0; i < counts.size() && pages; ++i) {
    const size_t p = i + 1;
    if (p > s.xalloc.size()) {
      why = fmt::format("request {}: allocation for pool {} of a layout of {} pools", id, p, s.xalloc.size() + 1);
    } else if (auto x = s.cache->alloc_pool(p, counts[i], ops)) {
      pages->push_back(std::move(*x));
      continue;
    } else {
      why = fmt::format("request {}: KV pool '{}' exhausted ({} pages wanted, {} of {} free); retry later or "
                        "raise limits.kv_cache_mb / device_pages",
                        id, s.pool_name(p), counts[i], s.pool(p).n_free(), s.pool(p).n_pages());
    }
    s.unref_pools(*pages, id);
    pages.reset();
  }
  return pages;
}

/// The answer to an allocation: its pages, or why not, and what every pool has free now.
wire alloc_answer(cache_state& st, const std::optional<pool_pages>& pages, const std::string& id, int32_t count,
                  const std::string& why) {
  return make_reply([&](schema::Reply::Builder env) {
    auto r = env.initAllocReply();
    r.setOk(pages.has_value());
    if (pages)
      write_pool_pages(r, *pages);
    else if (!why.empty())
      set_error(r.initError(), tandem::error(error_kind::overloaded, why));
    else
      set_error(r.initError(), st.exhausted(id, count));
    if (!st.xalloc.empty()) {
      auto xf = r.initExtraFree(static_cast<unsigned>(st.xalloc.size()));
      for (size_t p = 1; p <= st.xalloc.size(); ++p)
        xf.set(static_cast<unsigned>(p - 1), st.pool(p).n_free() + st.pool(p).n_evictable());
    }
    // Cached pages no request uses are as good as free to an allocation (it evicts them);
    // reporting only the free list made a full prefix cache read as an exhausted pool.
    r.setFree(st.alloc->n_free() + st.alloc->n_evictable());
    r.setTotal(st.alloc->n_pages());
  });
}

caf::result<wire> alloc_reply(cache_actor_t* self, schema::AllocRequest::Reader rq) {
  auto& s = self->state;
  std::vector<copy_op> ops;
  std::string id = rq.getId().cStr();
  const int32_t count = rq.getCount();
  pool_pages holds = read_pool_pages(rq.getHolds(), extra_reader{rq.getExtraHolds()});
  if (auto refused = take_holds(s, id, holds)) return std::move(*refused);
  std::string why;
  std::optional<pool_pages> pages = alloc_every_pool(s, id, count, rq.getExtraCounts(), ops, why);
  if (!pages) {
    ++s.alloc_failures;
    s.unref_pools(holds, id);
  }
  // The fork's copies (copy-on-write of the block it writes first), after any eviction copies.
  size_t fork_copies = 0;
  if (pages) {
    const pool_pages from = read_pool_pages(rq.getCopyFrom(), extra_reader{rq.getExtraCopyFrom()});
    for (size_t p = 0; p < from.size() && p < pages->size(); ++p)
      for (size_t i = 0; i < from[p].size() && i < (*pages)[p].size(); ++i) {
        if (from[p][i] < 0) continue;
        copy_op op;
        op.kind = copy_op::device_to_device;
        op.device = from[p][i];
        op.device_to = (*pages)[p][i];
        op.pool = static_cast<int32_t>(p);
        ops.push_back(op);
        ++fork_copies;
      }
  }
  auto reply = [self, pages, id, count, why]() { return alloc_answer(self->state, pages, id, count, why); };
  if (ops.empty()) return reply();
  // write_back: the victims' copies run before the caller may overwrite their pages.
  auto rp = self->make_response_promise<wire>();
  if (fork_copies == 0) {
    run_copies(self, id, std::move(ops), [rp, reply](const copy_done&) mutable { rp.deliver(reply()); });
    return rp;
  }
  s.fork_copies += static_cast<int64_t>(fork_copies);
  const size_t first_fork = ops.size() - fork_copies;
  run_copies(self, id, std::move(ops), [self, rp, reply, pages, holds, id, first_fork, fork_copies](const copy_done& d) mutable {
    // A failed copy of the fork fails it, and every page it took goes back.
    bool fork_failed = false;
    for (auto i : d.failed) fork_failed = fork_failed || (i >= first_fork && i < first_fork + fork_copies);
    if (!fork_failed) {
      rp.deliver(reply());
      return;
    }
    auto& st = self->state;
    st.unref_pools(*pages, id);
    st.unref_pools(holds, id);
    rp.deliver(make_reply([&](schema::Reply::Builder env) {
      auto r = env.initAllocReply();
      r.setOk(false);
      set_error(r.initError(), tandem::error(error_kind::failed,
                                             fmt::format("request {}: a page copy of its fork failed", id)));
    }));
  });
  return rp;
}

void free_pages(cache_state& s, schema::FreePages::Reader f) {
  s.unref_pools(read_pool_pages(f), f.getId().cStr());
}

void insert(cache_actor_t* self, schema::InsertPrefix::Reader ins) {
  auto& s = self->state;
  if (!s.opt.prefix_cache) return;
  auto tokens = to_vector(ins.getTokens());
  std::vector<copy_op> ops;
  try {
    const auto pages = read_pool_pages(ins);
    const bool allow = s.background_in_flight < s.opt.max_background_copies;
    int32_t added = s.cache->insert(tokens, pages[0], ops, allow,
                                    std::span<const std::vector<int32_t>>(pages).subspan(1));
    s.log->debug("request {}: cached {} new prefix pages", ins.getId().cStr(), added);
  } catch (const tandem::error& e) {
    s.log->error("request {}: prefix insert failed: {}", ins.getId().cStr(), e.what());
  }
  if (!ops.empty()) run_background(self, ins.getId().cStr(), std::move(ops));
}

caf::behavior cache_tier_actor(cache_actor_t* self, cache_tier_options opt, bounded_actor worker,
                               std::vector<page_file_entry> disk_found,
                               std::vector<std::vector<page_file_entry>> disk_pools, std::shared_ptr<mailbox_gate> gate,
                               std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.worker = std::move(worker);
  st.alloc = std::make_unique<page_allocator>(opt.n_pages);
  if (st.opt.pools.pools.empty()) st.opt.pools = kv_pools_layout::single(opt.layout);
  for (size_t p = 1; p < st.opt.pools.pools.size(); ++p)
    st.xalloc.push_back(std::make_unique<page_allocator>(p - 1 < opt.extra_pages.size() ? opt.extra_pages[p - 1] : 0));
  if (opt.host_pages > 0) {
    st.host_alloc = std::make_unique<page_allocator>(opt.host_pages);
    for (size_t p = 1; p < st.opt.pools.pools.size(); ++p)
      st.xhost_alloc.push_back(std::make_unique<page_allocator>(
          p - 1 < opt.extra_host_pages.size() ? opt.extra_host_pages[p - 1] : opt.host_pages));
  }
  radix_cache::options ro;
  ro.page_size = opt.layout.page_size;
  ro.policy = opt.cache.write_policy;
  ro.write_through_threshold = opt.cache.write_through_threshold;
  ro.min_load_back_tokens = opt.cache.min_load_back_tokens;
  ro.disk_pages = opt.host_pages > 0 ? opt.disk_pages : 0;
  ro.pools = st.opt.pools;
  std::vector<page_allocator*> devs{st.alloc.get()};
  for (auto& x : st.xalloc) devs.push_back(x.get());
  std::vector<page_allocator*> hosts;
  if (st.host_alloc) hosts.push_back(st.host_alloc.get());
  for (auto& x : st.xhost_alloc) hosts.push_back(x.get());
  st.cache = std::make_unique<radix_cache>(devs, hosts, ro);
  for (const auto& e : disk_found) st.cache->add_disk_entry(e.hash);
  for (size_t p = 1; p < disk_pools.size(); ++p)
    for (const auto& e : disk_pools[p]) st.cache->add_disk_pool(e.hash, p);
  st.disk_restored = static_cast<int64_t>(disk_found.size());
  st.gate = std::move(gate);
  st.log = std::move(log);
  if (st.tiers())
    st.log->info("cache tiers: device {} pages, host {} pages, disk {} files in '{}' ({} found), policy {}",
                 opt.n_pages, opt.host_pages, ro.disk_pages, opt.cache.disk_dir, disk_found.size(),
                 cache_write_policy_name(opt.cache.write_policy));
  st.box = inbox{"cache_tier", st.gate, st.log};
  return {
      [self](call_atom, const wire& w) -> caf::result<wire> {
        return receive_call<cache_tier_role, caf::result<wire>>(
            self->state.box, w,
            overloaded{
                [self](msg::acquire, schema::AcquireRequest::Reader r) { return acquire(self, r); },
                [self](msg::alloc, schema::AllocRequest::Reader r) { return alloc_reply(self, r); },
            },
            [](const tandem::error& e) -> caf::result<wire> { return make_error_reply(e); });
      },
      [self](wire_atom, const wire& w) {
        receive<cache_tier_role>(self->state.box, w,
                                 overloaded{
                                     [self](msg::free, schema::FreePages::Reader f) { free_pages(self->state, f); },
                                     [self](msg::insert, schema::InsertPrefix::Reader i) { insert(self, i); },
                                 });
      },
      [self](stats_atom) -> wire {
        auto m = cache_metrics(self->state);
        for (auto& x : self->state.box.metrics()) m.push_back(std::move(x));
        return make_stats_wire("cache_tier", m, {});
      },
  };
}

}  // namespace

bounded_actor spawn_cache_tier(caf::actor_system& sys, const cache_tier_options& opt, bounded_actor worker,
                               std::shared_ptr<spdlog::logger> log) {
  std::vector<page_file_entry> found;
  std::vector<std::vector<page_file_entry>> pool_files;
  const kv_pools_layout set = opt.pools.pools.empty() ? kv_pools_layout::single(opt.layout) : opt.pools;
  if (opt.host_pages > 0 && opt.disk_pages > 0 && !opt.cache.disk_dir.empty()) {
    const uint64_t fp = pool_file_fingerprint(set, 0);
    found = scan_page_files(opt.cache.disk_dir, fp, cache_disk_file_bytes(set.pools[0].page));
    // Over the bound (a smaller disk_size_gb than last time): the oldest files go.
    while (static_cast<int64_t>(found.size()) > opt.disk_pages) {
      remove_page_file(opt.cache.disk_dir, fp, found.front().hash);
      found.erase(found.begin());
    }
    // Other pools' files of a block: kept where pool 0's file is (the entry), else removed.
    pool_files.resize(set.pools.size());
    std::unordered_set<uint64_t> kept;
    for (const auto& e : found) kept.insert(e.hash);
    for (size_t p = 1; p < set.pools.size(); ++p) {
      const uint64_t fpp = pool_file_fingerprint(set, p);
      for (const auto& e : scan_page_files(opt.cache.disk_dir, fpp, cache_disk_file_bytes(set.pools[p].page))) {
        if (kept.count(e.hash))
          pool_files[p].push_back(e);
        else
          remove_page_file(opt.cache.disk_dir, fpp, e.hash);
      }
    }
  }
  auto gate = std::make_shared<mailbox_gate>("cache_tier", opt.mailbox_bound);
  auto h = sys.spawn(cache_tier_actor, opt, std::move(worker), std::move(found), std::move(pool_files), gate,
                     std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
