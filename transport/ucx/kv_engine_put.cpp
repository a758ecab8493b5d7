// kv_engine: the data path of a transfer, per pool of the layout set: the source's puts and
// the manifest it sends with `done`, the destination's check of that manifest; with device
// pools, the steps through the staging slots (kv_staging.h).
#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include <chrono>

#include "kernels/base/error.h"
#include "transport/ucx/kv_engine.h"

namespace tandem::ucx {

void kv_engine::send_descriptors_now(peer_id peer, transfer_id id, const pool_pages& dst_pages) {
  pool_pages wire_ids;
  const pool_pages* ids = &dst_pages;
  if (staging_) {
    if (!table_.phase(id)) return;  // ended while it waited: nothing to lease
    std::optional<pool_pages> slots;
    try {
      slots = staging_->lease(id, dst_pages);
    } catch (const std::exception& e) {
      // Never sent: the transfer fails at its deadline; say why now.
      if (options_.log) options_.log(true, fmt::format("KV transfer {:#x}: {}", id, e.what()));
      return;
    }
    if (!slots) {
      staging_waiting_.push_back([this, peer, id, dst_pages] { send_descriptors_now(peer, id, dst_pages); });
      return;
    }
    wire_ids = std::move(*slots);
    ids = &wire_ids;
  }
  auto it = peers_.find(peer);
  if (it != peers_.end() && it->second.ep && !it->second.closing)
    send_am(it->second, am_descriptors, encode_descriptors({id, *ids}));
}

transfer_table::release_fn kv_engine::staged_release(transfer_table::release_fn release) {
  return [this, release = std::move(release)](transfer_id id, transfer_role role, const pool_pages& pages,
                                               bool delivered) {
    // The table releases a transfer once nothing can land in its pages: nor in its slots.
    if (staging_) staging_->release(id);
    release(id, role, pages, delivered);
  };
}

void kv_engine::put_pages(peer_id peer, transfer_id id, const pool_pages& src_pages, const pool_pages& dst_pages) {
  auto d = fault(fault_point::put, id, notify_kind::started);
  if (d.action == fault_action::drop && d.pool < 0) return;  // never completes: the table's deadline handles it
  if (d.action == fault_action::fail) {
    later([this, id] { table_.on_put_complete(id, false, "injected put failure"); });
    return;
  }
  if (d.action == fault_action::delay) {
    delayed_.emplace(clock_.now_ms() + d.delay_ms,
                     [this, peer, id, src_pages, dst_pages] { do_put(peer, id, src_pages, dst_pages, {}); });
    return;
  }
  do_put(peer, id, src_pages, dst_pages, d);
}

bool kv_engine::put_pool(peer& p, size_t k, const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                         const uint8_t* corrupt_first) {
  kv_pool& pool = (*pools_)[k];
  const remote_pool& r = p.remote[k];
  const size_t page_bytes = pool.page_bytes();
  ucp_request_param_t rp{};  // no callback: completion is learnt from the flush
  auto put = [&](const uint8_t* local, uint64_t remote, size_t len) -> bool {
    ucs_status_ptr_t st = ucp_put_nbx(p.data_ep, local, len, remote, r.rkey, &rp);
    ++puts_issued_;
    if (UCS_PTR_IS_ERR(st)) return false;
    if (UCS_PTR_IS_PTR(st)) ucp_request_free(st);  // released by UCX when it completes
    return true;
  };
  // The first live page comes from the corrupted copy when a fault asks for one.
  size_t first = 0;
  while (first < src.size() && src[first] < 0) ++first;
  auto local = [&](size_t i) { return i == first && corrupt_first ? corrupt_first : pool.page_data(src[i]); };
  bool ok = true;
  if (options_.mode == put_mode::batched) {
    // Coalesce runs of consecutive source and destination pages into one put each.
    for (size_t i = 0; i < src.size() && ok;) {
      if (src[i] < 0) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      if (i != first || !corrupt_first)
        while (j < src.size() && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1) ++j;
      ok = put(local(i), r.base + uint64_t(dst[i]) * page_bytes, (j - i) * page_bytes);
      i = j;
    }
  } else {
    const size_t layer_bytes = pool.layout().layer_bytes();
    for (int32_t l = 0; l < pool.layout().n_layers && ok; ++l)
      for (size_t i = 0; i < src.size() && ok; ++i)
        if (src[i] >= 0)
          ok = put(local(i) + l * layer_bytes, r.base + uint64_t(dst[i]) * page_bytes + l * layer_bytes, layer_bytes);
  }
  return ok;
}

void kv_engine::do_put(peer_id peer, transfer_id id, const pool_pages& device_src, const pool_pages& dst,
                       fault_decision d) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.data_ep || it->second.remote.empty() || it->second.closing ||
      it->second.failed) {
    // Nothing was issued, so nothing can land: a plain failure.
    later([this, id] { table_.on_put_complete(id, false, "the KV peer is not connected"); });
    return;
  }
  auto& p = it->second;
  // Device pools: the pages go to staging slots first and the puts read the slots.
  pool_pages slots;
  if (staging_) {
    if (!table_.phase(id)) {
      // Ended while it waited (aborted: quarantined as if its puts flew): nothing was put.
      later([this, id] { table_.on_put_complete(id, false, "ended while waiting for staging slots"); });
      return;
    }
    std::optional<pool_pages> leased;
    try {
      leased = staging_->lease(id, device_src);
      if (leased) staging_->stage_out(device_src, *leased);
    } catch (const std::exception& e) {
      std::string why = fmt::format("staging the pages for the network: {}", e.what());
      later([this, id, why] { table_.on_put_complete(id, false, why); });
      return;
    }
    if (!leased) {
      staging_waiting_.push_back([this, peer, id, device_src, dst, d] { do_put(peer, id, device_src, dst, d); });
      return;
    }
    slots = std::move(*leased);
  }
  const pool_pages& src = staging_ ? slots : device_src;
  const kv_pools_layout& set = pools_->set();
  if (src.size() != set.pools.size() || dst.size() != src.size() || p.remote.size() != src.size()) {
    std::string why = fmt::format("pages of {} pools for a layout set of {} pools", src.size(), set.pools.size());
    later([this, id, why] { table_.on_put_complete(id, false, why); });
    return;
  }
  for (size_t k = 0; k < src.size(); ++k) {
    const int32_t local_n = (*pools_)[k].n_pages(), remote_n = p.remote[k].n_pages;
    for (size_t i = 0; i < src[k].size(); ++i) {
      const int32_t a = src[k][i], b = i < dst[k].size() ? dst[k][i] : -2;
      if ((a < 0 && b == -1) || (a >= 0 && a < local_n && b >= 0 && b < remote_n)) continue;
      std::string why = fmt::format("pool {} ({}): page {} -> {} is outside the pools ({} local, {} remote pages) "
                                    "or released on one side only",
                                    k, set.pools[k].name, a, b, local_n, remote_n);
      later([this, id, why] { table_.on_put_complete(id, false, why); });
      return;
    }
  }
  bool ok = true;
  std::vector<bool> dropped(src.size(), false);
  for (size_t k = 0; k < src.size() && ok; ++k) {
    const bool mine = d.pool == int32_t(k);
    if (mine && d.action == fault_action::drop) {
      dropped[k] = true;  // a pool the transfer forgot: the manifest counts no page of it
      continue;
    }
    const uint8_t* corrupt = nullptr;
    if (mine && d.action == fault_action::corrupt) {
      for (int32_t page : src[k]) {
        if (page < 0) continue;
        const kv_pool& pool = (*pools_)[k];
        auto& copy = corrupt_copies_[id]
                         .emplace_back(corrupt_copy{peer, {pool.page_data(page), pool.page_data(page) + pool.page_bytes()}})
                         .bytes;
        copy[copy.size() / 2] ^= 0x01;  // one bit of one byte, mid-page
        corrupt = copy.data();
        break;
      }
    }
    ok = put_pool(p, k, src[k], dst[k], corrupt);
  }
  if (!ok) {
    // Some puts may be in flight: only closing the endpoint makes the pages safe again.
    peer_failed(peer, p, fmt::format("KV peer '{}': ucp_put_nbx failed", p.node));
    return;
  }
  // The manifest of what was put, hashed while the puts fly (the pages do not change until the
  // table releases them). Sent with `done` after the flush.
  const auto t0 = std::chrono::steady_clock::now();
  kv_manifest m(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    if (dropped[k]) continue;
    m[k] = digest_pages((*pools_)[k], src[k]);
    manifest_bytes_ += uint64_t(m[k].pages) * (*pools_)[k].page_bytes();
  }
  manifest_us_ += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  sent_manifests_[id] = {peer, std::move(m)};
  // Remote completion of every put, then (on_flush_done) the notification.
  flush(peer, p.data_ep, id, 0);
}

std::string kv_engine::verify_received(peer_id peer, transfer_id id, const pool_pages& dst_pages, fail_reason& reason) {
  const kv_pools_layout& set = pools_->set();
  reason = fail_reason::manifest;
  if (!arriving_done_ || arriving_done_->transfer != id)
    return "the source's `done` carried no manifest; run the same tandem version on both nodes";
  // Device pools: the bytes arrived in the transfer's staging slots.
  const pool_pages* slots = staging_ ? staging_->leased(id) : nullptr;
  if (staging_ && !slots) return "no staging slots were leased for this transfer";
  const pool_pages& ids = slots ? *slots : dst_pages;
  if (dst_pages.size() != set.pools.size())
    return fmt::format("pages of {} pools for a layout set of {} pools", dst_pages.size(), set.pools.size());
  const auto t0 = std::chrono::steady_clock::now();
  kv_manifest here(ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    for (int32_t page : ids[k])
      if (page >= (*pools_)[k].n_pages())
        return fmt::format("pool {} ({}): page {} is outside the pool of {} pages", k, set.pools[k].name, page,
                           (*pools_)[k].n_pages());
    here[k] = digest_pages((*pools_)[k], ids[k]);
    manifest_bytes_ += uint64_t(here[k].pages) * (*pools_)[k].page_bytes();
  }
  manifest_us_ += std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
  std::string why = check_manifest(arriving_done_->manifest, here, set, reason);
  if (why.empty() && slots) {
    // Verified in the slots: now into the device pages (done before the KV counts as delivered).
    try {
      staging_->stage_in(*slots, dst_pages);
    } catch (const std::exception& e) {
      why = fmt::format("copying the received pages into {} memory: {}", options_.device.name, e.what());
    }
  }
  if (!why.empty() && options_.log) options_.log(true, fmt::format("KV transfer {:#x}: {}", id, why));
  return why;
}

}  // namespace tandem::ucx
