#pragma once
/// Authentication of the KV handshake with the cluster secret: a challenge-response in which
/// each side proves knowledge of the secret with an HMAC over a fresh nonce of the peer, before
/// either side sends its rkey (docs/kv_transfer.md, "Handshake"). Pure logic: the engine sends
/// and receives the bytes.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::ucx {

/// Bytes of a handshake nonce (and of an HMAC-SHA256).
constexpr size_t kv_nonce_bytes = 32;

/// Which end of the control endpoint a side is: part of what the MAC covers, so a proof
/// cannot be reflected back to the side that made it.
enum class kv_role : uint8_t { dialer = 1, acceptor = 2 };

/// HMAC-SHA256 of `data` under `key` (OpenSSL).
std::array<uint8_t, 32> hmac_sha256(std::string_view key, const uint8_t* data, size_t size);

/// True if `a` and `b` are equal; the time depends on the sizes only, not on the content.
bool constant_time_equal(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

/// A fresh random nonce (OpenSSL RAND_bytes). Throws tandem::error if the RNG fails.
std::vector<uint8_t> random_nonce();

/// The first message on a new control endpoint: who we are and the nonce the peer must MAC.
struct kv_challenge {
  std::string node;
  std::vector<uint8_t> nonce;
};

/// The second message: the MAC over the peer's nonce (empty when this side has no secret).
struct kv_proof {
  std::vector<uint8_t> mac;
};

std::vector<uint8_t> encode_challenge(const kv_challenge& c);
/// Throws tandem::error if the bytes are not a challenge of this protocol version.
kv_challenge decode_challenge(const uint8_t* data, size_t size);
std::vector<uint8_t> encode_proof(const kv_proof& p);
/// Throws tandem::error if the bytes are not a proof of this protocol version.
kv_proof decode_proof(const uint8_t* data, size_t size);

/// One side of one handshake: its nonce, role and the secret ("" = authentication off).
class kv_auth {
 public:
  kv_auth(std::string secret, kv_role role, std::vector<uint8_t> nonce);

  bool enabled() const { return !secret_.empty(); }
  /// Our challenge, naming `node`.
  kv_challenge challenge(const std::string& node) const { return {node, nonce_}; }
  /// Reads the peer's challenge; empty if accepted, else why it is refused (a reflected nonce,
  /// a nonce of the wrong size).
  std::string on_challenge(const kv_challenge& peer);
  /// Our proof over the peer's nonce (call after on_challenge accepted it).
  kv_proof prove(const std::string& node) const;
  /// Checks the peer's proof; empty if it passes, else why the peer is refused (and the fix).
  std::string verify(const kv_proof& proof) const;

 private:
  std::vector<uint8_t> mac_of(kv_role prover, const std::string& prover_node,
                              const std::vector<uint8_t>& verifier_nonce,
                              const std::vector<uint8_t>& prover_nonce) const;

  std::string secret_;
  kv_role role_;
  std::vector<uint8_t> nonce_;
  std::vector<uint8_t> peer_nonce_;
  std::string peer_node_;
  bool have_challenge_ = false;
};

}  // namespace tandem::ucx
