#include "actors/common/kv_layout_wire.h"

#include <fmt/format.h>

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

}  // namespace tandem
