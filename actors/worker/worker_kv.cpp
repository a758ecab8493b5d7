#include "actors/worker/worker_kv.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem {

worker_kv::worker_kv(size_t max_live, kv_handoff_outputs out, std::shared_ptr<spdlog::logger> log)
    : table_(max_live), out_(std::move(out)), log_(std::move(log)) {}

void worker_kv::open(const kv_port_factory& factory, const kv_pools_layout& set, std::span<const int32_t> n_pages) {
  port_ = factory(
      set, n_pages,
      [this](uint64_t tid, bool delivered, const pool_pages& pages, const std::string& why) {
        on_release(tid, delivered, pages, why);
      },
      log_);
}

void worker_kv::send(kv_order o) { start(kv_side::send, std::move(o)); }

void worker_kv::receive(kv_order o) { start(kv_side::receive, std::move(o)); }

void worker_kv::start(kv_side side, kv_order o) {
  orders_ += 1;
  try {
    table_.start(side, o.transfer_id, o.id);
  } catch (const tandem::error& e) {
    // Refused: a send's pages go back (the decode side's receive fails by its deadline and
    // applies its failure policy); a receive is answered failed at once.
    log_->warn("request {}: KV {} refused: {}", o.id, side == kv_side::send ? "send" : "receive", e.what());
    ended(side, o.transfer_id, o.id, false, std::move(o.pages), e.what());
    return;
  }
  try {
    if (side == kv_side::send)
      port_->send(o.transfer_id, o.peer, o.pages);
    else
      port_->receive(o.transfer_id, o.peer, o.pages);
  } catch (const std::exception& e) {
    // Not started: the pages stayed ours.
    order_failures_ += 1;
    table_.finish(o.transfer_id, false);
    ended(side, o.transfer_id, o.id, false, std::move(o.pages), e.what());
  }
}

void worker_kv::abort(const std::string& id, uint64_t tid) {
  for (kv_side side : {kv_side::send, kv_side::receive}) {
    uint64_t t = tid;
    if (t == 0) {
      t = table_.find(side, id);
    } else if (const auto* x = table_.get(t); !x || x->side != side || x->id != id) {
      continue;
    }
    if (t == 0 || !table_.abort(t)) continue;
    // Its pages come back through on_release (after quarantine if a put may still land).
    log_->info("request {}: KV {} aborted", id, side == kv_side::send ? "send" : "receive");
    port_->abort(t);
  }
}

void worker_kv::on_release(uint64_t tid, bool delivered, const pool_pages& pages, const std::string& why) {
  auto e = table_.finish(tid, delivered);
  if (!e) {
    log_->error("kv transfer {:#x}: pages released for a transfer nobody ordered", tid);
    return;
  }
  ended(e->side, tid, e->id, delivered, pages, why);
}

void worker_kv::ended(kv_side side, uint64_t tid, const std::string& id, bool delivered, pool_pages pages,
                      const std::string& why) {
  if (side == kv_side::receive) {
    out_.receive_done(tid, id, delivered, pages, why);
    return;
  }
  // The source pages go back whether delivered or not (the prefix cache holds its own references).
  if (!delivered) log_->info("request {}: KV send ended without delivery: {}", id, why);
  out_.free_pages(id, pages);
}

std::vector<metric_sample> worker_kv::metrics() const {
  std::vector<metric_sample> m = port_ ? port_->metrics() : std::vector<metric_sample>{};
  const auto S = kv_side::send, R = kv_side::receive;
  m.push_back({"worker_transfer_orders_total", "", double(orders_), "counter",
               "KV transfer orders (send and receive) taken by the worker"});
  m.push_back({"worker_transfer_order_failures_total", "", double(order_failures_), "counter",
               "KV transfer orders the transport could not start (unknown peer, table full)"});
  m.push_back({"worker_transfers_live", "", double(table_.live()), "gauge",
               "KV transfers whose pages the worker's transport still holds"});
  m.push_back({"worker_kv_sends_inflight", "", double(table_.live(S)), "gauge",
               "Cross-node handoffs whose source pages this worker is writing to a decode node"});
  m.push_back({"worker_kv_sends_inflight_bound", "", double(table_.max_live()), "gauge",
               "limits.kv_transfer_max_live (a send beyond it is refused: rejections_total{actor=\"worker\",reason=\"kv_sends\"})"});
  m.push_back({"worker_kv_sends_total", "", double(table_.delivered(S)), "counter",
               "Cross-node handoffs whose KV pages this worker wrote to the decode node"});
  m.push_back({"worker_kv_send_failures_total", "", double(table_.failed(S)), "counter",
               "Cross-node handoffs whose KV send failed or was aborted"});
  m.push_back({"worker_kv_receives_inflight", "", double(table_.live(R)), "gauge",
               "Cross-node handoffs whose KV this worker is receiving (bound: limits.kv_transfer_max_live)"});
  for (auto [side, reason] : {std::pair{S, "kv_sends"}, std::pair{R, "kv_receives"}})
    if (table_.refused(side) > 0)
      m.push_back({"rejections_total", fmt::format("actor=\"worker\",reason=\"{}\"", reason),
                   double(table_.refused(side)), "counter", "Requests refused or ended early, by reason"});
  return m;
}

}  // namespace tandem
