#include "transport/ucx/kv_auth.h"

#include <fmt/format.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <capnp/serialize.h>

#include <cstring>

#include "kernels/base/error.h"
#include "schemas/internal.capnp.h"
#include "transport/ucx/kv_wire.h"

namespace tandem::ucx {
namespace {

/// Domain separation: a MAC of this handshake is no MAC of anything else keyed by the secret.
constexpr std::string_view mac_label = "tandem-kv-handshake-v4";

void append(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}

template <typename F>
auto decoding(const char* what, F&& f) {
  try {
    return f();
  } catch (const kj::Exception& e) {
    throw tandem::error(fmt::format("malformed KV handshake {} ({}); both nodes must run the same tandem version",
                                    what, e.getDescription().cStr()));
  }
}

}  // namespace

std::array<uint8_t, 32> hmac_sha256(std::string_view key, const uint8_t* data, size_t size) {
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), int(key.size()), data, size, out.data(), &len) || len != out.size())
    throw tandem::error("HMAC-SHA256 failed (OpenSSL); check the libssl installation");
  return out;
}

bool constant_time_equal(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return false;
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = uint8_t(diff | (a[i] ^ b[i]));
  return diff == 0;
}

std::vector<uint8_t> random_nonce() {
  std::vector<uint8_t> n(kv_nonce_bytes);
  if (RAND_bytes(n.data(), int(n.size())) != 1)
    throw tandem::error("the random number generator failed (OpenSSL RAND_bytes); check the system entropy source");
  return n;
}

std::vector<uint8_t> encode_challenge(const kv_challenge& c) {
  capnp::MallocMessageBuilder mb;
  auto m = mb.initRoot<schema::KvChallenge>();
  m.setNode(c.node);
  m.setNonce(kj::arrayPtr(c.nonce.data(), c.nonce.size()));
  return frame_kv_message(mb);
}

kv_challenge decode_challenge(const uint8_t* data, size_t size) {
  auto words = unframe_kv_message(data, size);
  return decoding("challenge", [&] {
    capnp::FlatArrayMessageReader reader(words.asPtr(), kv_reader_options(words.size()));
    auto m = reader.getRoot<schema::KvChallenge>();
    kv_challenge c;
    c.node = m.getNode().cStr();
    const auto n = m.getNonce();
    c.nonce.assign(n.begin(), n.end());
    return c;
  });
}

std::vector<uint8_t> encode_proof(const kv_proof& p) {
  capnp::MallocMessageBuilder mb;
  auto m = mb.initRoot<schema::KvProof>();
  m.setMac(kj::arrayPtr(p.mac.data(), p.mac.size()));
  return frame_kv_message(mb);
}

kv_proof decode_proof(const uint8_t* data, size_t size) {
  auto words = unframe_kv_message(data, size);
  return decoding("proof", [&] {
    capnp::FlatArrayMessageReader reader(words.asPtr(), kv_reader_options(words.size()));
    const auto mac = reader.getRoot<schema::KvProof>().getMac();
    return kv_proof{std::vector<uint8_t>(mac.begin(), mac.end())};
  });
}

kv_auth::kv_auth(std::string secret, kv_role role, std::vector<uint8_t> nonce)
    : secret_(std::move(secret)), role_(role), nonce_(std::move(nonce)) {
  if (nonce_.size() != kv_nonce_bytes)
    throw tandem::error(fmt::format("a KV handshake nonce has {} bytes, not {}", nonce_.size(), kv_nonce_bytes));
}

std::string kv_auth::on_challenge(const kv_challenge& peer) {
  if (have_challenge_) return "the peer sent a second KV handshake challenge";
  if (peer.nonce.size() != kv_nonce_bytes)
    return fmt::format("the peer's KV handshake nonce has {} bytes, not {}; both nodes must run the same tandem version",
                       peer.nonce.size(), kv_nonce_bytes);
  // Our own nonce sent back would let the peer replay our proof to us.
  if (constant_time_equal(peer.nonce, nonce_)) return "the peer sent back this node's own KV handshake nonce";
  peer_nonce_ = peer.nonce;
  peer_node_ = peer.node;
  have_challenge_ = true;
  return {};
}

std::vector<uint8_t> kv_auth::mac_of(kv_role prover, const std::string& prover_node,
                                     const std::vector<uint8_t>& verifier_nonce,
                                     const std::vector<uint8_t>& prover_nonce) const {
  // label | role | node length | node | verifier's nonce | prover's nonce: lengths fixed or
  // prefixed, so no two different inputs give the same bytes.
  std::vector<uint8_t> msg;
  append(msg, mac_label.data(), mac_label.size());
  const auto r = uint8_t(prover);
  append(msg, &r, 1);
  const auto n = uint32_t(prover_node.size());
  append(msg, &n, 4);
  append(msg, prover_node.data(), prover_node.size());
  append(msg, verifier_nonce.data(), verifier_nonce.size());
  append(msg, prover_nonce.data(), prover_nonce.size());
  auto mac = hmac_sha256(secret_, msg.data(), msg.size());
  return {mac.begin(), mac.end()};
}

kv_proof kv_auth::prove(const std::string& node) const {
  if (!enabled() || !have_challenge_) return {};
  return {mac_of(role_, node, peer_nonce_, nonce_)};
}

std::string kv_auth::verify(const kv_proof& proof) const {
  if (!have_challenge_) return "the peer sent its KV handshake proof before its challenge";
  if (!enabled()) {
    if (proof.mac.empty()) return {};
    return fmt::format("KV peer '{}' authenticates with a cluster secret but this node has none; set the same "
                       "[security] api_key_file on every node",
                       peer_node_);
  }
  if (proof.mac.empty())
    return fmt::format("KV peer '{}' sent no proof of the cluster secret; set the same [security] api_key_file on "
                       "every node",
                       peer_node_);
  const kv_role peer_role = role_ == kv_role::dialer ? kv_role::acceptor : kv_role::dialer;
  if (!constant_time_equal(proof.mac, mac_of(peer_role, peer_node_, nonce_, peer_nonce_)))
    return fmt::format("KV peer '{}' failed the cluster secret check (wrong key); give every node the same first key "
                       "in [security] api_key_file",
                       peer_node_);
  return {};
}

}  // namespace tandem::ucx
