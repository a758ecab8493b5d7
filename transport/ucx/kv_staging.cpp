#include "transport/ucx/kv_staging.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"

namespace tandem::ucx {

kv_staging::kv_staging(backend::device device, kv_pools& device_pools, kv_pools& wire)
    : device_(std::move(device)), device_pools_(device_pools), wire_(wire) {
  if (!device_.staging.active())
    throw tandem::error(
        error_kind::unimplemented,
        fmt::format("KV transfers from {} memory need the device's staging copies, which it lacks; "
                    "use backend = \"cpu\" on this node",
                    device_.name));
  if (wire_.size() != device_pools_.size())
    throw tandem::error(
        fmt::format("KV staging: {} slot pools for {} device pools", wire_.size(), device_pools_.size()));
  for (size_t p = 0; p < wire_.size(); ++p) {
    if (!(wire_[p].layout() == device_pools_[p].layout()))
      throw tandem::error(fmt::format("KV staging: slot pool {} is {}, the device pool {}", p,
                                      wire_[p].layout().describe(), device_pools_[p].layout().describe()));
    slots_.emplace_back(wire_[p].n_pages());
    // Page-locked, so the device's DMA reads and writes it without a bounce copy.
    pinned_.push_back(device_.staging.pin && device_.staging.pin(wire_[p].data(), wire_[p].bytes()));
  }
}

kv_staging::~kv_staging() {
  for (size_t p = 0; p < pinned_.size(); ++p)
    if (pinned_[p] && device_.staging.unpin) device_.staging.unpin(wire_[p].data());
}

int32_t kv_staging::slots_for(int32_t pages, int32_t max_slots) {
  return std::max(1, std::min(pages, max_slots));
}

void kv_staging::check(const pool_pages& pages) const {
  for (size_t p = 0; p < pages.size() && p < slots_.size(); ++p) {
    const auto live = std::count_if(pages[p].begin(), pages[p].end(), [](int32_t x) { return x >= 0; });
    if (live > slots_[p].capacity())
      throw tandem::error(
          error_kind::failed,
          fmt::format("a KV transfer of {} pages of pool {} ({}) is larger than the staging area of "
                      "{} pages between {} memory and the network; raise TANDEM_KV_STAGING_MB or "
                      "lower the longest prompt",
                      live, p, wire_.set().pools[p].name, slots_[p].capacity(), device_.name));
  }
}

std::optional<pool_pages> kv_staging::lease(transfer_id id, const pool_pages& pages) {
  if (auto it = leases_.find(id); it != leases_.end()) return it->second;
  if (pages.size() != slots_.size())
    throw tandem::error(
        fmt::format("KV staging: pages of {} pools for a set of {}", pages.size(), slots_.size()));
  for (size_t p = 0; p < pages.size(); ++p)
    for (int32_t x : pages[p])
      if (x >= device_pools_[p].n_pages())
        throw tandem::error(
            fmt::format("KV staging: page {} outside pool {} of {} pages", x, p, device_pools_[p].n_pages()));
  for (size_t p = 0; p < pages.size(); ++p) {
    const auto live = std::count_if(pages[p].begin(), pages[p].end(), [](int32_t x) { return x >= 0; });
    if (live > slots_[p].capacity() - slots_[p].in_use()) {
      ++waits_;
      return std::nullopt;
    }
  }
  // Every pool fits: take them all (all or none).
  pool_pages out(pages.size());
  for (size_t p = 0; p < pages.size(); ++p) {
    const auto live =
        int32_t(std::count_if(pages[p].begin(), pages[p].end(), [](int32_t x) { return x >= 0; }));
    std::vector<int32_t> got = *slots_[p].acquire(live);  // checked above: it fits
    size_t next = 0;
    for (int32_t x : pages[p]) out[p].push_back(x < 0 ? -1 : got[next++]);
  }
  return leases_.emplace(id, std::move(out)).first->second;
}

const pool_pages* kv_staging::leased(transfer_id id) const {
  auto it = leases_.find(id);
  return it == leases_.end() ? nullptr : &it->second;
}

void kv_staging::release(transfer_id id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return;
  for (size_t p = 0; p < it->second.size(); ++p) {
    std::vector<int32_t> held;
    for (int32_t s : it->second[p])
      if (s >= 0) held.push_back(s);
    slots_[p].release(held);
  }
  leases_.erase(it);
}

void kv_staging::copy(const pool_pages& device_pages, const pool_pages& slots, bool to_wire) {
  if (to_wire && device_.staging.quiesce) device_.staging.quiesce();  // the KV writes are done
  uint64_t last = 0;
  bool any = false;
  for (size_t p = 0; p < device_pages.size(); ++p) {
    kv_pool& dev = device_pools_[p];
    kv_pool& wire = wire_[p];
    const size_t pb = dev.page_bytes();
    for (size_t i = 0; i < device_pages[p].size(); ++i) {
      const int32_t d = device_pages[p][i], s = slots[p][i];
      if (d < 0 || s < 0) continue;
      last = to_wire ? device_.staging.copy_async(wire.page_data(s), dev.page_data(d), pb)
                     : device_.staging.copy_async(dev.page_data(d), wire.page_data(s), pb);
      any = true;
      ++copies_;
      bytes_ += int64_t(pb);
    }
  }
  // One stream, in order: the last copy's fence covers every one.
  if (any) device_.staging.wait(last);
}

void kv_staging::stage_out(const pool_pages& pages, const pool_pages& slots) { copy(pages, slots, true); }

void kv_staging::stage_in(const pool_pages& slots, const pool_pages& pages) { copy(pages, slots, false); }

int32_t kv_staging::in_use() const {
  int32_t n = 0;
  for (const auto& s : slots_) n += s.in_use();
  return n;
}

std::vector<metric_sample> kv_staging::metrics_of(const kv_staging* s) {
  int32_t cap = 0;
  if (s)
    for (const auto& x : s->slots_) cap += x.capacity();
  return {
      {"kv_staging_slots", "", double(cap), "gauge",
       "Pinned host page slots KV transfers of a device pool go through (every pool; 0: pools in host "
       "memory)"},
      {"kv_staging_slots_in_use", "", double(s ? s->in_use() : 0), "gauge",
       "Staging slots leased by live KV transfers"},
      {"kv_staging_waits_total", "", double(s ? s->waits_ : 0), "counter",
       "Times a KV transfer step waited for staging slots (the area is full; it never grows)"},
      {"kv_staging_copies_total", "", double(s ? s->copies_ : 0), "counter",
       "Page copies between device memory and the staging slots"},
      {"kv_staging_bytes_total", "", double(s ? s->bytes_ : 0), "counter",
       "Bytes copied between device memory and the staging slots"},
  };
}

}  // namespace tandem::ucx
