#include "transport/ucx/kv_handshake.h"

#include <fmt/format.h>

#include <capnp/message.h>
#include <capnp/serialize.h>

#include <cstring>

#include "actors/common/kv_layout_wire.h"
#include "kernels/base/error.h"
#include "transport/ucx/kv_wire.h"
#include "schemas/internal.capnp.h"

namespace tandem::ucx {
namespace {

constexpr uint32_t hello_magic = 0x544b5648;  // "HVKT"
// 3: a schema::KvHello with the layout's components; 4: KvChallenge and KvProof before the
// hello (authenticated with the cluster secret; no rkey before the proof); 5: layout sets
// (KvLayout.pools, one KvHello.extraPools region per pool past the first), descriptors per
// pool and the per-pool manifest on `done` (kv_manifest.h).
constexpr uint32_t hello_version = 5;

/// The magic and version words before the Cap'n Proto message.
constexpr size_t header_bytes = 8;

/// "latent:1x576x4,..." or "standard K/V".
std::string components_text(const kv_layout& l) {
  return l.components.empty() ? "standard K/V" : l.components_text();
}

}  // namespace

std::string kv_identity::describe() const {
  const kv_pools_layout s = set();
  if (s.pools.size() < 2) return fmt::format("model={} dtype={} {}", model, dtype, layout.describe());
  return fmt::format("model={} dtype={} pools: {}", model, dtype, s.describe());
}

std::vector<uint8_t> encode_hello(const kv_hello& h) {
  capnp::MallocMessageBuilder mb;
  auto m = mb.initRoot<schema::KvHello>();
  m.setNode(h.id.node);
  m.setModel(h.id.model);
  write_kv_pools_layout(m.initLayout(), h.id.set());
  m.setPoolBase(h.pool_base);
  m.setNPages(h.n_pages);
  m.setRkey(kj::arrayPtr(h.rkey.data(), h.rkey.size()));
  m.setWorkerAddress(kj::arrayPtr(h.worker_address.data(), h.worker_address.size()));
  auto ex = m.initExtraPools(static_cast<unsigned>(h.extra_pools.size()));
  for (unsigned i = 0; i < h.extra_pools.size(); ++i) {
    ex[i].setPoolBase(h.extra_pools[i].base);
    ex[i].setNPages(h.extra_pools[i].n_pages);
    ex[i].setRkey(kj::arrayPtr(h.extra_pools[i].rkey.data(), h.extra_pools[i].rkey.size()));
  }
  return frame_kv_message(mb);
}

std::vector<uint8_t> frame_kv_message(capnp::MessageBuilder& mb) {
  const auto words = capnp::messageToFlatArray(mb);
  const auto bytes = words.asBytes();
  std::vector<uint8_t> out(header_bytes + bytes.size());
  std::memcpy(out.data(), &hello_magic, 4);
  std::memcpy(out.data() + 4, &hello_version, 4);
  std::memcpy(out.data() + header_bytes, bytes.begin(), bytes.size());
  return out;
}

capnp::ReaderOptions kv_reader_options(size_t words) {
  capnp::ReaderOptions opt;
  opt.traversalLimitInWords = 4 * words + 64;
  opt.nestingLimit = 8;
  return opt;
}

kj::Array<capnp::word> unframe_kv_message(const uint8_t* data, size_t size) {
  if (size < header_bytes) throw tandem::error("truncated KV handshake message; both nodes must run the same tandem version");
  uint32_t magic, version;
  std::memcpy(&magic, data, 4);
  std::memcpy(&version, data + 4, 4);
  if (magic != hello_magic) throw tandem::error("not a tandem KV handshake (bad magic)");
  if (version != hello_version)
    throw tandem::error(fmt::format("KV handshake version {} (this node speaks {}); run the same tandem version "
                                    "on prefill and decode nodes",
                                    version, hello_version));
  const size_t body = size - header_bytes;
  if (body > max_kv_message_bytes)
    throw tandem::error(fmt::format("KV handshake message of {} bytes exceeds the {} a handshake message may have",
                                    size, max_kv_message_bytes));
  // Aligned words (the peer's bytes may start anywhere), then the exact size the segment
  // table declares: fewer bytes is a truncated message, more is trailing garbage.
  auto words = kj::heapArray<capnp::word>((body + sizeof(capnp::word) - 1) / sizeof(capnp::word));
  std::memset(words.begin(), 0, words.size() * sizeof(capnp::word));
  std::memcpy(words.begin(), data + header_bytes, body);
  const size_t declared = capnp::expectedSizeInWordsFromPrefix(words.asPtr()) * sizeof(capnp::word);
  if (body == 0 || declared > body)
    throw tandem::error("truncated KV handshake message; both nodes must run the same tandem version");
  if (declared < body)
    throw tandem::error("KV handshake message has trailing bytes; both nodes must run the same tandem version");
  return words;
}

kv_hello decode_hello(const uint8_t* data, size_t size) {
  auto words = unframe_kv_message(data, size);
  kv_hello h;
  try {
    capnp::FlatArrayMessageReader reader(words.asPtr(), kv_reader_options(words.size()));
    auto m = reader.getRoot<schema::KvHello>();
    h.id.node = m.getNode().cStr();
    h.id.model = m.getModel().cStr();
    h.id.pools = read_kv_pools_layout(m.getLayout());
    h.id.layout = h.id.pools.pools.front().page;
    h.pool_base = m.getPoolBase();
    h.n_pages = m.getNPages();
    const auto rkey = m.getRkey();
    h.rkey.assign(rkey.begin(), rkey.end());
    const auto addr = m.getWorkerAddress();
    h.worker_address.assign(addr.begin(), addr.end());
    const auto ex = m.getExtraPools();
    if (ex.size() + 1 != h.id.pools.pools.size())
      throw tandem::error(fmt::format("KV handshake of node '{}' offers {} pool regions for a layout set of {} pools",
                                      h.id.node, ex.size() + 1, h.id.pools.pools.size()));
    for (unsigned i = 0; i < ex.size(); ++i) {
      kv_region r{ex[i].getPoolBase(), ex[i].getNPages(), {}};
      const auto rk = ex[i].getRkey();
      r.rkey.assign(rk.begin(), rk.end());
      if (r.n_pages <= 0)
        throw tandem::error(fmt::format("KV handshake of node '{}' offers {} pages for pool {} ({}); a peer must have "
                                        "at least one",
                                        h.id.node, r.n_pages, i + 1, h.id.pools.pools[i + 1].name));
      h.extra_pools.push_back(std::move(r));
    }
  } catch (const kj::Exception& e) {
    throw tandem::error(fmt::format("malformed KV handshake message ({}); both nodes must run the same tandem version",
                                    e.getDescription().cStr()));
  }
  h.id.dtype = to_string(h.id.layout.dtype);
  if (h.n_pages <= 0)
    throw tandem::error(fmt::format("KV handshake of node '{}' offers a pool of {} pages; a peer must have at least one",
                                    h.id.node, h.n_pages));
  return h;
}

// transfer id (8), pools (4), then per pool: its page count (4) and the page ids (4 each).
std::vector<uint8_t> encode_descriptors(const kv_descriptors& d) {
  size_t bytes = 12;
  for (const auto& p : d.pages) bytes += 4 + p.size() * 4;
  std::vector<uint8_t> msg(bytes);
  const uint32_t n_pools = uint32_t(d.pages.size());
  std::memcpy(msg.data(), &d.transfer, 8);
  std::memcpy(msg.data() + 8, &n_pools, 4);
  uint8_t* at = msg.data() + 12;
  for (const auto& p : d.pages) {
    const uint32_t n = uint32_t(p.size());
    std::memcpy(at, &n, 4);
    if (n) std::memcpy(at + 4, p.data(), size_t(n) * 4);
    at += 4 + size_t(n) * 4;
  }
  return msg;
}

kv_descriptors decode_descriptors(const uint8_t* data, size_t size) {
  if (size < 12) throw tandem::error("short KV descriptor message");
  kv_descriptors d;
  uint32_t n_pools;
  std::memcpy(&d.transfer, data, 8);
  std::memcpy(&n_pools, data + 8, 4);
  if (n_pools == 0 || n_pools > max_kv_pools) throw tandem::error("malformed KV descriptor message");
  size_t at = 12;
  d.pages.resize(n_pools);
  for (auto& p : d.pages) {
    uint32_t n;
    if (size - at < 4) throw tandem::error("malformed KV descriptor message");
    std::memcpy(&n, data + at, 4);
    at += 4;
    if ((size - at) / 4 < n) throw tandem::error("malformed KV descriptor message");
    p.resize(n);
    if (n) std::memcpy(p.data(), data + at, size_t(n) * 4);
    at += size_t(n) * 4;
  }
  if (at != size) throw tandem::error("malformed KV descriptor message");
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
  const kv_pools_layout here = local.set(), there = remote.set();
  if (here.pools.size() < 2 && there.pools.size() < 2) {
    field("layers", local.layout.n_layers, remote.layout.n_layers);
    field("kv_heads", local.layout.n_kv_heads, remote.layout.n_kv_heads);
    field("head_dim", local.layout.head_dim, remote.layout.head_dim);
    field("page_size", local.layout.page_size, remote.layout.page_size);
    field("components", components_text(local.layout), components_text(remote.layout));
  }
  // Per pool (a one-pool set that differs only in its name or window lands here too).
  if (diff.empty() || here.pools.size() > 1 || there.pools.size() > 1)
    if (std::string pools = explain_kv_pools_mismatch(here, there, remote.node); !pools.empty())
      diff += (diff.empty() ? "" : "; ") + pools;
  if (diff.empty()) return {};
  return fmt::format("KV layout mismatch between node '{}' ({}) and peer '{}' ({}): {}; serve the same model with "
                     "the same kv page size on the prefill and decode nodes",
                     local.node, local.describe(), remote.node, remote.describe(), diff);
}

}  // namespace tandem::ucx
