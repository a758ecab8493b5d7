#include "actors/common/kv_layout_wire.h"

#include <fmt/format.h>

#include <algorithm>

#include "actors/common/pool_pages_wire.h"
#include "kernels/base/error.h"

namespace tandem {

namespace {

int32_t checked(const char* what, int32_t v) {
  if (v <= 0 || v > (int32_t(1) << 20))
    throw tandem::error(fmt::format("KV layout: {} = {} is out of range [1, 2^20]", what, v));
  return v;
}

}  // namespace

void write_kv_layout(schema::KvLayout::Builder b, const kv_layout& l) {
  b.setNLayers(l.n_layers);
  b.setNKvHeads(l.n_kv_heads);
  b.setHeadDim(l.head_dim);
  b.setPageSize(l.page_size);
  b.setDtype(l.dtype == kv_dtype::f16 ? schema::KvDtype::F16 : schema::KvDtype::F32);
  auto cs = b.initComponents(static_cast<unsigned>(l.components.size()));
  for (unsigned i = 0; i < l.components.size(); ++i) {
    const kv_component& c = l.components[i];
    cs[i].setName(c.name);
    cs[i].setNHeads(c.n_heads);
    cs[i].setHeadDim(c.head_dim);
    cs[i].setElemBytes(c.elem_bytes);
  }
}

kv_layout read_kv_layout(schema::KvLayout::Reader r) {
  kv_layout l;
  l.n_layers = checked("layers", r.getNLayers());
  l.n_kv_heads = checked("kv_heads", r.getNKvHeads());
  l.head_dim = checked("head_dim", r.getHeadDim());
  l.page_size = checked("page_size", r.getPageSize());
  l.dtype = r.getDtype() == schema::KvDtype::F16 ? kv_dtype::f16 : kv_dtype::f32;
  const auto cs = r.getComponents();
  if (cs.size() > kv_layout_max_components)
    throw tandem::error(
        fmt::format("KV layout: {} components, at most {} are supported", cs.size(), kv_layout_max_components));
  for (auto c : cs) {
    const std::string name = c.getName().cStr();
    if (name.empty() || name.size() > 64)
      throw tandem::error("KV layout: a component name must have 1 to 64 characters");
    const int32_t eb = c.getElemBytes();
    if (eb != 1 && eb != 2 && eb != 4)
      throw tandem::error(fmt::format("KV layout: component {} has {} bytes per element; 1, 2 or 4", name, eb));
    l.components.push_back(kv_component{name, checked("component heads", c.getNHeads()),
                                        checked("component head_dim", c.getHeadDim()), eb});
  }
  return l;
}

namespace {

std::string layers_text(const std::vector<int32_t>& ls) {
  std::string s = "[";
  for (size_t i = 0; i < ls.size(); ++i) s += fmt::format("{}{}", i ? "," : "", ls[i]);
  return s + "]";
}

std::string components_or_standard(const kv_layout& l) {
  return l.components.empty() ? "standard K/V" : l.components_text();
}

}  // namespace

void write_kv_pools_layout(schema::KvLayout::Builder b, const kv_pools_layout& set) {
  if (set.pools.empty()) throw tandem::error("KV layout set has no pools");
  write_kv_layout(b, set.pools.front().page);
  if (set == kv_pools_layout::single(set.pools.front().page)) return;
  auto ps = b.initPools(static_cast<unsigned>(set.pools.size()));
  for (unsigned i = 0; i < set.pools.size(); ++i) {
    const kv_pool_spec& p = set.pools[i];
    ps[i].setName(p.name);
    write_kv_layout(ps[i].initPage(), p.page);
    ps[i].setWindowTokens(p.window_tokens);
    auto ls = ps[i].initLayers(static_cast<unsigned>(p.layers.size()));
    for (unsigned k = 0; k < p.layers.size(); ++k) ls.set(k, p.layers[k]);
  }
}

kv_pools_layout read_kv_pools_layout(schema::KvLayout::Reader r) {
  const kv_layout page0 = read_kv_layout(r);
  const auto ps = r.getPools();
  if (ps.size() == 0) return kv_pools_layout::single(page0);
  if (ps.size() > max_kv_pools)
    throw tandem::error(fmt::format("KV layout: {} pools, at most {} are supported", ps.size(), max_kv_pools));
  kv_pools_layout set;
  int32_t n_layers = 0;
  for (unsigned i = 0; i < ps.size(); ++i) {
    auto p = ps[i];
    kv_pool_spec s;
    s.name = p.getName().cStr();
    if (s.name.empty() || s.name.size() > 64)
      throw tandem::error(fmt::format("KV layout: pool {} needs a name of 1 to 64 characters", i));
    if (set.find(s.name) >= 0) throw tandem::error(fmt::format("KV layout: two pools are named {}", s.name));
    if (p.getPage().getPools().size() != 0)
      throw tandem::error(fmt::format("KV layout: pool {} ({}) nests pools; a pool has one page layout", i, s.name));
    s.page = read_kv_layout(p.getPage());
    s.window_tokens = p.getWindowTokens();
    if (s.window_tokens < 0 || s.window_tokens > (int32_t(1) << 24))
      throw tandem::error(fmt::format("KV layout: pool {} ({}) has window_tokens {}; 0 (full) to 2^24",
                                      i, s.name, s.window_tokens));
    const auto ls = p.getLayers();
    if (int64_t(ls.size()) != s.page.n_layers)
      throw tandem::error(fmt::format("KV layout: pool {} ({}) lists {} layers for a page of {}", i, s.name,
                                      ls.size(), s.page.n_layers));
    for (unsigned k = 0; k < ls.size(); ++k) {
      if (k > 0 && ls[k] <= ls[k - 1])
        throw tandem::error(fmt::format("KV layout: pool {} ({}): layers must ascend, {} follows {}", i, s.name,
                                        ls[k], ls[k - 1]));
      s.layers.push_back(ls[k]);
    }
    n_layers += s.page.n_layers;  // each <= 2^20 (read_kv_layout), at most 8 pools
    set.pools.push_back(std::move(s));
  }
  if (!(set.pools.front().page == page0))
    throw tandem::error(fmt::format("KV layout: pool 0 ({}) has page {} but the layout says {}",
                                    set.pools.front().name, set.pools.front().page.describe(), page0.describe()));
  set.check(n_layers);
  return set;
}

std::string explain_kv_pools_mismatch(const kv_pools_layout& here, const kv_pools_layout& there,
                                      const std::string& there_name) {
  if (here == there) return {};
  std::vector<std::string> out;
  auto names = [](const kv_pools_layout& s) {
    std::string n;
    for (size_t i = 0; i < s.pools.size(); ++i) n += (i ? ", " : "") + s.pools[i].name;
    return n;
  };
  if (here.pools.size() != there.pools.size())
    out.push_back(fmt::format("{} pools here ({}), {} on {} ({})", here.pools.size(), names(here),
                              there.pools.size(), there_name, names(there)));
  for (size_t i = 0; i < std::min(here.pools.size(), there.pools.size()); ++i) {
    const kv_pool_spec &a = here.pools[i], &b = there.pools[i];
    const std::string pool = a.name == b.name ? fmt::format("pool {} ({})", i, a.name) : fmt::format("pool {}", i);
    auto field = [&](const char* what, const auto& x, const auto& y) {
      if (!(x == y)) out.push_back(fmt::format("{}: {} {} here, {} on {}", pool, what, x, y, there_name));
    };
    field("name", a.name, b.name);
    field("window_tokens", a.window_tokens, b.window_tokens);
    field("layers", layers_text(a.layers), layers_text(b.layers));
    field("kv_heads", a.page.n_kv_heads, b.page.n_kv_heads);
    field("head_dim", a.page.head_dim, b.page.head_dim);
    field("page_size", a.page.page_size, b.page.page_size);
    field("dtype", std::string(to_string(a.page.dtype)), std::string(to_string(b.page.dtype)));
    field("components", components_or_standard(a.page), components_or_standard(b.page));
    if (a.layers == b.layers) field("page layers", a.page.n_layers, b.page.n_layers);
  }
  std::string s;
  for (size_t i = 0; i < out.size(); ++i) s += (i ? "; " : "") + out[i];
  return s;
}

}  // namespace tandem
