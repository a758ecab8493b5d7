#pragma once
/// A sequence's KV pages in every pool of a layout set (kernels/model/kv_pools.h) and their one
/// codec on the wire: the messages that carry pages keep pool 0 in `pages` (as before pools)
/// and pools 1.. in `extraPools`, so a one-pool layout's messages are unchanged.
#include <cstdint>
#include <vector>

#include "actors/common/wire.h"
#include "kernels/base/error.h"
#include "kernels/model/kv_pools.h"

namespace tandem {

/// Pools one message may carry (a layout set has at most this many).
constexpr unsigned max_kv_pools = 8;

/// Writes pools 1.. of `p` into a builder's `extraPools` (nothing for one pool).
template <class Builder>
void write_extra_pools(Builder b, const pool_pages& p) {
  if (p.size() < 2) return;
  auto ex = b.initExtraPools(static_cast<unsigned>(p.size() - 1));
  for (size_t k = 1; k < p.size(); ++k) {
    auto l = ex[static_cast<unsigned>(k - 1)].initPages(static_cast<unsigned>(p[k].size()));
    for (size_t i = 0; i < p[k].size(); ++i) l.set(static_cast<unsigned>(i), p[k][i]);
  }
}

/// Writes `p` into a builder with `pages` and `extraPools` fields.
template <class Builder>
void write_pool_pages(Builder b, const pool_pages& p) {
  if (p.empty()) return;
  auto l0 = b.initPages(static_cast<unsigned>(p[0].size()));
  for (size_t i = 0; i < p[0].size(); ++i) l0.set(static_cast<unsigned>(i), p[0][i]);
  write_extra_pools(b, p);
}

/// Pool 0's list (read from any List(Int32)) followed by the lists of `extraPools`. Throws
/// tandem::error (failed) beyond max_kv_pools pools.
template <class List0, class Reader>
pool_pages read_pool_pages(List0 first, Reader r) {
  pool_pages out;
  auto ex = r.getExtraPools();
  if (ex.size() + 1 > max_kv_pools)
    throw error(error_kind::failed, "a KV page message carries " + std::to_string(ex.size() + 1) +
                                        " pools; at most " + std::to_string(max_kv_pools) + " exist");
  out.resize(ex.size() + 1);
  out[0].reserve(first.size());
  for (auto x : first) out[0].push_back(x);
  for (unsigned k = 0; k < ex.size(); ++k)
    for (auto x : ex[k].getPages()) out[k + 1].push_back(x);
  return out;
}

/// Reads the pages of every pool from a reader with `pages` and `extraPools` fields; a
/// one-pool message gives one list.
template <class Reader>
pool_pages read_pool_pages(Reader r) {
  return read_pool_pages(r.getPages(), r);
}

}  // namespace tandem
