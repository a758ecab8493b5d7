// Cross-node KV handoffs in one place (actors/worker/kv_handoff.h, worker_kv.h): the prefill's
// transfer ids, the worker's table of sends and receives (bound, refusals, which completions
// count), and the worker's handling over a fake port (who frees or is told what, exactly once).
#include <doctest/doctest.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <map>
#include <set>

#include "actors/worker/kv_handoff.h"
#include "actors/worker/worker_kv.h"
#include "kernels/base/error.h"

using namespace tandem;

TEST_CASE("kv_transfer_ids: ids carry the node's base and count up from the seed") {
  kv_transfer_ids ids("p0", 100);
  const uint64_t a = ids.next(), b = ids.next();
  CHECK((a >> 32) == (kv_transfer_ids::id_base("p0") >> 32));
  CHECK((a & 0xffffffffull) == 101);
  CHECK((b & 0xffffffffull) == 102);
  CHECK(kv_transfer_ids::id_base("p0") != kv_transfer_ids::id_base("p1"));
  CHECK(kv_transfer_ids::id_base("") != 0);
  // A restarted node seeds from its (later) spawn time: no id of its predecessor comes back.
  kv_transfer_ids again("p0", 100 + 64);
  CHECK(again.next() > b);
}

TEST_CASE("kv_handoff_table: a completion ends its transfer once, late and unknown ones nothing") {
  kv_handoff_table t(8);
  t.start(kv_side::send, 11, "r1");
  t.start(kv_side::receive, 12, "r2");
  CHECK(t.find(kv_side::send, "r1") == 11);
  CHECK(t.find(kv_side::receive, "r1") == 0);
  CHECK(t.find(kv_side::receive, "r2") == 12);
  CHECK(t.live(kv_side::send) == 1);
  CHECK(t.live() == 2);
  auto done = t.finish(11, true);
  REQUIRE(done);
  CHECK(done->id == "r1");
  CHECK(done->side == kv_side::send);
  CHECK_FALSE(t.finish(11, true));      // duplicate
  CHECK_FALSE(t.finish(12345, false));  // never started
  CHECK(t.find(kv_side::send, "r1") == 0);
  auto gone = t.finish(12, false);
  REQUIRE(gone);
  CHECK(gone->side == kv_side::receive);
  CHECK(t.delivered(kv_side::send) == 1);
  CHECK(t.failed(kv_side::receive) == 1);
  CHECK(t.live() == 0);
}

TEST_CASE("kv_handoff_table: the old send of a request sent again does not hide the new one") {
  kv_handoff_table t(8);
  t.start(kv_side::send, 1, "r1");
  t.start(kv_side::send, 2, "r1");  // recomputed and handed off again while the first ends
  CHECK(t.find(kv_side::send, "r1") == 2);
  REQUIRE(t.finish(1, false));
  CHECK(t.find(kv_side::send, "r1") == 2);  // still abortable
  REQUIRE(t.finish(2, true));
  CHECK(t.find(kv_side::send, "r1") == 0);
}

TEST_CASE("kv_handoff_table: more than max_live per side is refused as overloaded naming the limit") {
  kv_handoff_table t(2);
  t.start(kv_side::send, 1, "r1");
  t.start(kv_side::send, 2, "r2");
  try {
    t.start(kv_side::send, 3, "r3");
    FAIL("a third send was accepted");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::overloaded);
    CHECK(std::string(e.what()).find("kv_transfer_max_live") != std::string::npos);
  }
  CHECK(t.find(kv_side::send, "r3") == 0);
  CHECK(t.refused(kv_side::send) == 1);
  t.start(kv_side::receive, 4, "r4");  // the other side has its own bound
  CHECK_THROWS_AS(t.start(kv_side::receive, 1, "r5"), tandem::error);  // a live id again
  CHECK_THROWS_AS(t.start(kv_side::receive, 0, "r6"), tandem::error);  // 0 is no transfer
  CHECK(t.refused(kv_side::receive) == 2);
  REQUIRE(t.finish(1, true));
  t.start(kv_side::send, 3, "r3");  // room again
  CHECK(t.live(kv_side::send) == 2);
  CHECK(t.abort(3));
  CHECK_FALSE(t.abort(3));  // once
  CHECK_FALSE(t.abort(99));
}

namespace {

/// A kv_port that records the orders; the test ends transfers through `release`.
struct fake_port : kv_port {
  kv_release_fn release;
  std::unique_ptr<kv_pools> pools_;
  std::map<uint64_t, pool_pages> live;
  std::vector<uint64_t> aborted;
  bool refuse = false;
  kv_pools& pools() override { return *pools_; }
  void send(uint64_t tid, const std::string&, pool_pages pages) override { start(tid, std::move(pages)); }
  void receive(uint64_t tid, const std::string&, pool_pages pages) override { start(tid, std::move(pages)); }
  void start(uint64_t tid, pool_pages pages) {
    if (refuse) throw tandem::error(error_kind::overloaded, "KV transfer table full");
    live[tid] = std::move(pages);
  }
  void abort(uint64_t tid) override {
    aborted.push_back(tid);
    end(tid, false, "aborted");
  }
  void end(uint64_t tid, bool delivered, const std::string& why) {
    auto it = live.find(tid);
    if (it == live.end()) return;
    auto pages = std::move(it->second);
    live.erase(it);
    release(tid, delivered, pages, why);
  }
  bool progress() override { return false; }
  bool busy() const override { return !live.empty(); }
  std::vector<metric_sample> metrics() const override { return {}; }
};

struct rig {
  std::map<std::string, int> freed;  ///< request -> source pages freed
  std::vector<std::pair<std::string, bool>> done;  ///< receives answered (request, delivered)
  std::vector<std::string> why;
  fake_port* port = nullptr;
  std::unique_ptr<worker_kv> kv;

  explicit rig(size_t max_live) {
    kv_handoff_outputs out;
    out.free_pages = [this](const std::string& id, pool_pages& p) {
      for (auto& l : p) freed[id] += int(l.size());
      p.clear();
    };
    out.receive_done = [this](uint64_t, const std::string& id, bool delivered, const pool_pages&, const std::string& w) {
      done.emplace_back(id, delivered);
      why.push_back(w);
    };
    kv = std::make_unique<worker_kv>(max_live, std::move(out),
                                     std::make_shared<spdlog::logger>("t", std::make_shared<spdlog::sinks::null_sink_mt>()));
    const int32_t n = 0;
    kv->open(
        [this](const kv_pools_layout&, std::span<const int32_t>, kv_release_fn rel, std::shared_ptr<spdlog::logger>) {
          auto p = std::make_unique<fake_port>();
          p->release = std::move(rel);
          port = p.get();
          return p;
        },
        kv_pools_layout::single(kv_layout{}), std::span<const int32_t>(&n, 1));
  }
  static kv_order order(uint64_t tid, const std::string& id, int pages) {
    return kv_order{tid, id, "d0", pool_pages{std::vector<int32_t>(size_t(pages), 7)}};
  }
  double metric(const std::string& name) const {
    for (const auto& m : kv->metrics())
      if (m.name == name) return m.value;
    return -1;
  }
};

}  // namespace

TEST_CASE("worker_kv: a send's source pages go back to the cache tier once, however it ends") {
  rig r(8);
  r.kv->send(rig::order(1, "r1", 3));
  r.kv->send(rig::order(2, "r2", 2));
  r.kv->send(rig::order(3, "r3", 1));
  CHECK(r.freed.empty());  // the worker holds them while they are written out
  CHECK(r.metric("worker_kv_sends_inflight") == 3);
  r.port->end(1, true, "");
  r.port->end(2, false, "peer failed");
  r.port->end(1, true, "");  // a duplicate release frees nothing
  CHECK(r.freed == std::map<std::string, int>{{"r1", 3}, {"r2", 2}});
  // An abort by request id (the prefill knows no transfer id): idempotent, unknown ids ignored.
  r.kv->abort("r3", 0);
  r.kv->abort("r3", 0);
  r.kv->abort("nobody", 0);
  CHECK(r.port->aborted == std::vector<uint64_t>{3});
  CHECK(r.freed["r3"] == 1);
  CHECK(r.done.empty());  // nothing goes back to the prefill or to decode
  CHECK(r.metric("worker_kv_sends_total") == 1);
  CHECK(r.metric("worker_kv_send_failures_total") == 2);
  CHECK(r.metric("worker_kv_sends_inflight") == 0);
  CHECK(r.metric("worker_transfers_live") == 0);
}

TEST_CASE("worker_kv: a send refused by the bound or by the port frees its pages at once") {
  rig r(1);
  r.kv->send(rig::order(1, "r1", 2));
  r.kv->send(rig::order(2, "r2", 4));  // beyond limits.kv_transfer_max_live
  CHECK(r.freed == std::map<std::string, int>{{"r2", 4}});
  CHECK(r.port->live.count(2) == 0);
  r.port->end(1, true, "");
  r.port->refuse = true;
  r.kv->send(rig::order(3, "r3", 5));
  CHECK(r.freed["r3"] == 5);
  CHECK(r.metric("worker_transfer_order_failures_total") == 1);
  CHECK(r.metric("worker_kv_sends_inflight") == 0);
  bool counted = false;
  for (const auto& m : r.kv->metrics())
    if (m.name == "rejections_total" && m.labels == "actor=\"worker\",reason=\"kv_sends\"") counted = m.value == 1;
  CHECK(counted);
}

TEST_CASE("worker_kv: a receive is answered once, arrived or failed with why, and its pages stay decode's") {
  rig r(1);
  r.kv->receive(rig::order(5, "r5", 2));
  r.kv->receive(rig::order(6, "r6", 2));  // refused: answered failed at once, naming the bound
  REQUIRE(r.done.size() == 1);
  CHECK(r.done[0] == std::pair<std::string, bool>{"r6", false});
  CHECK(r.why[0].find("kv_transfer_max_live") != std::string::npos);
  r.port->end(5, true, "");
  REQUIRE(r.done.size() == 2);
  CHECK(r.done[1] == std::pair<std::string, bool>{"r5", true});
  // An abort names the transfer: another transfer id of the request is left alone.
  r.kv->receive(rig::order(7, "r7", 1));
  r.kv->abort("r7", 8);
  CHECK(r.port->aborted.empty());
  r.kv->abort("r7", 7);
  REQUIRE(r.done.size() == 3);
  CHECK(r.done[2] == std::pair<std::string, bool>{"r7", false});
  CHECK(r.freed.empty());  // the decode scheduler frees or keeps destination pages itself
  CHECK(r.metric("worker_kv_receives_inflight") == 0);
}
