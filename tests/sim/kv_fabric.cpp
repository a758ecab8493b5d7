#include "tests/sim/kv_fabric.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/base/error.h"
#include "transport/ucx/kv_handshake.h"

namespace tandem::sim {

namespace {

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/// Appends the checksum the receiver verifies (the link layer's CRC of a real fabric).
void seal(std::vector<uint8_t>& b) {
  uint64_t h = fnv1a(b.data(), b.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&h);
  b.insert(b.end(), p, p + 8);
}

/// The payload without its checksum, or false if the checksum does not match.
bool unseal(std::vector<uint8_t>& b) {
  if (b.size() < 8) return false;
  uint64_t h;
  std::memcpy(&h, b.data() + b.size() - 8, 8);
  b.resize(b.size() - 8);
  return fnv1a(b.data(), b.size()) == h;
}

}  // namespace

/// A node's worker port over the fabric: the real transfer_table, a heap pool (one pool: the
/// simulation's fake model has no sliding-window layers).
class sim_kv_port final : public kv_port, public ucx::transfer_transport {
 public:
  sim_kv_port(kv_fabric& f, int32_t self, const kv_layout& layout, int32_t n_pages, kv_release_fn release)
      : f_(f),
        self_(self),
        pool_(layout, n_pages),
        pools_(pool_),
        release_(std::move(release)),
        table_(f.clock_, *this, f.limits_,
               [this](ucx::transfer_id tid, ucx::transfer_role, const pool_pages& pages, bool delivered) {
                 if (delivered) ++f_.done_;
                 release_(tid, delivered, pages, delivered ? std::string() : table_.last_error());
               }) {
    f_.attach(this);
  }
  ~sim_kv_port() override { f_.detach(this); }

  kv_pools& pools() override { return pools_; }
  void send(uint64_t tid, const std::string& dst, pool_pages pages) override {
    table_.start_send(tid, f_.id_of(dst), std::move(pages));
    table_.source_ready(tid);
  }
  void receive(uint64_t tid, const std::string& src, pool_pages pages) override {
    table_.start_receive(tid, f_.id_of(src), std::move(pages));
  }
  void abort(uint64_t tid) override { table_.abort(tid); }
  bool progress() override {
    bool moved = f_.deliver(*this);
    table_.tick();
    return moved;
  }
  bool busy() const override { return table_.live() > 0 || table_.quarantined_transfers() > 0; }
  std::vector<metric_sample> metrics() const override { return table_.metrics(); }

  // transfer_transport
  void connect(ucx::peer_id peer) override { f_.connect(self_, int32_t(peer)); }
  void send_descriptors(ucx::peer_id peer, ucx::transfer_id id, const pool_pages& dst_pages) override {
    f_.send_control(self_, int32_t(peer), kv_fabric::kind::descriptors, id, ucx::encode_descriptors({id, dst_pages}));
  }
  void put_pages(ucx::peer_id peer, ucx::transfer_id id, const pool_pages& src_pages,
                 const pool_pages& dst_pages) override {
    f_.put(*this, int32_t(peer), id, src_pages.at(0), dst_pages.at(0));
  }
  void notify(ucx::peer_id peer, ucx::transfer_id id, ucx::notify_kind kind) override {
    std::vector<uint8_t> b(9);  // the engine's framing: id, kind
    std::memcpy(b.data(), &id, 8);
    b[8] = uint8_t(kind);
    f_.send_control(self_, int32_t(peer), kv_fabric::kind::notify, id, std::move(b));
  }
  void close_peer(ucx::peer_id peer) override { f_.close(self_, int32_t(peer)); }

  kv_fabric& f_;
  const int32_t self_;
  uint64_t gen_ = 0;  ///< set by attach: packets for an earlier port of this node are not ours
  kv_pool pool_;
  kv_pools pools_;
  kv_release_fn release_;
  ucx::transfer_table table_;
};

kv_fabric::kv_fabric(const cluster_clock& clock, sim_rng& rng, kv_fault_menu faults, ucx::transfer_limits limits,
                     std::function<void(std::string)> note)
    : clock_(clock), rng_(rng), f_(faults), limits_(limits), note_(std::move(note)) {}

kv_fabric::~kv_fabric() = default;

kv_port_factory kv_fabric::factory(const std::string& node) {
  const int32_t self = id_of(node);
  return [this, self](const kv_pools_layout& set, std::span<const int32_t> n_pages, kv_release_fn release,
                      std::shared_ptr<spdlog::logger>) -> std::unique_ptr<kv_port> {
    if (set.pools.size() != 1 || n_pages.size() != 1)
      throw tandem::error(error_kind::unimplemented, "the simulated KV fabric moves one pool");
    return std::make_unique<sim_kv_port>(*this, self, set.pools[0].page, n_pages[0], std::move(release));
  };
}

int32_t kv_fabric::id_of(const std::string& node) {
  for (size_t i = 0; i < names_.size(); ++i)
    if (names_[i] == node) return int32_t(i);
  names_.push_back(node);
  return int32_t(names_.size() - 1);
}

uint64_t kv_fabric::epoch(int32_t a, int32_t b) const {
  auto it = conn_.find(pair_key(a, b));
  return it == conn_.end() ? 0 : it->second;
}

void kv_fabric::attach(sim_kv_port* p) {
  p->gen_ = ++next_gen_;
  ports_[p->self_] = p;
}

void kv_fabric::detach(sim_kv_port* p) {
  auto it = ports_.find(p->self_);
  if (it == ports_.end() || it->second != p) return;
  node_down(names_[size_t(p->self_)]);
}

void kv_fabric::node_down(const std::string& node) {
  const int32_t n = id_of(node);
  ports_.erase(n);
  std::vector<int32_t> others;
  for (auto& [key, e] : conn_) {
    const auto a = int32_t(key >> 32), b = int32_t(key & 0xffffffffu);
    if (a == n || b == n) others.push_back(a == n ? b : a);
  }
  for (int32_t o : others) {
    conn_.erase(pair_key(n, o));
    packet p;
    p.to = o;
    p.from = n;
    p.k = kind::failed;
    p.why = fmt::format("KV peer node {} is gone", node);
    push(std::move(p), false);
  }
}

void kv_fabric::partition(const std::string& a, const std::string& b, int64_t until_ms) {
  const int32_t x = id_of(a), y = id_of(b);
  partitioned_until_[pair_key(x, y)] = until_ms;
  if (epoch(x, y) == 0) return;
  conn_.erase(pair_key(x, y));
  for (auto [to, from] : {std::pair{x, y}, std::pair{y, x}}) {
    packet p;
    p.to = to;
    p.from = from;
    p.k = kind::failed;
    p.why = fmt::format("KV connection to node {} broke (network partition)", names_[size_t(from)]);
    push(std::move(p), false);
  }
}

void kv_fabric::push(packet p, bool faultable) {
  p.due_ms = clock_.now_ms();
  auto port = ports_.find(p.to);
  if (port == ports_.end()) return;  // a node that is down receives nothing
  p.to_gen = port->second->gen_;
  const bool control = p.k == kind::descriptors || p.k == kind::notify;
  if (faultable) {
    // Every draw happens whatever the outcome, so one fault's probability does not shift the others.
    const bool drop = rng_.chance(f_.drop), delay = rng_.chance(f_.delay), dup = rng_.chance(f_.duplicate),
               corrupt = rng_.chance(f_.corrupt);
    const int64_t d = rng_.between(1, std::max(1, f_.max_delay_ms));
    const auto what = p.k == kind::put ? "put" : p.k == kind::descriptors ? "descriptors" : "notification";
    if (drop) {
      ++faults_;
      note_(fmt::format("kv fault: {} of transfer {:#x} {}->{} lost", what, p.id, names_[size_t(p.from)],
                        names_[size_t(p.to)]));
      return;
    }
    if (delay) {
      ++faults_;
      p.due_ms += d;
    }
    if (corrupt && !p.bytes.empty()) {
      ++faults_;
      note_(fmt::format("kv fault: {} of transfer {:#x} corrupted", what, p.id));
      p.bytes[size_t(rng_.below(p.bytes.size()))] ^= uint8_t(1u << rng_.below(8));
    }
    if (dup && control) {
      ++faults_;
      note_(fmt::format("kv fault: {} of transfer {:#x} duplicated", what, p.id));
      packet c = p;
      c.seq = next_seq_++;
      c.due_ms += rng_.between(0, std::max(1, f_.max_delay_ms));
      auto key = std::make_pair(c.due_ms, c.seq);
      q_.emplace(key, std::move(c));
    }
  }
  p.seq = next_seq_++;
  auto key = std::make_pair(p.due_ms, p.seq);
  q_.emplace(key, std::move(p));
}

void kv_fabric::connect(int32_t from, int32_t to) {
  packet p;
  p.from = to;  // the event is about peer `to`
  p.to = from;
  auto cut = partitioned_until_.find(pair_key(from, to));
  if (!ports_.count(to) || (cut != partitioned_until_.end() && clock_.now_ms() < cut->second)) {
    p.k = kind::failed;
    p.why = fmt::format("KV peer node {} does not answer", names_[size_t(to)]);
    push(std::move(p), false);
    return;
  }
  uint64_t e = epoch(from, to);
  if (e == 0) {
    e = next_epoch_++;
    conn_[pair_key(from, to)] = e;
    packet q;  // the acceptor learns of the connection too
    q.from = from;
    q.to = to;
    q.k = kind::ready;
    q.epoch = e;
    push(std::move(q), false);
  }
  p.k = kind::ready;
  p.epoch = e;
  push(std::move(p), false);
}

void kv_fabric::break_pair(int32_t a, int32_t b, int32_t closer, const std::string& why) {
  conn_.erase(pair_key(a, b));
  const int32_t other = closer == a ? b : a;
  packet c;  // the closer's close completes
  c.to = closer;
  c.from = other;
  c.k = kind::closed;
  push(std::move(c), false);
  packet f;  // the other side's endpoint breaks
  f.to = other;
  f.from = closer;
  f.k = kind::failed;
  f.why = why;
  push(std::move(f), false);
}

void kv_fabric::close(int32_t from, int32_t to) {
  if (epoch(from, to) != 0) {
    break_pair(from, to, from, fmt::format("KV peer node {} closed the connection", names_[size_t(from)]));
    return;
  }
  packet c;
  c.to = from;
  c.from = to;
  c.k = kind::closed;
  push(std::move(c), false);
}

void kv_fabric::send_control(int32_t from, int32_t to, kind k, ucx::transfer_id id, std::vector<uint8_t> bytes) {
  const uint64_t e = epoch(from, to);
  if (e == 0 || !ports_.count(from)) return;  // no connection: best effort, lost
  seal(bytes);
  packet p;
  p.from = from;
  p.to = to;
  p.epoch = e;
  p.k = k;
  p.id = id;
  p.bytes = std::move(bytes);
  push(std::move(p), true);
}

void kv_fabric::put(sim_kv_port& src, int32_t to, ucx::transfer_id id, const std::vector<int32_t>& src_pages,
                    const std::vector<int32_t>& dst_pages) {
  const uint64_t e = epoch(src.self_, to);
  packet p;
  p.from = src.self_;
  p.id = id;
  if (e == 0 || rng_.chance(f_.put_fail)) {
    // Nothing was issued: a plain failure.
    p.to = src.self_;
    p.k = kind::put_done;
    p.ok = false;
    p.why = e == 0 ? "the KV peer is not connected" : "injected put failure";
    if (e != 0) ++faults_;
    push(std::move(p), false);
    return;
  }
  // As the engine: page ids outside either pool fail the put (descriptors are untrusted input).
  auto dst = ports_.find(to);
  const int32_t dst_n = dst == ports_.end() ? 0 : dst->second->pool_.n_pages();
  for (size_t i = 0; i < src_pages.size(); ++i)
    if (src_pages[i] < 0 || src_pages[i] >= src.pool_.n_pages() || i >= dst_pages.size() || dst_pages[i] < 0 ||
        dst_pages[i] >= dst_n) {
      p.to = src.self_;
      p.k = kind::put_done;
      p.ok = false;
      p.why = fmt::format("page {} is outside the pools ({} local, {} remote pages)", src_pages[i],
                          src.pool_.n_pages(), dst_n);
      push(std::move(p), false);
      return;
    }
  const size_t page_bytes = src.pool_.layout().page_bytes();
  for (int32_t s : src_pages) {
    const auto* b = src.pool_.page_data(s);
    p.bytes.insert(p.bytes.end(), b, b + page_bytes);
  }
  seal(p.bytes);
  p.to = to;
  p.epoch = e;
  p.k = kind::put;
  p.dst_pages = dst_pages;
  push(std::move(p), true);
}

bool kv_fabric::deliver(sim_kv_port& port) {
  auto it = ports_.find(port.self_);
  if (it == ports_.end() || it->second != &port) return false;
  const int64_t now = clock_.now_ms();
  std::vector<packet> mine;
  for (auto i = q_.begin(); i != q_.end() && i->first.first <= now;) {
    if (i->second.to == port.self_) {
      mine.push_back(std::move(i->second));
      i = q_.erase(i);
    } else {
      ++i;
    }
  }
  auto& t = port.table_;
  for (auto& p : mine) {
    if (ports_.count(port.self_) == 0 || ports_[port.self_] != &port) break;  // went down meanwhile
    const auto peer = ucx::peer_id(p.from);
    if (p.to_gen != port.gen_) continue;  // for an earlier port of this node
    if (p.epoch != 0 && epoch(p.from, p.to) != p.epoch) continue;  // its connection closed: never lands
    switch (p.k) {
      case kind::ready: t.on_peer_ready(peer); break;
      case kind::failed: t.on_peer_failed(peer, p.why); break;
      case kind::closed: t.on_peer_closed(peer); break;
      case kind::put_done: t.on_put_complete(p.id, p.ok, p.why); break;
      case kind::descriptors:
      case kind::notify: {
        try {
          if (!unseal(p.bytes)) throw tandem::error("message checksum mismatch");
          if (p.k == kind::descriptors) {
            auto d = ucx::decode_descriptors(p.bytes.data(), p.bytes.size());
            t.on_descriptors(peer, d.transfer, std::move(d.pages));
          } else {
            if (p.bytes.size() != 9 || p.bytes[8] > uint8_t(ucx::notify_kind::cancel))
              throw tandem::error("malformed KV notification");
            ucx::transfer_id tid;
            std::memcpy(&tid, p.bytes.data(), 8);
            t.on_notify(peer, tid, ucx::notify_kind(p.bytes[8]));
          }
        } catch (const std::exception& e) {
          // As the engine: a malformed message from a peer fails that peer.
          t.on_peer_failed(peer, fmt::format("KV peer '{}': {}", names_[size_t(p.from)], e.what()));
        }
        break;
      }
      case kind::put: {
        const bool intact = unseal(p.bytes);
        const size_t page_bytes = port.pool_.layout().page_bytes();
        if (!t.phase(p.id)) {
          violations_.push_back(fmt::format("node {}: a put of KV transfer {:#x} landed after the destination "
                                            "released its pages",
                                            names_[size_t(port.self_)], p.id));
        } else {
          for (size_t i = 0; i < p.dst_pages.size() && (i + 1) * page_bytes <= p.bytes.size(); ++i)
            std::memcpy(port.pool_.page_data(p.dst_pages[i]), p.bytes.data() + i * page_bytes, page_bytes);
        }
        packet d;
        d.from = p.to;
        d.to = p.from;
        d.epoch = p.epoch;
        d.k = kind::put_done;
        d.id = p.id;
        d.ok = intact;
        d.why = intact ? "" : "the fabric saw corrupted data (checksum)";
        push(std::move(d), false);
        break;
      }
    }
  }
  return !mine.empty();
}

std::vector<std::string> kv_fabric::in_flight() const {
  std::vector<std::string> v;
  for (const auto& [n, p] : ports_)
    if (p->table_.live() > 0 || p->table_.quarantined_transfers() > 0)
      v.push_back(fmt::format("node {}: {} live, {} quarantined KV transfers", names_[size_t(n)], p->table_.live(),
                              p->table_.quarantined_transfers()));
  return v;
}

}  // namespace tandem::sim
