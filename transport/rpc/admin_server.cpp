#include "transport/rpc/admin_server.h"

#include <kj/debug.h>

#include <algorithm>

#include "schemas/admin.capnp.h"
#include "transport/rpc/rpc_listener.h"

namespace tandem {

struct admin_server::impl {
  impl(serving_api& a, const limits& l) : api(a), lim(l) {}

  class admin_impl final : public admin::Admin::Server {
   public:
    explicit admin_impl(impl& s) : srv_(s) {}

    kj::Promise<void> inspect(InspectContext ctx) override {
      int32_t max_requests = std::max(0, ctx.getParams().getMaxRequests());
      node_report r;
      try {
        r = srv_.api.inspect();
      } catch (const tandem::error& e) {
        KJ_FAIL_REQUIRE("inspect failed", e.what());
      }
      auto res = ctx.getResults();
      res.setRequestsOmitted(fill(res.initReport(), r, max_requests));
      return kj::READY_NOW;
    }

    /// Authenticated like inspect (the connection passed the Gate with an API key).
    kj::Promise<void> drain(DrainContext ctx) override {
      node_report r;
      try {
        r = srv_.api.drain(ctx.getParams().getOn());
      } catch (const tandem::error& e) {
        KJ_FAIL_REQUIRE("drain failed", e.what());
      }
      fill(ctx.getResults().initReport(), r, 0);
      return kj::READY_NOW;
    }

   private:
    /// Writes `r` with at most `max_requests` in-flight requests; returns how many were left out.
    static int32_t fill(admin::NodeReport::Builder o, const node_report& r, int32_t max_requests) {
      o.setNode(r.node);
      o.setModelId(r.model_id);
      o.setHealthy(r.healthy);
      o.setStatus(r.status);
      o.setUptimeMs(r.uptime_ms);
      o.setReady(r.ready);
      o.setReadyStatus(r.ready_status);
      o.setDrain(r.drain);
      auto actors = o.initActors(static_cast<unsigned>(r.actors.size()));
      for (unsigned i = 0; i < r.actors.size(); ++i) {
        const auto& a = r.actors[i];
        auto b = actors[i];
        b.setName(a.name);
        b.setState(a.state);
        b.setMailboxDepth(a.mailbox_depth);
        b.setMailboxBound(a.mailbox_bound);
        b.setMessagesHandled(a.messages_handled);
        b.setMailboxRejected(a.mailbox_rejected);
        b.setRestarts(a.restarts);
        b.setLastError(a.last_error);
      }
      size_t n = std::min(r.requests.size(), static_cast<size_t>(max_requests));
      auto reqs = o.initRequests(static_cast<unsigned>(n));
      for (unsigned i = 0; i < n; ++i) {
        const auto& q = r.requests[i];
        auto b = reqs[i];
        b.setId(q.id);
        b.setState(q.state);
        b.setAgeMs(q.age_ms);
        b.setPromptTokens(q.prompt_tokens);
        b.setCompletionTokens(q.completion_tokens);
      }
      const auto omitted = static_cast<int32_t>(r.requests.size() - n);
      auto pools = o.initPools(static_cast<unsigned>(r.pools.size()));
      for (unsigned i = 0; i < r.pools.size(); ++i) {
        const auto& p = r.pools[i];
        auto b = pools[i];
        b.setName(p.name);
        b.setPagesTotal(p.pages_total);
        b.setPagesFree(p.pages_free);
        b.setPagesCached(p.pages_cached);
        b.setPagesEvictable(p.pages_evictable);
        b.setBytes(p.bytes);
      }
      return omitted;
    }

    impl& srv_;
  };

  serving_api& api;
  limits lim;
  rpc_listener listener{"admin", lim};
};

admin_server::admin_server(serving_api& api, const limits& lim) : impl_(std::make_unique<impl>(api, lim)) {
  impl_->listener.set_bootstrap(kj::heap<impl::admin_impl>(*impl_));
}

admin_server::~admin_server() = default;

kj::Promise<void> admin_server::listen(kj::ConnectionReceiver& listener) { return impl_->listener.listen(listener); }

void admin_server::set_api_keys(std::shared_ptr<const api_keys> keys) { impl_->listener.set_api_keys(std::move(keys)); }

}  // namespace tandem
