#include "actors/worker/kv_handoff.h"

#include <fmt/format.h>

#include "kernels/base/error.h"

namespace tandem {

uint64_t kv_transfer_ids::id_base(const std::string& node) {
  uint32_t h = 2166136261u;
  for (unsigned char c : node) h = (h ^ c) * 16777619u;
  return uint64_t(h | 1u) << 32;
}

void kv_handoff_table::start(kv_side side, uint64_t tid, const std::string& id) {
  const char* what = side == kv_side::send ? "send" : "receive";
  if (tid == 0 || by_tid_.count(tid)) {
    refused_[int(side)] += 1;
    throw tandem::error(error_kind::failed,
                        fmt::format("request {}: KV {} with transfer id {:#x}, which is {}; each handoff needs a "
                                    "fresh transfer id",
                                    id, what, tid, tid == 0 ? "not a transfer" : "live already"));
  }
  if (live_[int(side)] >= max_live_) {
    refused_[int(side)] += 1;
    throw tandem::error(error_kind::overloaded,
                        fmt::format("request {}: {} KV {}s are live (limits.kv_transfer_max_live = {}); retry "
                                    "later or raise limits.kv_transfer_max_live",
                                    id, live_[int(side)], what, max_live_));
  }
  by_tid_.emplace(tid, transfer{side, id});
  by_id_[key(side, id)] = tid;
  live_[int(side)] += 1;
}

uint64_t kv_handoff_table::find(kv_side side, const std::string& id) const {
  auto it = by_id_.find(key(side, id));
  return it == by_id_.end() ? 0 : it->second;
}

const kv_handoff_table::transfer* kv_handoff_table::get(uint64_t tid) const {
  auto it = by_tid_.find(tid);
  return it == by_tid_.end() ? nullptr : &it->second;
}

bool kv_handoff_table::abort(uint64_t tid) {
  auto it = by_tid_.find(tid);
  if (it == by_tid_.end() || it->second.aborted) return false;
  it->second.aborted = true;
  return true;
}

std::optional<kv_handoff_table::ended> kv_handoff_table::finish(uint64_t tid, bool delivered) {
  auto it = by_tid_.find(tid);
  if (it == by_tid_.end()) return std::nullopt;
  ended out{it->second.side, std::move(it->second.id)};
  by_tid_.erase(it);
  // A request handed off again (after a recompute) has a newer transfer: keep that one's entry.
  if (auto b = by_id_.find(key(out.side, out.id)); b != by_id_.end() && b->second == tid) by_id_.erase(b);
  live_[int(out.side)] -= 1;
  (delivered ? delivered_ : failed_)[int(out.side)] += 1;
  return out;
}

}  // namespace tandem
