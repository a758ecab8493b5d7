#pragma once
/// The worker's kv_port over the UCX kv_engine: the pool in UCX-registered memory, a
/// listener for destination nodes that connect to us, dialled peers for source nodes, and
/// the resolution of a destination node's name to the endpoint it connected with.
#include <cstdint>
#include <string>
#include <vector>

#include "actors/worker/kv_port.h"
#include "transport/ucx/kv_engine.h"

namespace tandem::ucx {

struct kv_port_peer {
  std::string node;
  std::string host;
  uint16_t port = 0;
};

struct kv_port_options {
  std::string node;   ///< this node (the handshake identity)
  std::string model;  ///< model name checked by the handshake
  std::string listen_host;
  uint16_t listen_port = 0;            ///< 0 = no listener
  std::vector<kv_port_peer> sources;   ///< nodes this one receives from (dialled on first use)
  engine_options engine;
  /// How long a send waits for its destination to connect (it dials us on its first receive).
  int64_t resolve_ms = 5000;
};

/// Parses TANDEM_KV_FAULT (tests and failure drills): "put:fail:N" fails the first N put
/// batches, "put:drop:N" drops them (never complete), "notify:drop:N" loses N notifications,
/// "put:delay:MS" ("notify:delay:MS") holds every put batch (notification) MS ms,
/// "put:drop-pool:P" skips pool P's puts and "put:flip-pool:P" flips one byte of pool P in
/// transit, in every transfer (the destination's manifest check fails it naming the pool).
/// Empty = no faults. Throws tandem::error naming the syntax on anything else.
fault_hook fault_hook_from_spec(const std::string& spec);

/// A factory for worker_options::kv_transfer.
kv_port_factory make_kv_port_factory(kv_port_options options);

}  // namespace tandem::ucx
