#include "transport/ucx/kv_port_ucx.h"

#include <fmt/format.h>
#include <spdlog/logger.h>

#include <atomic>
#include <map>
#include <memory>

#include "kernels/base/error.h"

namespace tandem::ucx {

namespace {

class ucx_kv_port final : public kv_port {
 public:
  ucx_kv_port(kv_port_options opt, const kv_pools_layout& set, std::span<const int32_t> n_pages,
              kv_release_fn release, std::shared_ptr<spdlog::logger> log)
      : opt_(std::move(opt)), release_(std::move(release)) {
    if (log)
      opt_.engine.log = [log](bool warning, const std::string& msg) {
        if (warning)
          log->warn("{}", msg);
        else
          log->info("{}", msg);
      };
    if (set.pools.empty()) throw tandem::error("a KV transfer port needs a layout set of at least one pool");
    kv_identity id;
    id.node = opt_.node;
    id.model = opt_.model;
    id.layout = set.pools.front().page;
    id.pools = set;
    id.dtype = to_string(id.layout.dtype);
    engine_ = std::make_unique<kv_engine>(
        clock_, n_pages, id, opt_.engine,
        [this](transfer_id tid, transfer_role, const pool_pages& pages, bool delivered) {
          release_(tid, delivered, pages, delivered ? std::string() : engine_->table().last_error());
        });
    if (opt_.listen_port > 0) engine_->listen(opt_.listen_host, opt_.listen_port);
    for (const auto& p : opt_.sources) dialled_[p.node] = engine_->add_peer(p.host, p.port);
  }

  kv_pools& pools() override { return engine_->pools(); }

  void send(uint64_t tid, const std::string& dst, pool_pages pages) override {
    check_pools(tid, pages);
    if (auto p = engine_->peer_named(dst)) {
      start_send(tid, *p, pages);
      return;
    }
    if (pending_.size() >= opt_.engine.limits.max_transfers)
      throw tandem::error(error_kind::overloaded,
                          fmt::format("{} KV sends wait for their destination to connect; retry later",
                                      pending_.size()));
    pending_[tid] = {dst, std::move(pages), clock_.now_ms() + opt_.resolve_ms};
  }

  void receive(uint64_t tid, const std::string& src, pool_pages pages) override {
    check_pools(tid, pages);
    auto it = dialled_.find(src);
    if (it == dialled_.end()) {
      std::string known;
      for (const auto& [n, _] : dialled_) known += (known.empty() ? "" : ", ") + n;
      throw tandem::error(error_kind::failed,
                          fmt::format("KV source node '{}' is not a peer of node '{}' (known: {}); give it the "
                                      "prefill role and a kv_port in the config",
                                      src, opt_.node, known.empty() ? "none" : known));
    }
    engine_->table().start_receive(tid, it->second, std::move(pages));
  }

  void abort(uint64_t tid) override {
    if (auto it = pending_.find(tid); it != pending_.end()) {
      auto pages = std::move(it->second.pages);
      pending_.erase(it);
      release_(tid, false, pages, "aborted before the destination connected");
      return;
    }
    engine_->table().abort(tid);
  }

  bool progress() override {
    bool moved = engine_->progress();
    if (pending_.empty()) return moved;
    const int64_t now = clock_.now_ms();
    for (auto it = pending_.begin(); it != pending_.end();) {
      auto p = engine_->peer_named(it->second.node);
      if (p && engine_->peer_ready(*p)) {
        auto tid = it->first;
        auto pages = std::move(it->second.pages);
        it = pending_.erase(it);
        try {
          start_send(tid, *p, pages);
        } catch (const std::exception& e) {
          release_(tid, false, pages, e.what());
        }
        moved = true;
      } else if (now >= it->second.deadline_ms) {
        auto tid = it->first;
        auto pages = std::move(it->second.pages);
        auto node = it->second.node;
        it = pending_.erase(it);
        release_(tid, false, pages,
                 fmt::format("KV destination node '{}' did not connect to node '{}' within {} ms{}", node, opt_.node,
                             opt_.resolve_ms,
                             engine_->last_peer_error().empty() ? "" : "; last peer error: " + engine_->last_peer_error()));
        moved = true;
      } else {
        ++it;
      }
    }
    return moved;
  }

  bool busy() const override {
    const auto& t = engine_->table();
    return t.live() > 0 || t.quarantined_transfers() > 0 || !pending_.empty();
  }

  std::vector<metric_sample> metrics() const override {
    auto m = engine_->table().metrics();
    m.push_back({"kv_transfer_pending_sends", "", double(pending_.size()), "gauge",
                 "KV sends waiting for their destination node to connect"});
    m.push_back({"kv_handshakes_refused_total", "", double(engine_->handshakes_refused()), "counter",
                 "KV peers refused in the handshake (no or wrong cluster secret, messages out of order)"});
    m.push_back({"kv_transfer_manifest_bytes_total", "", double(engine_->manifest_bytes()), "counter",
                 "KV bytes hashed for transfer manifests (source and destination)"});
    m.push_back({"kv_transfer_manifest_seconds_total", "", double(engine_->manifest_us()) / 1e6, "counter",
                 "Time the worker spent hashing KV for transfer manifests"});
    for (auto& x : kv_staging::metrics_of(engine_->staging())) m.push_back(std::move(x));
    return m;
  }

 private:
  /// An order must name pages of every pool of the set, each a page of its pool or -1.
  void check_pools(uint64_t tid, const pool_pages& pages) {
    kv_pools& ps = engine_->pools();
    if (pages.size() != ps.size())
      throw tandem::error(error_kind::failed,
                          fmt::format("KV transfer {:#x} names pages of {} pools but node '{}' has {} ({})", tid,
                                      pages.size(), opt_.node, ps.size(), ps.set().describe()));
    for (size_t k = 0; k < pages.size(); ++k)
      for (int32_t p : pages[k])
        if (p < -1 || p >= ps[k].n_pages())
          throw tandem::error(error_kind::failed,
                              fmt::format("KV transfer {:#x}: page {} is outside pool {} ({}) of {} pages", tid, p, k,
                                          ps.set().pools[k].name, ps[k].n_pages()));
    // Device pools: a transfer larger than the staging area could never start.
    if (const kv_staging* s = engine_->staging()) s->check(pages);
  }

  void start_send(uint64_t tid, peer_id p, const pool_pages& pages) {
    engine_->table().start_send(tid, p, pages);
    engine_->table().source_ready(tid);
  }

  struct pending_send {
    std::string node;
    pool_pages pages;
    int64_t deadline_ms = 0;
  };

  steady_cluster_clock clock_;
  kv_port_options opt_;
  kv_release_fn release_;
  std::unique_ptr<kv_engine> engine_;
  std::map<std::string, peer_id> dialled_;
  std::map<uint64_t, pending_send> pending_;
};

}  // namespace

fault_hook fault_hook_from_spec(const std::string& spec) {
  if (spec.empty()) return {};
  auto bad = [&] {
    return tandem::error(error_kind::failed,
                         fmt::format("TANDEM_KV_FAULT = '{}' is not a fault; use put:fail:N, put:drop:N, "
                                     "notify:drop:N (the first N), put:delay:MS / notify:delay:MS (every one), or "
                                     "put:drop-pool:P / put:flip-pool:P (pool P of every transfer)",
                                     spec));
  };
  auto a = spec.find(':'), b = spec.rfind(':');
  if (a == std::string::npos || a == b) throw bad();
  std::string where = spec.substr(0, a), what = spec.substr(a + 1, b - a - 1);
  int64_t n = 0;
  try {
    n = std::stoll(spec.substr(b + 1));
  } catch (...) {
    throw bad();
  }
  fault_point fp;
  if (where == "put")
    fp = fault_point::put;
  else if (where == "notify")
    fp = fault_point::notify;
  else
    throw bad();
  fault_action act;
  if (what == "fail")
    act = fault_action::fail;
  else if (what == "drop")
    act = fault_action::drop;
  else if (what == "delay")
    act = fault_action::delay;
  else if (what == "drop-pool" || what == "flip-pool") {
    // Every transfer loses pool P's puts, or gets one byte of it flipped in transit: the
    // destination's manifest check must fail it naming the pool.
    if (fp != fault_point::put || n < 0 || n >= int64_t(max_kv_pools)) throw bad();
    const fault_decision d{what == "drop-pool" ? fault_action::drop : fault_action::corrupt, 0, int32_t(n)};
    return [d](fault_point p, transfer_id, notify_kind) { return p == fault_point::put ? d : fault_decision{}; };
  } else
    throw bad();
  if (act == fault_action::delay) {
    // put:delay:MS holds every put (notify:delay:MS every notification) MS ms: a transfer
    // stays in flight long enough for a test to kill a node in the middle of it.
    if (n <= 0) throw bad();
    return [fp, n](fault_point p, transfer_id, notify_kind) {
      return p == fp ? fault_decision{fault_action::delay, n} : fault_decision{};
    };
  }
  auto left = std::make_shared<std::atomic<int64_t>>(n);
  return [fp, act, left](fault_point p, transfer_id, notify_kind) {
    if (p != fp || left->load() <= 0) return fault_decision{};
    left->fetch_sub(1);
    return fault_decision{act, 0};
  };
}

kv_port_factory make_kv_port_factory(kv_port_options options) {
  return [options](const kv_pools_layout& set, std::span<const int32_t> n_pages, kv_release_fn release,
                   std::shared_ptr<spdlog::logger> log) -> std::unique_ptr<kv_port> {
    return std::make_unique<ucx_kv_port>(options, set, n_pages, std::move(release), std::move(log));
  };
}

}  // namespace tandem::ucx
