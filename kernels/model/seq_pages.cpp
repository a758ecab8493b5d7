#include "kernels/model/seq_pages.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"

namespace tandem {

bool holds_pages(const pool_pages& t) {
  for (const auto& l : t)
    for (auto x : l)
      if (x >= 0) return true;
  return false;
}

pool_pages first_blocks(const pool_pages& t, size_t blocks) {
  pool_pages out(t.size());
  for (size_t p = 0; p < t.size(); ++p)
    out[p].assign(t[p].begin(), t[p].begin() + static_cast<std::ptrdiff_t>(std::min(blocks, t[p].size())));
  return out;
}

int32_t release_dead_pages(const kv_pools_layout& set, int64_t next_pos, pool_pages& t, pool_pages& freed) {
  int32_t moved = 0;
  freed.resize(t.size());
  for (size_t p = 0; p < t.size() && p < set.pools.size(); ++p) {
    const auto before = freed[p].size();
    release_dead_blocks(set.pools[p], next_pos, t[p], freed[p]);
    moved += static_cast<int32_t>(freed[p].size() - before);
  }
  return moved;
}

void rotate_window_pages(const kv_pools_layout& set, int64_t start, int64_t end, int32_t owned_from, int32_t page_size,
                         pool_pages& t, pool_pages& freed) {
  freed.resize(t.size());
  const int64_t need_to = (end + page_size - 1) / page_size;
  for (size_t p = 1; p < t.size() && p < set.pools.size(); ++p) {
    const kv_pool_spec& sp = set.pools[p];
    if (sp.window_tokens <= 0) continue;
    auto& tab = t[p];
    if (int64_t(tab.size()) < need_to) tab.resize(size_t(need_to), -1);
    const int64_t live = sp.first_live_block(start);
    std::vector<int32_t> spare;
    for (int64_t b = 0; b < live && b < int64_t(tab.size()); ++b) {
      if (tab[size_t(b)] < 0) continue;
      (b >= owned_from ? spare : freed[p]).push_back(tab[size_t(b)]);
      tab[size_t(b)] = -1;
    }
    for (int64_t b = live; b < need_to; ++b) {
      if (tab[size_t(b)] >= 0) continue;
      if (spare.empty())
        throw tandem::error(error_kind::failed,
                            fmt::format("KV pool '{}': no page left for block {} of a step over [{}, {}) (window {}, "
                                        "page size {}); the acquisition gave too few pages",
                                        sp.name, b, start, end, sp.window_tokens, page_size));
      tab[size_t(b)] = spare.back();
      spare.pop_back();
    }
    // Spare pages beyond the step stay the sequence's, on the next blocks it will write.
    for (size_t b = size_t(need_to); b < tab.size() && !spare.empty(); ++b)
      if (tab[b] < 0) {
        tab[b] = spare.back();
        spare.pop_back();
      }
    for (auto x : spare) freed[p].push_back(x);
  }
}

std::vector<int32_t> pages_lacking(const pool_pages& t, int64_t end, int32_t page_size) {
  const int64_t blocks = (end + page_size - 1) / page_size;
  std::vector<int32_t> out(t.size(), 0);
  for (size_t p = 0; p < t.size(); ++p) out[p] = static_cast<int32_t>(std::max<int64_t>(0, blocks - int64_t(t[p].size())));
  return out;
}

std::vector<int32_t> pages_held(const pool_pages& t) {
  std::vector<int32_t> out(t.size(), 0);
  for (size_t p = 0; p < t.size(); ++p)
    for (auto x : t[p])
      if (x >= 0) ++out[p];
  return out;
}

}  // namespace tandem
