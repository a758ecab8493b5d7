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

}  // namespace tandem
