// libFuzzer target: what a KV peer sends over UCX before any page moves: the handshake
// (decode_challenge and kv_auth::on_challenge, decode_proof and kv_auth::verify, decode_hello
// and check_compatible) and the page descriptors (decode_descriptors, check_page_ids), and the
// notifications with their per-pool manifest (decode_notify).
// First byte % 5: 0 = hello, 1 = descriptors, 2 = challenge, 3 = proof, 4 = notify; the rest is
// the message.
#include <cstdint>
#include <cstdlib>

#include "kernels/base/error.h"
#include "transport/ucx/kv_auth.h"
#include "transport/ucx/kv_handshake.h"
#include "transport/ucx/kv_manifest.h"

namespace {

tandem::ucx::kv_identity local() {
  tandem::ucx::kv_identity id;
  id.node = "local";
  id.model = "r15m";
  id.layout.n_layers = 2;
  id.layout.n_kv_heads = 2;
  id.layout.head_dim = 8;
  id.layout.page_size = 16;
  return id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  using namespace tandem::ucx;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  try {
    if (data[0] % 5 == 4) {
      kv_notify k = decode_notify(p, n);
      auto again = encode_notify(k);
      if (again.size() != n || !std::equal(again.begin(), again.end(), p)) std::abort();
    } else if (data[0] % 5 == 2) {
      // Accepted bytes need not be canonical Cap'n Proto: what was read survives a re-encoding.
      kv_challenge c = decode_challenge(p, n);
      auto again = encode_challenge(c);
      kv_challenge back = decode_challenge(again.data(), again.size());
      if (back.node != c.node || back.nonce != c.nonce) std::abort();
      kv_auth a("fuzz-secret-0123456789", kv_role::acceptor, std::vector<uint8_t>(kv_nonce_bytes, 1));
      if (a.on_challenge(c).empty() && c.nonce.size() != kv_nonce_bytes) std::abort();
    } else if (data[0] % 5 == 3) {
      kv_proof pr = decode_proof(p, n);
      auto again = encode_proof(pr);
      if (decode_proof(again.data(), again.size()).mac != pr.mac) std::abort();
      kv_auth a("fuzz-secret-0123456789", kv_role::acceptor, std::vector<uint8_t>(kv_nonce_bytes, 1));
      (void)a.on_challenge({"peer", std::vector<uint8_t>(kv_nonce_bytes, 2)});
      if (a.verify(pr).empty()) std::abort();  // only the secret's holder passes
    } else if (data[0] % 5 == 0) {
      kv_hello h = decode_hello(p, n);
      if (h.n_pages <= 0) std::abort();  // decode_hello must refuse an empty pool
      // What was read survives a re-encoding (accepted bytes need not be canonical Cap'n Proto:
      // a text's padding, a far pointer).
      auto again = encode_hello(h);
      kv_hello b = decode_hello(again.data(), again.size());
      if (b.id.node != h.id.node || b.id.model != h.id.model || !(b.id.layout == h.id.layout) ||
          !(b.id.set() == h.id.set()) || b.extra_pools.size() != h.extra_pools.size() ||
          b.pool_base != h.pool_base || b.n_pages != h.n_pages || b.rkey != h.rkey || b.worker_address != h.worker_address)
        std::abort();
      (void)check_compatible(local(), h.id);
      (void)h.id.describe();
    } else {
      kv_descriptors d = decode_descriptors(p, n);
      auto again = encode_descriptors(d);
      if (again.size() != n || !std::equal(again.begin(), again.end(), p)) std::abort();
      for (const auto& pool : d.pages) {
        std::string why = check_page_ids(pool, 64);
        for (int32_t pg : pool)
          if ((pg < 0 || pg >= 64) && why.empty()) std::abort();  // an out-of-pool page must be named
      }
    }
  } catch (const tandem::error&) {
  }
  return 0;
}
