#pragma once
/// The one codec of a KV layout on the wire (schema::KvLayout): handoffs between schedulers
/// and the UCX handshake both use it, so the two sides of a transfer compare the same
/// description, components included.
#include <string>

#include "kernels/model/kv_pool.h"
#include "schemas/internal.capnp.h"

namespace tandem {

/// Writes `l` into `b`.
void write_kv_layout(schema::KvLayout::Builder b, const kv_layout& l);

/// Reads a layout from untrusted bytes. Throws tandem::error (failed) naming the field when a
/// size is not positive or beyond 2^20, a component has no name, or there are more than
/// kv_layout_max_components components.
kv_layout read_kv_layout(schema::KvLayout::Reader r);

/// Components a layout may declare (K, V, a latent, indexer keys, ...).
constexpr unsigned kv_layout_max_components = 8;

}  // namespace tandem
