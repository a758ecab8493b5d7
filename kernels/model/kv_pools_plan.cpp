#include "kernels/model/kv_pools_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "kernels/base/error.h"

namespace tandem {

int64_t usable_prefix(const kv_pools_layout& set, int64_t matched,
                      const std::function<bool(size_t pool, int64_t block)>& present) {
  const int64_t ps = set.page_size();
  if (ps <= 0 || matched < ps) return 0;
  // Full pools' blocks form a prefix: the longest run from block 0 bounds every candidate.
  int64_t blocks = matched / ps;
  for (size_t p = 0; p < set.pools.size(); ++p) {
    if (set.pools[p].window_tokens > 0) continue;
    int64_t b = 0;
    while (b < blocks && present(p, b)) ++b;
    blocks = b;
  }
  // Window pools: the candidate P = blocks * ps needs its window's blocks; shorten until found.
  for (; blocks > 0; --blocks) {
    const int64_t P = blocks * ps;
    bool ok = true;
    for (size_t p = 0; p < set.pools.size() && ok; ++p) {
      const kv_pool_spec& s = set.pools[p];
      if (s.window_tokens <= 0) continue;
      for (int64_t b = s.first_live_block(P); b < blocks && ok; ++b) ok = present(p, b);
    }
    if (ok) return P;
  }
  return 0;
}

pool_split split_pool_bytes(const kv_pools_layout& set, std::span<const int64_t> device_pages, uint64_t bytes,
                            const std::string& what) {
  pool_split s;
  if (device_pages.size() != set.pools.size())
    throw tandem::error(
        fmt::format("{} device page counts for {} KV pools", device_pages.size(), set.pools.size()));
  // Weights: the device pools' bytes W = sum(device_pages_p x page_bytes_p). Pool p gets
  // floor(bytes x w_p / W / page_bytes_p) = floor(bytes x device_pages_p / W) pages, at least
  // one once bytes >= W / device_pages_p (exact integer arithmetic: no pool lost to rounding).
  using u128 = unsigned __int128;
  u128 total = 0;
  uint64_t fewest = UINT64_MAX;
  for (size_t p = 0; p < set.pools.size(); ++p) {
    total += u128(uint64_t(std::max<int64_t>(0, device_pages[p]))) * set.pools[p].page.page_bytes();
    fewest = std::min(fewest, uint64_t(std::max<int64_t>(1, device_pages[p])));
  }
  if (total == 0) total = 1;
  s.min_bytes = uint64_t((total + fewest - 1) / fewest);
  for (size_t p = 0; p < set.pools.size(); ++p) {
    s.pages.push_back(int64_t(u128(bytes) * uint64_t(std::max<int64_t>(0, device_pages[p])) / total));
    if (s.pages.back() < 1 && s.problem.empty())
      s.problem = fmt::format(
          "{} gives the {} KV pool ({} bytes a page) no page: split across the pools in "
          "proportion to their device pools, it needs at least {} bytes ({:.4f} GiB)",
          what, set.pools[p].name, set.pools[p].page.page_bytes(), s.min_bytes,
          double(s.min_bytes) / double(1ull << 30));
  }
  return s;
}

}  // namespace tandem
