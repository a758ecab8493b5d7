#pragma once
/// Cross-node KV handoffs in one place (issue 27), as plain classes (no actor, no transport):
/// - `kv_transfer_ids`, the prefill scheduler's generator of the transfer ids its handoffs
///   carry (a KvHandoff to decode and the kvSend to its worker name the same id);
/// - `kv_handoff_table`, the worker's table of the transfers it drives: the sends whose source
///   pages it writes to a decode node (it frees them itself when the send ends) and the
///   receives whose KV lands in pages its decode scheduler allocated (answered with kvDone),
///   both bounded by limits.kv_transfer_max_live, found by request id for aborts.
/// The worker drives the table through worker_kv (worker_kv.h); docs/kv_transfer.md, *Wiring*.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

namespace tandem {

/// Transfer ids of one prefill node: FNV-1a of the node name in the high 32 bits (ids of
/// different prefill nodes do not collide at a decode node), a counter in the low 32 bits.
class kv_transfer_ids {
 public:
  /// `first_seq` seeds the counter: the spawn time, so a restarted prefill (and its new worker)
  /// does not reuse the ids its predecessor left live at a decode node.
  kv_transfer_ids(const std::string& node, uint64_t first_seq) : base_(id_base(node)), seq_(first_seq) {}
  /// High 32 bits of a node's transfer ids (never 0, so no id is 0: 0 means "same node").
  static uint64_t id_base(const std::string& node);
  uint64_t next() { return base_ | (++seq_ & 0xffffffffull); }

 private:
  uint64_t base_;
  uint64_t seq_;
};

/// Which end of a transfer the worker is.
enum class kv_side : uint8_t { send, receive };

class kv_handoff_table {
 public:
  /// At most `max_live` sends and `max_live` receives are live at once (each side on its own).
  explicit kv_handoff_table(size_t max_live) : max_live_(max_live) {}

  /// Takes transfer `tid` of request `id` on `side`. Throws error(overloaded) naming
  /// limits.kv_transfer_max_live when `max_live` transfers of that side are live, and
  /// error(failed) when `tid` is 0 or live already; either way nothing is taken (refused).
  void start(kv_side side, uint64_t tid, const std::string& id);

  /// The newest live transfer of request `id` on `side` (to abort it), or 0.
  uint64_t find(kv_side side, const std::string& id) const;

  struct transfer {
    kv_side side;
    std::string id;  ///< the request
    bool aborted = false;
  };
  /// The live transfer `tid`, or null.
  const transfer* get(uint64_t tid) const;

  /// Marks `tid` aborted: true the first time (the transport is told once), false for an
  /// unknown transfer or one aborted before.
  bool abort(uint64_t tid);

  struct ended {
    kv_side side;
    std::string id;
  };
  /// Ends transfer `tid`: its side and request, or nullopt for a transfer this table never
  /// took or already ended (a late or duplicate completion: it frees nothing).
  std::optional<ended> finish(uint64_t tid, bool delivered);

  size_t live(kv_side side) const { return live_[int(side)]; }
  size_t live() const { return by_tid_.size(); }
  size_t max_live() const { return max_live_; }
  int64_t delivered(kv_side side) const { return delivered_[int(side)]; }
  int64_t failed(kv_side side) const { return failed_[int(side)]; }
  int64_t refused(kv_side side) const { return refused_[int(side)]; }

 private:
  static std::string key(kv_side side, const std::string& id) { return (side == kv_side::send ? "s:" : "r:") + id; }

  size_t max_live_;
  std::unordered_map<uint64_t, transfer> by_tid_;
  std::unordered_map<std::string, uint64_t> by_id_;  ///< key(side, id) -> newest tid
  size_t live_[2] = {0, 0};
  int64_t delivered_[2] = {0, 0}, failed_[2] = {0, 0}, refused_[2] = {0, 0};
};

}  // namespace tandem
