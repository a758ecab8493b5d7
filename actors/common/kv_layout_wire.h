#pragma once
/// The one codec of a KV layout on the wire (schema::KvLayout): handoffs between schedulers
/// and the UCX handshake both use it, so the two sides of a transfer compare the same
/// description, components included.
#include <string>

#include "kernels/model/kv_pool.h"
#include "kernels/model/kv_pools.h"
#include "schemas/internal.capnp.h"

namespace tandem {

/// Writes `l` into `b`.
void write_kv_layout(schema::KvLayout::Builder b, const kv_layout& l);

/// Reads a layout from untrusted bytes. Throws tandem::error (failed) naming the field when a
/// size is not positive or beyond 2^20, a component has no name, or there are more than
/// kv_layout_max_components components.
kv_layout read_kv_layout(schema::KvLayout::Reader r);

/// Writes a layout set: KvLayout's own fields are pool 0's page; `pools` lists every pool
/// unless the set is the single full pool of that page, so a one-pool set writes exactly what
/// write_kv_layout writes (and peers or handoffs that predate pools read the same).
void write_kv_pools_layout(schema::KvLayout::Builder b, const kv_pools_layout& set);

/// Reads a layout set from untrusted bytes: an empty `pools` is the single full pool of the
/// layout's page. Throws tandem::error (failed) naming the bad field: sizes out of range,
/// more than max_kv_pools pools, nested pools, a pool 0 that is not the layout's own page,
/// names empty or repeated, layers not ascending, out of range or in two pools, page sizes
/// that differ (kv_pools_layout::check).
kv_pools_layout read_kv_pools_layout(schema::KvLayout::Reader r);

/// Empty when `here` and `there` are the same set; otherwise every difference per pool naming
/// both sides' values, "pool 1 (window): window_tokens 32 here, 64 on decode-1; ...", where
/// `there_name` names the other side (a node, "the handoff").
std::string explain_kv_pools_mismatch(const kv_pools_layout& here, const kv_pools_layout& there,
                                      const std::string& there_name);

/// Components a layout may declare (K, V, a latent, indexer keys, ...).
constexpr unsigned kv_layout_max_components = 8;

}  // namespace tandem
