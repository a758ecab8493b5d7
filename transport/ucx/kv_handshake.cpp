#include "transport/ucx/kv_handshake.h"

#include <fmt/format.h>

#include <cstring>

#include "kernels/base/error.h"

namespace tandem::ucx {
namespace {

constexpr uint32_t hello_magic = 0x544b5648;  // "HVKT"
constexpr uint32_t hello_version = 2;

struct writer {
  std::vector<uint8_t> out;
  template <class T>
  void pod(T v) {
    size_t at = out.size();
    out.resize(at + sizeof(T));
    std::memcpy(out.data() + at, &v, sizeof(T));
  }
  void bytes(const void* p, size_t n) {
    pod<uint32_t>(uint32_t(n));
    out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  }
  void str(const std::string& s) { bytes(s.data(), s.size()); }
};

struct reader {
  const uint8_t* p;
  size_t n, at = 0;
  void need(size_t k) {
    if (n - at < k) throw tandem::error("truncated KV handshake message; both nodes must run the same tandem version");
  }
  template <class T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::vector<uint8_t> bytes() {
    uint32_t k = pod<uint32_t>();
    need(k);
    std::vector<uint8_t> v(p + at, p + at + k);
    at += k;
    return v;
  }
  std::string str() {
    auto v = bytes();
    return std::string(v.begin(), v.end());
  }
};

}  // namespace

std::string kv_identity::describe() const {
  return fmt::format("model={} dtype={} {}", model, dtype, layout.describe());
}

std::vector<uint8_t> encode_hello(const kv_hello& h) {
  writer w;
  w.pod(hello_magic);
  w.pod(hello_version);
  w.str(h.id.node);
  w.str(h.id.model);
  w.str(h.id.dtype);
  w.pod(h.id.layout.n_layers);
  w.pod(h.id.layout.n_kv_heads);
  w.pod(h.id.layout.head_dim);
  w.pod(h.id.layout.page_size);
  w.pod(h.pool_base);
  w.pod(h.n_pages);
  w.bytes(h.rkey.data(), h.rkey.size());
  w.bytes(h.worker_address.data(), h.worker_address.size());
  return std::move(w.out);
}

kv_hello decode_hello(const uint8_t* data, size_t size) {
  reader r{data, size};
  if (r.pod<uint32_t>() != hello_magic) throw tandem::error("not a tandem KV handshake (bad magic)");
  if (uint32_t v = r.pod<uint32_t>(); v != hello_version)
    throw tandem::error(fmt::format("KV handshake version {} (this node speaks {}); run the same tandem version "
                                    "on prefill and decode nodes",
                                    v, hello_version));
  kv_hello h;
  h.id.node = r.str();
  h.id.model = r.str();
  h.id.dtype = r.str();
  h.id.layout.n_layers = r.pod<int32_t>();
  h.id.layout.n_kv_heads = r.pod<int32_t>();
  h.id.layout.head_dim = r.pod<int32_t>();
  h.id.layout.page_size = r.pod<int32_t>();
  // The page element type travels as the identity's dtype ("f32", "f16"); an unknown one
  // stays in the identity, where check_compatible reports it against this node's.
  parse_kv_dtype(h.id.dtype, h.id.layout.dtype);
  h.pool_base = r.pod<uint64_t>();
  h.n_pages = r.pod<int32_t>();
  if (h.n_pages <= 0)
    throw tandem::error(fmt::format("KV handshake of node '{}' offers a pool of {} pages; a peer must have at least one",
                                    h.id.node, h.n_pages));
  h.rkey = r.bytes();
  h.worker_address = r.bytes();
  if (r.at != r.n) throw tandem::error("KV handshake message has trailing bytes; both nodes must run the same tandem version");
  return h;
}

std::vector<uint8_t> encode_descriptors(const kv_descriptors& d) {
  std::vector<uint8_t> msg(12 + d.pages.size() * 4);
  uint32_t n = uint32_t(d.pages.size());
  std::memcpy(msg.data(), &d.transfer, 8);
  std::memcpy(msg.data() + 8, &n, 4);
  if (n) std::memcpy(msg.data() + 12, d.pages.data(), size_t(n) * 4);
  return msg;
}

kv_descriptors decode_descriptors(const uint8_t* data, size_t size) {
  if (size < 12) throw tandem::error("short KV descriptor message");
  kv_descriptors d;
  uint32_t n;
  std::memcpy(&d.transfer, data, 8);
  std::memcpy(&n, data + 8, 4);
  if (size != 12 + size_t(n) * 4) throw tandem::error("malformed KV descriptor message");
  d.pages.resize(n);
  if (n) std::memcpy(d.pages.data(), data + 12, size_t(n) * 4);
  return d;
}

std::string check_page_ids(const std::vector<int32_t>& pages, int32_t n_pages) {
  for (size_t i = 0; i < pages.size(); ++i)
    if (pages[i] < 0 || pages[i] >= n_pages)
      return fmt::format("page id {} (entry {}) is outside the pool of {} pages", pages[i], i, n_pages);
  return {};
}

std::string check_compatible(const kv_identity& local, const kv_identity& remote) {
  std::string diff;
  auto field = [&](const char* name, const auto& a, const auto& b) {
    if (a == b) return;
    diff += fmt::format("{}{}: here {} vs peer {}", diff.empty() ? "" : "; ", name, a, b);
  };
  field("model", local.model, remote.model);
  field("dtype", local.dtype, remote.dtype);
  field("layers", local.layout.n_layers, remote.layout.n_layers);
  field("kv_heads", local.layout.n_kv_heads, remote.layout.n_kv_heads);
  field("head_dim", local.layout.head_dim, remote.layout.head_dim);
  field("page_size", local.layout.page_size, remote.layout.page_size);
  if (diff.empty()) return {};
  return fmt::format("KV layout mismatch between node '{}' ({}) and peer '{}' ({}): {}; serve the same model with "
                     "the same kv page size on the prefill and decode nodes",
                     local.node, local.describe(), remote.node, remote.describe(), diff);
}

}  // namespace tandem::ucx
