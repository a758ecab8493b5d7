// The KV handshake's authentication (kv_auth: HMAC challenge-response with the cluster secret),
// the interface UCX is restricted to (kv_netdev), and a rogue peer against a real engine.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <optional>

#include "kernels/base/error.h"
#include "transport/ucx/kv_auth.h"
#include "transport/ucx/kv_engine.h"
#include "transport/ucx/kv_netdev.h"

using namespace tandem;
using namespace tandem::ucx;

namespace {

const std::string secret = "0123456789abcdef0123456789abcdef";

/// A dialer and an acceptor that exchanged challenges.
struct pair_of_sides {
  kv_auth dialer, acceptor;
  pair_of_sides(const std::string& dialer_secret, const std::string& acceptor_secret)
      : dialer(dialer_secret, kv_role::dialer, random_nonce()), acceptor(acceptor_secret, kv_role::acceptor, random_nonce()) {
    REQUIRE(dialer.on_challenge(acceptor.challenge("prefill-0")) == "");
    REQUIRE(acceptor.on_challenge(dialer.challenge("decode-0")) == "");
  }
};

}  // namespace

TEST_CASE("kv auth: HMAC-SHA256 matches RFC 4231 test case 2, and the compare is exact") {
  const std::string data = "what do ya want for nothing?";
  auto mac = hmac_sha256("Jefe", reinterpret_cast<const uint8_t*>(data.data()), data.size());
  const uint8_t want[8] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e};
  for (int i = 0; i < 8; ++i) CHECK(mac[size_t(i)] == want[i]);
  CHECK(constant_time_equal({1, 2, 3}, {1, 2, 3}));
  CHECK_FALSE(constant_time_equal({1, 2, 3}, {1, 2, 4}));
  CHECK_FALSE(constant_time_equal({1, 2, 3}, {1, 2}));
  CHECK(random_nonce() != random_nonce());
}

TEST_CASE("kv auth: both sides with the secret pass, and without secrets both pass") {
  pair_of_sides s(secret, secret);
  CHECK(s.acceptor.verify(s.dialer.prove("decode-0")) == "");
  CHECK(s.dialer.verify(s.acceptor.prove("prefill-0")) == "");
  pair_of_sides off("", "");
  CHECK(off.dialer.prove("decode-0").mac.empty());
  CHECK(off.acceptor.verify(off.dialer.prove("decode-0")) == "");
}

TEST_CASE("kv auth: no secret, a wrong secret, a replayed or reflected proof, another name are refused") {
  pair_of_sides none("", secret);
  CHECK(none.acceptor.verify(none.dialer.prove("decode-0")).find("sent no proof of the cluster secret") !=
        std::string::npos);
  CHECK(none.dialer.verify(none.acceptor.prove("prefill-0")).find("this node has none") != std::string::npos);
  pair_of_sides wrong("another-secret-of-32-bytes-xxxxx", secret);
  CHECK(wrong.acceptor.verify(wrong.dialer.prove("decode-0")).find("wrong key") != std::string::npos);
  // Replay: a proof recorded in one handshake fails in the next (the acceptor's nonce is new).
  pair_of_sides first(secret, secret), second(secret, secret);
  CHECK(second.acceptor.verify(first.dialer.prove("decode-0")).find("wrong key") != std::string::npos);
  // Reflection: the acceptor's own proof sent back to it is a proof of the other role.
  CHECK(first.acceptor.verify(first.acceptor.prove("decode-0")).find("wrong key") != std::string::npos);
  // The name is covered: a proof made as decode-0 does not pass as decode-1.
  pair_of_sides named(secret, secret);
  CHECK(named.acceptor.verify(named.dialer.prove("decode-1")).find("wrong key") != std::string::npos);
  // The own nonce sent back is refused before any proof is made.
  kv_auth a(secret, kv_role::acceptor, random_nonce());
  CHECK(a.on_challenge(a.challenge("x")).find("own KV handshake nonce") != std::string::npos);
  kv_auth b(secret, kv_role::acceptor, random_nonce());
  CHECK(b.on_challenge({"x", {1, 2, 3}}).find("has 3 bytes") != std::string::npos);
  CHECK(b.verify({}).find("before its challenge") != std::string::npos);
}

TEST_CASE("kv auth: challenge and proof round-trip, and bad bytes are refused") {
  kv_challenge c{"decode-0", random_nonce()};
  auto bytes = encode_challenge(c);
  auto back = decode_challenge(bytes.data(), bytes.size());
  CHECK(back.node == c.node);
  CHECK(back.nonce == c.nonce);
  kv_proof p{std::vector<uint8_t>(32, 7)};
  auto pb = encode_proof(p);
  CHECK(decode_proof(pb.data(), pb.size()).mac == p.mac);
  CHECK_THROWS_AS(decode_proof(pb.data(), pb.size() - 1), tandem::error);
  auto bad = pb;
  bad[4] = 3;  // version 3: the unauthenticated handshake
  CHECK_THROWS_WITH_AS(decode_proof(bad.data(), bad.size()), doctest::Contains("KV handshake version 3"), tandem::error);
}

TEST_CASE("kv netdev: the interface of the node's host, lo for loopback, nothing for a wildcard") {
  std::vector<if_address> ifs = {{"lo", "127.0.0.1"}, {"eth0", "10.0.0.5"}};
  CHECK(net_devices_for_host("127.0.0.1", ifs) == "lo");
  CHECK(net_devices_for_host("127.0.0.2", ifs) == "lo");
  CHECK(net_devices_for_host("10.0.0.5", ifs) == "eth0");
  CHECK(net_devices_for_host("0.0.0.0", ifs) == "");
  CHECK(net_devices_for_host("10.9.9.9", ifs) == "");
  bool has_lo = false;
  for (const auto& i : interface_addresses()) has_lo = has_lo || i.ipv4 == "127.0.0.1";
  CHECK(has_lo);
}

namespace {

kv_layout tiny_layout() {
  kv_layout l;
  l.n_layers = 2;
  l.n_kv_heads = 1;
  l.head_dim = 4;
  l.page_size = 4;
  return l;
}

struct side {
  kv_pool pool{tiny_layout(), 8};
  kv_engine engine;
  side(const manual_clock& clock, const std::string& name, const std::string& key)
      : engine(clock, pool, kv_identity{name, "r15m", "f32", tiny_layout()}, options(key),
               [](transfer_id, transfer_role, const pool_pages&, bool) {}) {}
  static engine_options options(const std::string& key) {
    engine_options o;
    o.tls = "tcp";
    o.secret = key;
    o.net_devices = "lo";
    return o;
  }
};

/// Progresses both until `done`, or for `ms` of wall time; false if `done` never held.
template <class F>
bool pump(side& a, side& b, F done, int ms = 20000) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (!done()) {
    a.engine.progress();
    b.engine.progress();
    if (std::chrono::steady_clock::now() > until) return false;
  }
  return true;
}

/// The decode side dials the prefill side's listener and asks for peer readiness.
void dial(side& prefill, side& decode) {
  uint16_t port = prefill.engine.listen("127.0.0.1");
  peer_id p = decode.engine.add_peer("127.0.0.1", port);
  decode.engine.table().start_receive(7, p, {{1, 2}});
}

}  // namespace

TEST_CASE("kv_engine: peers with the same cluster secret connect, and UCX is held to lo") {
  manual_clock clock;
  side prefill(clock, "prefill-0", secret), decode(clock, "decode-0", secret);
  CHECK(prefill.engine.net_devices_used().find("lo") == 0);
  dial(prefill, decode);
  REQUIRE(pump(prefill, decode, [&] {
    auto p = prefill.engine.peer_named("decode-0");
    return p && prefill.engine.peer_ready(*p);
  }));
  CHECK(prefill.engine.hellos_received() == 1);
  CHECK(decode.engine.hellos_received() == 1);
  CHECK(prefill.engine.handshakes_refused() == 0);
}

TEST_CASE("kv_engine: a rogue peer without the secret, or with a wrong one, is refused and gets no rkey") {
  for (const std::string& rogue_key : {std::string(), std::string("a-wrong-secret-of-32-bytes-xxxxxx")}) {
    CAPTURE(rogue_key);
    manual_clock clock;
    side prefill(clock, "prefill-0", secret), rogue(clock, "decode-0", rogue_key);
    dial(prefill, rogue);
    REQUIRE(pump(prefill, rogue, [&] { return prefill.engine.handshakes_refused() >= 1; }));
    // Keep both running a while: nothing more arrives on either side.
    pump(prefill, rogue, [] { return false; }, 300);
    CHECK(prefill.engine.hellos_sent() == 0);
    CHECK(rogue.engine.hellos_received() == 0);
    CHECK(prefill.engine.hellos_received() == 0);
    CHECK_FALSE(prefill.engine.peer_named("decode-0").has_value());
    CHECK(prefill.engine.last_peer_error().find("cluster secret") != std::string::npos);
  }
}
