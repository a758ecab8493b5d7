#include "actors/common/seq_fork.h"

#include <algorithm>

namespace tandem {

fork_plan plan_fork(const pool_pages& t, int64_t first_write, int32_t page_size) {
  fork_plan p;
  p.copy_block = std::max<int64_t>(0, first_write) / std::max(1, page_size);
  p.shared.resize(t.size());
  p.copy_from.assign(t.size(), -1);
  for (size_t k = 0; k < t.size(); ++k) {
    const auto& tab = t[k];
    for (int64_t b = 0; b < p.copy_block && b < int64_t(tab.size()); ++b)
      if (tab[size_t(b)] >= 0) p.shared[k].push_back(tab[size_t(b)]);
    if (p.copy_block < int64_t(tab.size())) p.copy_from[k] = tab[size_t(p.copy_block)];
  }
  return p;
}

pool_pages fork_tables(const pool_pages& t, const fork_plan& plan, std::span<const int32_t> copies) {
  pool_pages out(t.size());
  for (size_t k = 0; k < t.size(); ++k) {
    const auto& tab = t[k];
    const size_t keep = size_t(std::min<int64_t>(plan.copy_block, int64_t(tab.size())));
    out[k].assign(tab.begin(), tab.begin() + static_cast<std::ptrdiff_t>(keep));
    out[k].resize(size_t(plan.copy_block), -1);
    out[k].push_back(k < copies.size() ? copies[k] : -1);
  }
  return out;
}

fork_request make_fork_request(const fork_plan& plan, int32_t forks) {
  fork_request r;
  const size_t pools = plan.shared.size();
  r.holds.resize(pools);
  r.copy_from.resize(pools);
  r.counts.assign(pools, 0);
  for (size_t p = 0; p < pools; ++p) {
    for (int32_t f = 0; f < forks; ++f) {
      r.holds[p].insert(r.holds[p].end(), plan.shared[p].begin(), plan.shared[p].end());
      if (plan.copy_from[p] >= 0) r.copy_from[p].push_back(plan.copy_from[p]);
    }
    r.counts[p] = static_cast<int32_t>(r.copy_from[p].size());
  }
  return r;
}

std::vector<int32_t> fork_copies(const fork_plan& plan, const pool_pages& got, int32_t k) {
  std::vector<int32_t> out(plan.copy_from.size(), -1);
  for (size_t p = 0; p < out.size(); ++p)
    if (plan.copy_from[p] >= 0 && p < got.size() && size_t(k) < got[p].size()) out[p] = got[p][size_t(k)];
  return out;
}

}  // namespace tandem
