#include "actors/cache_tier/cache_tier.h"

#include <fmt/format.h>

#include <caf/all.hpp>

#include "actors/cache_tier/page_allocator.h"
#include "actors/cache_tier/radix_cache.h"
#include "actors/common/metrics.h"
#include "actors/common/wire.h"

namespace tandem {

namespace {

struct cache_state {
  cache_tier_options opt;
  std::unique_ptr<page_allocator> alloc;
  std::unique_ptr<radix_cache> cache;
  std::shared_ptr<mailbox_gate> gate;
  std::shared_ptr<spdlog::logger> log;
  int64_t lookups = 0, hits = 0, hit_tokens = 0, alloc_failures = 0, bad_frees = 0;
  static inline const char* name = "cache_tier";

  /// n fresh pages, evicting unreferenced cached pages if the free list is short.
  std::optional<std::vector<int32_t>> alloc_pages(int32_t n) {
    if (alloc->n_free() < n) cache->evict_until_free(n);
    auto r = alloc->try_alloc(n);
    if (!r) ++alloc_failures;
    return r;
  }

  tandem::error exhausted(const std::string& id, int32_t n) const {
    return tandem::error(
        error_kind::overloaded,
        fmt::format("request {}: KV cache exhausted ({} pages wanted, {} of {} free, {} cached and "
                    "in use); retry later or raise limits.kv_cache_mb / device_pages",
                    id, n, alloc->n_free(), alloc->n_pages(), cache->cached_pages()));
  }

  wire acquire(schema::AcquireRequest::Reader rq) {
    auto tokens = to_vector(rq.getTokens());
    std::string id = rq.getId().cStr();
    const int32_t ps = opt.page_size;
    const int32_t total = (static_cast<int32_t>(tokens.size()) + ps - 1) / ps;
    radix_cache::match_result m;
    if (opt.prefix_cache && rq.getUsePrefixCache()) {
      ++lookups;
      m = cache->match(tokens, static_cast<int32_t>(tokens.size()) - 1);
      for (auto p : m.pages) alloc->ref(p);  // pin before evicting for the rest
    }
    const int32_t fresh = total - static_cast<int32_t>(m.pages.size());
    auto pages = alloc_pages(fresh);
    if (!pages) {
      alloc->unref_all(m.pages);
      auto err = exhausted(id, fresh);
      log->warn("{}", err.what());
      return make_wire([&](schema::Envelope::Builder env) {
        auto r = env.initAcquireReply();
        r.setId(id);
        r.setOk(false);
        set_error(r.initError(), err);
        r.setRetryable(total <= alloc->n_pages());
      });
    }
    if (m.tokens > 0) {
      ++hits;
      hit_tokens += m.tokens;
    }
    std::vector<int32_t> all = m.pages;
    all.insert(all.end(), pages->begin(), pages->end());
    log->debug("request {}: acquired {} pages ({} cached tokens)", id, all.size(), m.tokens);
    return make_wire([&](schema::Envelope::Builder env) {
      auto r = env.initAcquireReply();
      r.setId(id);
      r.setOk(true);
      fill_list([&](unsigned n) { return r.initPages(n); }, all);
      r.setCachedTokens(m.tokens);
    });
  }

  wire alloc_reply(schema::AllocRequest::Reader rq) {
    auto pages = alloc_pages(rq.getCount());
    return make_wire([&](schema::Envelope::Builder env) {
      auto r = env.initAllocReply();
      r.setOk(pages.has_value());
      if (pages)
        fill_list([&](unsigned n) { return r.initPages(n); }, *pages);
      else
        set_error(r.initError(), exhausted(rq.getId().cStr(), rq.getCount()));
      r.setFree(alloc->n_free());
    });
  }

  void free_pages(schema::FreePages::Reader f) {
    for (auto p : f.getPages()) {
      try {
        alloc->unref(p);
      } catch (const tandem::error& e) {
        ++bad_frees;
        log->error("request {}: {}", f.getId().cStr(), e.what());
      }
    }
  }

  void insert(schema::InsertPrefix::Reader ins) {
    if (!opt.prefix_cache) return;
    auto tokens = to_vector(ins.getTokens());
    auto pages = to_vector(ins.getPages());
    try {
      int32_t added = cache->insert(tokens, pages);
      log->debug("request {}: cached {} new prefix pages", ins.getId().cStr(), added);
    } catch (const tandem::error& e) {
      log->error("request {}: prefix insert failed: {}", ins.getId().cStr(), e.what());
    }
  }
};

caf::behavior cache_tier_actor(caf::stateful_actor<cache_state>* self, cache_tier_options opt,
                               std::shared_ptr<mailbox_gate> gate, std::shared_ptr<spdlog::logger> log) {
  auto& st = self->state;
  st.opt = opt;
  st.alloc = std::make_unique<page_allocator>(opt.n_pages);
  st.cache = std::make_unique<radix_cache>(*st.alloc, opt.page_size);
  st.gate = std::move(gate);
  st.log = std::move(log);
  return {
      [self](call_atom, const wire& w) -> wire {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isAcquire()) return s.acquire(env.getAcquire());
          if (env.isAlloc()) return s.alloc_reply(env.getAlloc());
          throw tandem::error(error_kind::unimplemented, "cache tier: unexpected request message");
        } catch (const tandem::error& e) {
          return make_wire([&](schema::Envelope::Builder env) { set_error(env.initError(), e); });
        } catch (const kj::Exception& e) {
          tandem::error te(error_kind::failed,
                           fmt::format("malformed request: {}", e.getDescription().cStr()));
          return make_wire([&](schema::Envelope::Builder env) { set_error(env.initError(), te); });
        }
      },
      [self](wire_atom, const wire& w) {
        auto& s = self->state;
        s.gate->leave();
        try {
          wire_reader rd(w);
          auto env = rd.root();
          if (env.isFree())
            s.free_pages(env.getFree());
          else if (env.isInsert())
            s.insert(env.getInsert());
          else
            s.log->error("cache tier: unexpected message dropped");
        } catch (const tandem::error& e) {
          s.log->error("cache tier: {}", e.what());
        } catch (const kj::Exception& e) {
          s.log->error("cache tier: malformed message: {}", e.getDescription().cStr());
        }
      },
      [self](stats_atom) -> wire {
        auto& s = self->state;
        std::vector<metric_sample> m = {
            {"kv_pages_total", "", double(s.alloc->n_pages()), "gauge", "KV pages in the device pool"},
            {"kv_pages_free", "", double(s.alloc->n_free()), "gauge", "KV pages on the free list"},
            {"kv_pages_cached", "", double(s.cache->cached_pages()), "gauge",
             "KV pages held by the prefix cache"},
            {"kv_pages_evictable", "", double(s.cache->evictable_pages()), "gauge",
             "Cached KV pages no request uses (reclaimable)"},
            {"prefix_cache_lookups_total", "", double(s.lookups), "counter", "Prefix cache lookups"},
            {"prefix_cache_hits_total", "", double(s.hits), "counter",
             "Lookups that reused at least one page"},
            {"prefix_cache_hit_tokens_total", "", double(s.hit_tokens), "counter",
             "Prompt tokens served from the prefix cache"},
            {"prefix_cache_evictions_total", "", double(s.cache->evictions()), "counter",
             "Cached pages evicted"},
            {"kv_alloc_failures_total", "", double(s.alloc_failures), "counter",
             "Page allocations that failed (overloaded)"},
            {"kv_bad_frees_total", "", double(s.bad_frees), "counter",
             "Frees of pages that were not allocated (bugs)"},
        };
        return make_stats_wire("cache_tier", m, {});
      },
  };
}

}  // namespace

bounded_actor spawn_cache_tier(caf::actor_system& sys, const cache_tier_options& opt,
                               std::shared_ptr<spdlog::logger> log) {
  auto gate = std::make_shared<mailbox_gate>("cache_tier", opt.mailbox_bound);
  auto h = sys.spawn(cache_tier_actor, opt, gate, std::move(log));
  return bounded_actor{h, gate};
}

}  // namespace tandem
