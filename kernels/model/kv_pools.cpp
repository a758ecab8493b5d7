#include "kernels/model/kv_pools.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/base/error.h"

namespace tandem {

int32_t kv_pool_spec::first_live_block(int64_t pos) const {
  if (window_tokens <= 0) return 0;
  // The token at pos reads positions >= pos - window + 1.
  return int32_t(std::max<int64_t>(0, pos - window_tokens + 1) / page.page_size);
}

int32_t kv_pool_spec::max_pages(int64_t tokens, int64_t chunk) const {
  const int64_t ps = page.page_size;
  const int64_t blocks = (tokens + ps - 1) / ps;
  if (window_tokens <= 0) return int32_t(blocks);
  // A step of `chunk` new tokens reads window - 1 earlier positions and writes chunk more:
  // window + chunk - 1 positions starting anywhere in a block.
  const int64_t span = window_tokens + std::max<int64_t>(1, chunk) - 1;
  return int32_t(std::min(blocks, (span + ps - 1) / ps + 1));
}

std::string kv_pool_spec::describe() const {
  std::string ls;
  for (size_t i = 0; i < layers.size(); ++i) ls += fmt::format("{}{}", i ? "," : "", layers[i]);
  std::string s = fmt::format("{}: layers=[{}] {}", name, ls, page.describe());
  if (window_tokens > 0) s += fmt::format(" window={}", window_tokens);
  return s;
}

kv_pools_layout kv_pools_layout::single(const kv_layout& l) {
  kv_pool_spec s{.name = "full", .page = l, .window_tokens = 0, .layers = {}};
  for (int32_t i = 0; i < l.n_layers; ++i) s.layers.push_back(i);
  return kv_pools_layout{.pools = {std::move(s)}};
}

size_t kv_pools_layout::block_bytes() const {
  size_t b = 0;
  for (const auto& p : pools) b += p.page.page_bytes();
  return b;
}

int32_t kv_pools_layout::find(const std::string& name) const {
  for (size_t i = 0; i < pools.size(); ++i)
    if (pools[i].name == name) return int32_t(i);
  return -1;
}

std::vector<int32_t> kv_pools_layout::max_pages(int64_t tokens, int64_t chunk) const {
  std::vector<int32_t> n;
  for (const auto& p : pools) n.push_back(p.max_pages(tokens, chunk));
  return n;
}

void kv_pools_layout::check_fits(std::span<const int32_t> capacity, int64_t tokens, int64_t chunk) const {
  for (size_t p = 0; p < pools.size() && p < capacity.size(); ++p) {
    const int32_t need = pools[p].max_pages(tokens, chunk);
    if (need > capacity[p])
      throw tandem::error(
          error_kind::overloaded,
          fmt::format("a sequence of {} tokens needs {} pages of the {} KV pool, which has {}; "
                      "shorten the request or raise limits.kv_cache_mb / device_pages",
                      tokens, need, pools[p].name, capacity[p]));
  }
}

std::string kv_pools_layout::describe() const {
  std::string s;
  for (size_t i = 0; i < pools.size(); ++i) s += (i ? "; " : "") + pools[i].describe();
  return s;
}

void kv_pools_layout::check(int32_t n_layers) const {
  if (pools.empty()) throw tandem::error("KV layout set has no pools");
  std::vector<int> seen(size_t(std::max(0, n_layers)), 0);
  for (const kv_pool_spec& p : pools) {
    if (!p.page.valid())
      throw tandem::error(fmt::format("KV pool {} has an invalid page layout", p.describe()));
    if (p.page.page_size != page_size())
      throw tandem::error(fmt::format("KV pool {} has page size {} but pool {} has {}; every pool shares one",
                                      p.name, p.page.page_size, pools.front().name, page_size()));
    if (int32_t(p.layers.size()) != p.page.n_layers || p.window_tokens < 0)
      throw tandem::error(fmt::format("KV pool {} lists {} layers for a page of {}", p.describe(),
                                      p.layers.size(), p.page.n_layers));
    for (int32_t l : p.layers) {
      if (l < 0 || l >= n_layers || seen[size_t(l)]++)
        throw tandem::error(
            fmt::format("KV pool {}: layer {} is outside 0..{} or in two pools", p.name, l, n_layers - 1));
    }
  }
  for (int32_t l = 0; l < n_layers; ++l)
    if (!seen[size_t(l)])
      throw tandem::error(fmt::format("KV layout set {}: layer {} is in no pool", describe(), l));
}

kv_pools::kv_pools(kv_pools_layout set, std::span<const int32_t> n_pages) : set_(std::move(set)) {
  if (n_pages.size() != set_.pools.size())
    throw tandem::error(fmt::format("{} page counts for {} KV pools", n_pages.size(), set_.pools.size()));
  for (size_t p = 0; p < n_pages.size(); ++p) {
    owned_.push_back(std::make_unique<kv_pool>(set_.pools[p].page, n_pages[p]));
    pools_.push_back(owned_.back().get());
  }
}

kv_pools::kv_pools(kv_pools_layout set, std::vector<kv_pool*> pools)
    : set_(std::move(set)), pools_(std::move(pools)) {
  if (pools_.size() != set_.pools.size())
    throw tandem::error(fmt::format("{} KV pools for a layout set of {}", pools_.size(), set_.pools.size()));
  for (size_t p = 0; p < pools_.size(); ++p)
    if (pools_[p] == nullptr || !(pools_[p]->layout() == set_.pools[p].page))
      throw tandem::error(fmt::format("KV pool {} does not have the layout {}", set_.pools[p].name,
                                      set_.pools[p].page.describe()));
}

kv_pools::kv_pools(kv_pool& pool) : set_(kv_pools_layout::single(pool.layout())), pools_{&pool} {}

void release_dead_blocks(const kv_pool_spec& spec, int64_t next_pos, std::vector<int32_t>& table,
                         std::vector<int32_t>& freed) {
  const size_t live = std::min(table.size(), size_t(spec.first_live_block(next_pos)));
  for (size_t b = 0; b < live; ++b)
    if (table[b] >= 0) {
      freed.push_back(table[b]);
      table[b] = -1;
    }
}

}  // namespace tandem
