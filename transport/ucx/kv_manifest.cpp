#include "transport/ucx/kv_manifest.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <cstring>

#include "kernels/base/error.h"

namespace tandem::ucx {

digest_builder::digest_builder() : state_(XXH3_createState()) {
  if (!state_) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}

digest_builder::~digest_builder() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

void digest_builder::add(const uint8_t* bytes, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), bytes, n);
}

pool_digest digest_builder::finish() const {
  return {pages_, XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_))};
}

pool_digest digest_pages(const kv_pool& pool, std::span<const int32_t> ids) {
  digest_builder b;
  for (int32_t p : ids) {
    if (p < 0) continue;
    b.add(pool.page_data(p), pool.page_bytes());
    b.add_page();
  }
  return b.finish();
}

std::vector<uint8_t> encode_notify(const kv_notify& n) {
  const bool done = n.kind == notify_kind::done;
  std::vector<uint8_t> msg(9 + (done ? 1 + n.manifest.size() * 12 : 0));
  std::memcpy(msg.data(), &n.transfer, 8);
  msg[8] = uint8_t(n.kind);
  if (!done) return msg;
  if (n.manifest.size() > max_kv_pools) throw tandem::error("a KV manifest of more pools than a layout set has");
  msg[9] = uint8_t(n.manifest.size());
  uint8_t* at = msg.data() + 10;
  for (const pool_digest& d : n.manifest) {
    std::memcpy(at, &d.pages, 4);
    std::memcpy(at + 4, &d.hash, 8);
    at += 12;
  }
  return msg;
}

kv_notify decode_notify(const uint8_t* data, size_t size) {
  if (size < 9) throw tandem::error("malformed KV notification");
  kv_notify n;
  std::memcpy(&n.transfer, data, 8);
  if (data[8] > uint8_t(notify_kind::cancel)) throw tandem::error("unknown KV notification kind");
  n.kind = notify_kind(data[8]);
  if (n.kind != notify_kind::done) {
    if (size != 9) throw tandem::error("malformed KV notification");
    return n;
  }
  if (size < 10 || data[9] > max_kv_pools || size != 10 + size_t(data[9]) * 12)
    throw tandem::error("malformed KV manifest");
  n.manifest.resize(data[9]);
  const uint8_t* at = data + 10;
  for (pool_digest& d : n.manifest) {
    std::memcpy(&d.pages, at, 4);
    std::memcpy(&d.hash, at + 4, 8);
    at += 12;
  }
  return n;
}

std::string check_manifest(const kv_manifest& source, const kv_manifest& received, const kv_pools_layout& set,
                           fail_reason& reason) {
  auto label = [&](size_t p) {
    return p < set.pools.size() ? fmt::format("pool {} ({})", p, set.pools[p].name) : fmt::format("pool {}", p);
  };
  reason = fail_reason::manifest;
  if (source.size() != received.size()) {
    const size_t p = std::min(source.size(), received.size());
    return fmt::format("the source's manifest lists {} pools, {} were expected; {} is missing", source.size(),
                       received.size(), label(p));
  }
  for (size_t p = 0; p < source.size(); ++p)
    if (source[p].pages != received[p].pages)
      return fmt::format("{}: the source wrote {} pages, {} were expected; the pool is missing from the transfer",
                         label(p), source[p].pages, received[p].pages);
  reason = fail_reason::checksum;
  for (size_t p = 0; p < source.size(); ++p)
    if (source[p].hash != received[p].hash)
      return fmt::format("{}: checksum {:016x} of the {} pages received differs from the source's {:016x}; the KV "
                         "was corrupted in transit",
                         label(p), received[p].hash, received[p].pages, source[p].hash);
  return {};
}

}  // namespace tandem::ucx
