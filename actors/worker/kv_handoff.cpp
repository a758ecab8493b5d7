#include "actors/worker/kv_handoff.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem {

kv_send_table::kv_send_table(const std::string& node, uint64_t first_seq, size_t max_live)
    : base_(id_base(node)), seq_(first_seq), max_live_(max_live) {}

uint64_t kv_send_table::id_base(const std::string& node) {
  uint32_t h = 2166136261u;
  for (unsigned char c : node) h = (h ^ c) * 16777619u;
  return uint64_t(h | 1u) << 32;
}

uint64_t kv_send_table::start(const std::string& id) {
  if (by_tid_.size() >= max_live_)
    throw tandem::error(error_kind::overloaded,
                        fmt::format("request {}: {} KV sends are live (limits.kv_transfer_max_live = {}); retry "
                                    "later or raise limits.kv_transfer_max_live",
                                    id, by_tid_.size(), max_live_));
  const uint64_t tid = base_ | (++seq_ & 0xffffffffull);
  by_tid_[tid] = id;
  by_id_[id] = tid;
  return tid;
}

uint64_t kv_send_table::find(const std::string& id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? 0 : it->second;
}

std::optional<std::string> kv_send_table::finish(uint64_t tid, bool delivered) {
  auto it = by_tid_.find(tid);
  if (it == by_tid_.end()) return std::nullopt;
  std::string id = std::move(it->second);
  by_tid_.erase(it);
  // A request sent again (after a recompute) has a newer transfer: keep that one's entry.
  if (auto b = by_id_.find(id); b != by_id_.end() && b->second == tid) by_id_.erase(b);
  (delivered ? delivered_ : failed_) += 1;
  return id;
}

}  // namespace tandem
