#pragma once
/// The source side of cross-node KV handoffs, as a plain table (no actor, no transport): the
/// transfer ids, the sends whose source pages a worker is writing to a decode node, their bound
/// (limits.kv_transfer_max_live) and the decision when one ends (the source pages go back to
/// the cache tier whether delivered or not; the decode side applies the failure policy).
/// The prefill scheduler holds one today; it is the first piece of issue 27's "KV handoff in
/// one place" (docs/kv_transfer.md, "Handoff tables").
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>

namespace tandem {

class kv_send_table {
 public:
  /// `node` names the source node (the ids' high 32 bits); `first_seq` seeds the low 32 bits
  /// (the spawn time, so a restarted node does not reuse ids its predecessor left live at a
  /// decode node); at most `max_live` sends are live at once.
  kv_send_table(const std::string& node, uint64_t first_seq, size_t max_live);

  /// High 32 bits of a node's transfer ids (FNV-1a of the node name, never 0): ids of
  /// different prefill nodes do not collide at a decode node.
  static uint64_t id_base(const std::string& node);

  /// Starts the send of request `id`'s pages: its fresh transfer id. Throws
  /// error(overloaded) naming limits.kv_transfer_max_live when that many sends are live.
  uint64_t start(const std::string& id);

  /// The live send of request `id` (to abort it), or 0.
  uint64_t find(const std::string& id) const;

  /// Ends send `tid`: the request whose source pages are to be freed now, or nullopt for a
  /// transfer this table never started or already ended (a late or duplicate completion).
  std::optional<std::string> finish(uint64_t tid, bool delivered);

  size_t live() const { return by_tid_.size(); }
  size_t max_live() const { return max_live_; }
  int64_t delivered() const { return delivered_; }
  int64_t failed() const { return failed_; }

 private:
  uint64_t base_;
  uint64_t seq_;
  size_t max_live_;
  std::unordered_map<uint64_t, std::string> by_tid_;
  std::unordered_map<std::string, uint64_t> by_id_;
  int64_t delivered_ = 0, failed_ = 0;
};

}  // namespace tandem
