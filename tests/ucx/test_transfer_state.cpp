// KV transfer state machine under a seeded fake transport with injected faults.
#include <doctest/doctest.h>

#include <map>
#include <random>
#include <set>

#include "transport/ucx/transfer_state.h"

using namespace tandem;
using namespace tandem::ucx;

namespace {

/// Every page id of a transfer's pools (-1 entries are released window blocks, not pages).
std::vector<int32_t> flat(const pool_pages& pp) {
  std::vector<int32_t> v;
  for (const auto& p : pp)
    for (int32_t x : p)
      if (x >= 0) v.push_back(x);
  return v;
}

/// Two tables joined by a lossy, reordering network. Puts "land" (write the destination page
/// marker) when their event is delivered, unless the connection closed first.
struct fake_net {
  struct side;
  struct put_op {
    transfer_id id;
    std::vector<int32_t> src, dst;
    uint64_t epoch;
  };
  struct side final : transfer_transport {
    fake_net* net;
    int index;
    transfer_table* table = nullptr;
    side* other() { return &net->sides[1 - index]; }
    void connect(peer_id peer) override {
      net->post([this, peer, e = net->epoch] {
        if (e != net->epoch) return;
        if (net->roll(0.05))
          table->on_peer_failed(peer, "injected handshake failure");
        else
          table->on_peer_ready(peer);
      });
    }
    void send_descriptors(peer_id, transfer_id id, const pool_pages& dst) override {
      if (net->roll(net->drop_p)) return;
      net->post([this, id, dst, e = net->epoch] {
        if (e == net->epoch) other()->table->on_descriptors(1, id, dst);
      }, index);
    }
    void put_pages(peer_id, transfer_id id, const pool_pages& src_pools, const pool_pages& dst_pools) override {
      const std::vector<int32_t> src = flat(src_pools), dst = flat(dst_pools);
      double r = net->uniform(net->rng);
      if (r < net->drop_p) {  // never completes; only a close ends it
        net->in_flight[net->next_put++] = {id, src, dst, net->epoch};
        return;
      }
      if (r < 2 * net->drop_p) {  // fails before anything is issued
        net->post([this, id] { table->on_put_complete(id, false, "injected"); });
        return;
      }
      uint64_t key = net->next_put++;
      net->in_flight[key] = {id, src, dst, net->epoch};
      net->post([this, key] {
        auto it = net->in_flight.find(key);
        if (it == net->in_flight.end()) return;  // aborted by a close
        for (int32_t p : it->second.dst) {
          CHECK_MESSAGE(!net->released.count(p), "a put landed on a released page");
          net->marker[p] = it->second.id;
        }
        transfer_id id = it->second.id;
        net->in_flight.erase(it);
        table->on_put_complete(id, true, "");
      });
    }
    void notify(peer_id, transfer_id id, notify_kind kind) override {
      if (net->roll(net->drop_p)) return;
      net->post([this, id, kind, e = net->epoch] {
        if (e == net->epoch) other()->table->on_notify(1, id, kind);
      }, index);
    }
    void close_peer(peer_id) override {
      if (net->closing) return;
      net->closing = true;
      net->post([n = net] {
        ++n->epoch;  // every message and put of the old connection is lost
        n->in_flight.clear();
        n->closing = false;
        n->sides[0].table->on_peer_closed(1);
        n->sides[1].table->on_peer_closed(1);
      });
    }
  };

  explicit fake_net(uint64_t seed, double drop) : rng(seed), drop_p(drop) {
    sides[0].net = sides[1].net = this;
    sides[0].index = 0;
    sides[1].index = 1;
  }
  bool roll(double p) { return uniform(rng) < p; }
  /// `channel` 0/1: a message from that side; messages of one direction stay in order (as
  /// active messages on one UCX endpoint do). 2: unordered (puts, connects, closes).
  void post(std::function<void()> f, int channel = 2) { queue.emplace_back(channel, std::move(f)); }
  /// Delivers one queued event chosen at random, keeping each direction's messages in order.
  bool step() {
    if (queue.empty()) return false;
    size_t i = std::uniform_int_distribution<size_t>(0, queue.size() - 1)(rng);
    if (int ch = queue[i].first; ch != 2)
      for (size_t j = 0; j < i; ++j)
        if (queue[j].first == ch) {
          i = j;
          break;
        }
    auto f = std::move(queue[i].second);
    queue.erase(queue.begin() + long(i));
    f();
    return true;
  }
  bool touches(int32_t page, bool dst) const {
    for (auto& [k, op] : in_flight)
      for (int32_t p : dst ? op.dst : op.src)
        if (p == page) return true;
    return false;
  }

  std::mt19937_64 rng;
  std::uniform_real_distribution<double> uniform{0.0, 1.0};
  double drop_p;
  side sides[2];
  std::vector<std::pair<int, std::function<void()>>> queue;
  std::map<uint64_t, put_op> in_flight;
  uint64_t next_put = 0, epoch = 0;
  bool closing = false;
  std::map<int32_t, transfer_id> marker;  ///< destination page -> transfer whose KV landed there
  std::set<int32_t> released;            ///< pages of either side handed back
};

struct run_result {
  uint64_t done = 0, failed_pages = 0;
};

run_result run_seed(uint64_t seed, double drop) {
  manual_clock clock;
  fake_net net(seed, drop);
  std::map<int32_t, int> release_count;
  std::map<transfer_id, bool> dst_delivered, src_delivered;
  run_result res;
  auto release = [&](bool dst_side) {
    return [&, dst_side](transfer_id id, transfer_role role, const pool_pages& pools, bool delivered) {
      CHECK(role == (dst_side ? transfer_role::destination : transfer_role::source));
      const std::vector<int32_t> pages = flat(pools);
      for (int32_t p : pages) {
        CHECK_MESSAGE(++release_count[p] == 1, "page " << p << " released twice");
        CHECK_MESSAGE(!net.touches(p, dst_side), "page " << p << " released while a put may touch it");
        net.released.insert(p);
        if (dst_side && delivered) CHECK_MESSAGE(net.marker[p] == id, "done before the KV landed");
      }
      (dst_side ? dst_delivered : src_delivered)[id] = delivered;
      if (!delivered) res.failed_pages += pages.size();
    };
  };
  transfer_limits lim;
  lim.max_quarantined = 8;
  transfer_table src(clock, net.sides[0], lim, release(false));
  transfer_table dst(clock, net.sides[1], lim, release(true));
  net.sides[0].table = &src;
  net.sides[1].table = &dst;

  std::mt19937_64 rng(seed * 7919 + 1);
  auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  constexpr int n_transfers = 24;
  int32_t next_page = 0;
  std::vector<int> stage(n_transfers, 0);  // bit 1: src started, 2: dst started, 4: ready
  for (int iter = 0; iter < 4000; ++iter) {
    int a = pick(100);
    int t = pick(n_transfers);
    transfer_id id = transfer_id(t + 1);
    int n_pages = 1 + t % 4;
    // Odd transfers carry a second pool whose first block was released (-1 on both sides).
    auto shape = [&] {
      pool_pages pp(t % 2 ? 2 : 1);
      for (int i = 0; i < n_pages; ++i) pp[0].push_back(next_page++);
      if (t % 2) pp[1] = {-1, next_page++, next_page++};
      return pp;
    };
    if (a < 8 && !(stage[t] & 1)) {
      src.start_send(id, 1, shape());
      stage[t] |= 1;
    } else if (a < 16 && !(stage[t] & 2)) {
      dst.start_receive(id, 1, shape());
      stage[t] |= 2;
    } else if (a < 22 && (stage[t] & 1) && !(stage[t] & 4)) {
      src.source_ready(id);
      stage[t] |= 4;
    } else if (a < 23) {
      (pick(2) ? src : dst).abort(id);
    } else if (a < 30) {
      clock.advance_ms(pick(4000));
      src.tick();
      dst.tick();
    } else {
      net.step();
    }
  }
  // Quiesce: past every deadline, deliver everything, until nothing is left.
  for (int round = 0; round < 200; ++round) {
    while (net.step()) {
    }
    if (src.live() + dst.live() + src.quarantined_transfers() + dst.quarantined_transfers() == 0) break;
    clock.advance_ms(40000);
    src.tick();
    dst.tick();
  }
  CHECK(src.live() == 0);
  CHECK(dst.live() == 0);
  CHECK(src.quarantined_transfers() == 0);
  CHECK(dst.quarantined_transfers() == 0);
  CHECK(dst.quarantined_pages() == 0);
  for (int32_t p = 0; p < next_page; ++p) CHECK_MESSAGE(release_count[p] == 1, "page " << p << " not released once");
  for (auto& [id, ok] : dst_delivered)
    if (ok) res.done++;
  return res;
}

}  // namespace

TEST_CASE("transfer_state: every page is released exactly once under faults, 200 seeds") {
  uint64_t done = 0, failed = 0;
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    CAPTURE(seed);
    auto r = run_seed(seed, seed % 4 == 0 ? 0.0 : 0.05 * double(seed % 4));
    done += r.done;
    failed += r.failed_pages;
  }
  // The runs exercise both outcomes: clean transfers and failures.
  CHECK(done > 500);
  CHECK(failed > 500);
}

namespace {

/// Records what the table asks; delivers nothing by itself.
struct recording_transport final : transfer_transport {
  std::vector<std::string> calls;
  void connect(peer_id p) override { calls.push_back("connect " + std::to_string(p)); }
  std::string verify_failure;  ///< what verify_received answers (empty: the KV checks out)
  void send_descriptors(peer_id, transfer_id id, const pool_pages& d) override {
    calls.push_back("descriptors " + std::to_string(id) + " n=" + std::to_string(d.at(0).size()));
  }
  void put_pages(peer_id, transfer_id id, const pool_pages&, const pool_pages&) override {
    calls.push_back("put " + std::to_string(id));
  }
  std::string verify_received(peer_id, transfer_id id, const pool_pages&, fail_reason& reason) override {
    calls.push_back("verify " + std::to_string(id));
    reason = fail_reason::checksum;
    return verify_failure;
  }
  void notify(peer_id, transfer_id id, notify_kind k) override {
    calls.push_back("notify " + std::to_string(id) + " " + std::string(to_string(k)));
  }
  void close_peer(peer_id p) override { calls.push_back("close " + std::to_string(p)); }
};

struct released_log {
  std::vector<std::pair<transfer_id, bool>> log;
  transfer_table::release_fn fn() {
    return [this](transfer_id id, transfer_role, const pool_pages&, bool d) { log.emplace_back(id, d); };
  }
};

}  // namespace

TEST_CASE("transfer_state: a destination that times out quarantines its pages until the source is done") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_limits lim;
  transfer_table t(clock, tr, lim, rel.fn());
  t.start_receive(7, 3, {{10, 11}});
  CHECK(t.phase(7) == transfer_phase::bootstrapping);
  t.on_peer_ready(3);
  CHECK(t.phase(7) == transfer_phase::waiting);
  CHECK(tr.calls.back() == "descriptors 7 n=2");
  t.on_notify(3, 7, notify_kind::started);
  CHECK(t.phase(7) == transfer_phase::transferring);
  clock.advance_ms(lim.transferring_ms);
  t.tick();
  CHECK(t.failed(fail_reason::timeout_transferring) == 1);
  CHECK(tr.calls.back() == "notify 7 cancel");
  CHECK(t.quarantined(7));
  CHECK(t.quarantined_pages() == 2);
  CHECK(rel.log.empty());  // the source may still be writing
  t.on_notify(3, 7, notify_kind::failed);
  REQUIRE(rel.log.size() == 1);
  CHECK(rel.log[0] == std::make_pair(transfer_id(7), false));
  CHECK(t.quarantined_pages() == 0);
  // A second, late completion is ignored and counted.
  t.on_notify(3, 7, notify_kind::done);
  CHECK(t.late_events() == 1);
  CHECK(rel.log.size() == 1);
}

TEST_CASE("transfer_state: a quarantine past its deadline closes the peer, which releases the pages") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_limits lim;
  transfer_table t(clock, tr, lim, rel.fn());
  t.start_receive(1, 2, {{5}});
  t.on_peer_ready(2);
  t.abort(1);
  CHECK(t.quarantined(1));
  clock.advance_ms(lim.quarantine_ms);
  t.tick();
  CHECK(tr.calls.back() == "close 2");
  CHECK(rel.log.empty());
  t.tick();  // asked once
  CHECK(std::count(tr.calls.begin(), tr.calls.end(), "close 2") == 1);
  t.on_peer_closed(2);
  REQUIRE(rel.log.size() == 1);
  CHECK(t.quarantined_transfers() == 0);
}

TEST_CASE("transfer_state: a source frees its pages only after its puts complete") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_table t(clock, tr, {}, rel.fn());
  t.on_descriptors(4, 9, {{100, 101}});  // before start_send: kept
  t.start_send(9, 4, {{1, 2}});
  t.on_peer_ready(4);
  CHECK(t.phase(9) == transfer_phase::waiting);
  t.source_ready(9);
  CHECK(t.phase(9) == transfer_phase::transferring);
  CHECK(tr.calls.back() == "put 9");
  t.on_notify(4, 9, notify_kind::cancel);
  CHECK(rel.log.empty());  // the NIC may still read the pages
  CHECK(t.quarantined(9));
  t.on_put_complete(9, true, "");
  CHECK(tr.calls.back() == "notify 9 failed");
  REQUIRE(rel.log.size() == 1);
  CHECK(rel.log[0].second == false);
  t.on_put_complete(9, true, "");
  CHECK(t.late_events() == 1);
}

TEST_CASE("transfer_state: mismatched page counts fail the transfer and a full table rejects as overloaded") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_limits lim;
  lim.max_transfers = 1;
  transfer_table t(clock, tr, lim, rel.fn());
  t.start_send(1, 1, {{1, 2, 3}});
  t.on_peer_ready(1);
  t.on_descriptors(1, 1, {{7}});
  t.source_ready(1);
  CHECK(t.failed(fail_reason::bad_descriptors) == 1);
  CHECK(t.last_error().find("offered 1 pages for 3") != std::string::npos);
  CHECK(rel.log.size() == 1);
  t.start_send(2, 1, {{1}});
  try {
    t.start_send(3, 1, {{2}});
    FAIL("expected overloaded");
  } catch (const tandem::error& e) {
    CHECK(e.kind() == error_kind::overloaded);
  }
  bool found = false;
  for (auto& m : t.metrics())
    if (m.name == "kv_transfer_rejected_total") found = m.value == 1;
  CHECK(found);
}

TEST_CASE("transfer_state: pools whose released blocks differ between the sides fail naming the pool") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_table t(clock, tr, {}, rel.fn());
  t.name_pools({"full", "window"});
  t.start_send(1, 1, {{1, 2}, {-1, 3}});
  t.on_peer_ready(1);
  t.on_descriptors(1, 1, {{7, 8}, {9, 10}});
  t.source_ready(1);
  CHECK(t.failed(fail_reason::bad_descriptors) == 1);
  CHECK(t.last_error().find("pool 1 (window): block 0 is released on the source but held on the destination") !=
        std::string::npos);
  CHECK(std::count(tr.calls.begin(), tr.calls.end(), "put 1") == 0);
  REQUIRE(rel.log.size() == 1);
  CHECK_FALSE(rel.log[0].second);
  // Another pool count: named too.
  t.start_send(2, 1, {{1, 2}, {-1, 3}});
  t.on_descriptors(1, 2, {{7, 8}});
  t.source_ready(2);
  CHECK(t.last_error().find("pages of 1 pools for 2 source pools") != std::string::npos);
  // Matching masks put.
  t.start_send(3, 1, {{1, 2}, {-1, 3}});
  t.on_descriptors(1, 3, {{7, 8}, {-1, 10}});
  t.source_ready(3);
  CHECK(tr.calls.back() == "put 3");
}

TEST_CASE("transfer_state: a destination whose KV fails verification reports it failed, not delivered") {
  manual_clock clock;
  recording_transport tr;
  released_log rel;
  transfer_table t(clock, tr, {}, rel.fn());
  tr.verify_failure = "pool 1 (window): checksum differs";
  t.start_receive(5, 2, {{1}, {-1, 2}});
  t.on_peer_ready(2);
  t.on_notify(2, 5, notify_kind::started);
  t.on_notify(2, 5, notify_kind::done);
  CHECK(tr.calls.back() == "verify 5");  // no cancel: the source has flushed
  REQUIRE(rel.log.size() == 1);
  CHECK(rel.log[0] == std::make_pair(transfer_id(5), false));
  CHECK(t.failed(fail_reason::checksum) == 1);
  CHECK(t.last_error().find("KV transfer 5: pool 1 (window): checksum differs") != std::string::npos);
  CHECK(t.quarantined_transfers() == 0);
  bool found = false;
  for (auto& m : t.metrics())
    if (m.name == "kv_transfer_failed_total" && m.labels == "reason=\"checksum\"") found = m.value == 1;
  CHECK(found);
  // The same transfer that verifies is delivered.
  tr.verify_failure.clear();
  t.start_receive(6, 2, {{3}, {-1, 4}});
  t.on_notify(2, 6, notify_kind::done);
  REQUIRE(rel.log.size() == 2);
  CHECK(rel.log[1] == std::make_pair(transfer_id(6), true));
}
