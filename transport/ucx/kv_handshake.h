#pragma once
/// What two nodes check before exchanging KV pages: the same model, dtype and page shape.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/model/kv_pool.h"

namespace tandem::ucx {

/// One side's view of the KV layout it serves.
struct kv_identity {
  std::string node;          ///< node name, for messages and peer lookup
  std::string model;         ///< model name (e.g. the GGUF general.name)
  std::string dtype = "f32"; ///< element type of the pages: to_string(layout.dtype)
  kv_layout layout;
  /// "model=r15m dtype=f32 layers=... page_size=16"
  std::string describe() const;
};

/// The handshake message: the identity plus where and how to write into the pool.
struct kv_hello {
  kv_identity id;
  uint64_t pool_base = 0;   ///< remote virtual address of page 0
  int32_t n_pages = 0;      ///< pages in the remote pool
  std::vector<uint8_t> rkey;  ///< packed remote key of the pool registration
  /// The worker address: the peer dials it for a data endpoint with UCX's full transport
  /// selection (shared memory on one host); the sockaddr endpoint only gets the CM's tcp.
  std::vector<uint8_t> worker_address;
};

std::vector<uint8_t> encode_hello(const kv_hello& h);
/// Throws tandem::error if the bytes are not a hello of this protocol version.
kv_hello decode_hello(const uint8_t* data, size_t size);

/// The descriptor message: destination -> source, where the pages of a transfer go.
struct kv_descriptors {
  uint64_t transfer = 0;
  std::vector<int32_t> pages;  ///< destination page ids, one per source page
};

std::vector<uint8_t> encode_descriptors(const kv_descriptors& d);
/// Throws tandem::error if the bytes are not exactly one descriptor message.
kv_descriptors decode_descriptors(const uint8_t* data, size_t size);

/// Empty if every id of `pages` is a page of a pool of `n_pages` pages; otherwise a message
/// naming the first bad id. A peer's descriptors and hello are untrusted input.
std::string check_page_ids(const std::vector<int32_t>& pages, int32_t n_pages);

/// Empty if `local` and `remote` can exchange pages; otherwise a message that names both
/// sides' values of every field that differs and the fix.
std::string check_compatible(const kv_identity& local, const kv_identity& remote);

}  // namespace tandem::ucx
