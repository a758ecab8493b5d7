#pragma once
/// The KV engine's staging area for pools in device memory (a GPU's; Debian's UCX has no CUDA
/// transport, so UCX can neither register nor read them). Per pool of the layout set, a
/// bounded number of page slots in host memory UCX allocated and registered, page-locked
/// through the device (backend::staging_ops): the wire sees the slots instead of the device
/// pages. The destination's descriptors name slots, the peer's puts land there, and once the
/// manifest matched the slots are copied into the device pages; the source copies its device
/// pages into slots and puts from them.
///
/// A transfer leases every slot it needs at once (all or none) when its pages first cross
/// (the destination's descriptors, the source's puts) and returns them when the transfer
/// table releases its pages (so a slot is free only once nothing can land in it any more). A
/// full staging area never grows: the engine retries the step on its next progress (counted
/// in waits); a transfer larger than the area is refused at its start (check()).
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "actors/common/metrics.h"
#include "kernels/backend/device.h"
#include "kernels/backend/page_staging.h"
#include "kernels/model/kv_pools.h"
#include "transport/ucx/transfer_state.h"

namespace tandem::ucx {

class kv_staging {
 public:
  /// `wire`: the registered slot pools (one per pool of `device_pools`' set, same page
  /// layout); both must outlive this. Page-locks the wire memory through the device.
  kv_staging(backend::device device, kv_pools& device_pools, kv_pools& wire);
  ~kv_staging();
  kv_staging(const kv_staging&) = delete;
  kv_staging& operator=(const kv_staging&) = delete;

  /// Slots to stage a pool of `pages` device pages: at most `max_slots`, never more pages
  /// than the pool has, at least 1.
  static int32_t slots_for(int32_t pages, int32_t max_slots);

  /// Throws tandem::error (failed) naming the pool and the fix when `pages` needs more slots
  /// of a pool than it has (such a transfer could never start).
  void check(const pool_pages& pages) const;
  /// Slots for `pages` of transfer `id` (pool by pool, -1 entries kept as -1), leased until
  /// release(id); the same lease again for an id that has one. Nullopt (counted as a wait)
  /// when some pool has too few free slots.
  std::optional<pool_pages> lease(transfer_id id, const pool_pages& pages);
  /// The lease of `id`, or null.
  const pool_pages* leased(transfer_id id) const;
  /// Source: device `pages` -> their `slots`, done when this returns.
  void stage_out(const pool_pages& pages, const pool_pages& slots);
  /// Destination: `slots` -> device `pages`, done when this returns.
  void stage_in(const pool_pages& slots, const pool_pages& pages);
  /// Returns the slots of `id` (no-op without a lease).
  void release(transfer_id id);

  int32_t capacity(size_t pool) const { return slots_[pool].capacity(); }
  int32_t in_use() const;
  size_t leases() const { return leases_.size(); }
  int64_t waits() const { return waits_; }
  /// tandem_kv_staging_* metrics of `s`; zeros when null (pools in host memory).
  static std::vector<metric_sample> metrics_of(const kv_staging* s);

 private:
  /// Queues one page copy per live entry (`to_wire`: device -> slot) and waits for them.
  void copy(const pool_pages& device_pages, const pool_pages& slots, bool to_wire);

  backend::device device_;
  kv_pools& device_pools_;
  kv_pools& wire_;
  std::vector<backend::staging_slots> slots_;
  std::vector<bool> pinned_;
  std::map<transfer_id, pool_pages> leases_;
  int64_t waits_ = 0, copies_ = 0, bytes_ = 0;
};

}  // namespace tandem::ucx
