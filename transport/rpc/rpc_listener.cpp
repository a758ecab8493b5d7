#include "transport/rpc/rpc_listener.h"

#include <capnp/rpc-twoparty.h>
#include <sys/socket.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "schemas/auth.capnp.h"

namespace tandem {

struct rpc_listener::connection {
  connection(kj::Own<kj::AsyncIoStream> s, const capnp::ReaderOptions& opt, capnp::Capability::Client bootstrap)
      : stream(kj::mv(s)),
        network(*stream, capnp::rpc::twoparty::Side::SERVER, opt),
        rpc(capnp::makeRpcServer(network, kj::mv(bootstrap))) {}
  kj::Own<kj::AsyncIoStream> stream;
  capnp::TwoPartyVatNetwork network;
  capnp::RpcSystem<capnp::rpc::twoparty::VatId> rpc;
};

/// The bootstrap of every connection: trades a valid key for the real capability.
class rpc_listener::gate final : public auth::Gate::Server {
 public:
  explicit gate(rpc_listener& l) : l_(l) {}

 protected:
  kj::Promise<void> authenticate(AuthenticateContext ctx) override {
    auto key = ctx.getParams().getKey();
    if (l_.keys_ && !l_.keys_->check(std::string_view(key.begin(), key.size()))) {
      ++l_.auth_failures_;
      spdlog::warn("{}: refused a connection's API key", l_.name_);
      return KJ_EXCEPTION(FAILED, kj::str(fmt::format(
                                      "{}: {}; pass one of the node's API keys (--api-key-file FILE of the client, or "
                                      "the TANDEM_API_KEY environment variable)",
                                      l_.name_, key.size() == 0 ? "an API key is required" : "the API key is not valid")));
    }
    ctx.getResults().setCap(l_.bootstrap_);
    return kj::READY_NOW;
  }

 private:
  rpc_listener& l_;
};

void rpc_listener::log_errors::taskFailed(kj::Exception&& e) {
  // A peer that went away is routine (client closed); its requests were aborted.
  if (e.getType() == kj::Exception::Type::DISCONNECTED)
    spdlog::debug("{}: {}", name, e.getDescription().cStr());
  else
    spdlog::warn("{}: {}", name, e.getDescription().cStr());
}

rpc_listener::rpc_listener(std::string name, const limits& lim)
    : name_(std::move(name)), lim_(lim), tasks_(error_handler_) {}

rpc_listener::~rpc_listener() = default;

kj::Promise<void> rpc_listener::listen(kj::ConnectionReceiver& listener) {
  return listener.accept().then([this, &listener](kj::Own<kj::AsyncIoStream> s) {
    if (open_ >= lim_.max_rpc_connections) {
      ++rejected_;
      spdlog::warn("{}: {} connections open (limits.max_rpc_connections); closing a new one", name_, open_);
    } else {
      tasks_.add(serve(kj::mv(s)));
    }
    return listen(listener);
  });
}

capnp::ReaderOptions rpc_listener::reader_options(const limits& lim) {
  capnp::ReaderOptions opt;
  // Words of 8 bytes, with headroom for the message framing.
  opt.traversalLimitInWords = static_cast<uint64_t>(lim.max_body_bytes) / 8 + 1024;
  opt.nestingLimit = 64;
  return opt;
}

kj::Promise<void> rpc_listener::serve(kj::Own<kj::AsyncIoStream> s) {
  KJ_IF_MAYBE(fd, s->getFd()) {
    // Cap'n Proto's stream window follows SO_SNDBUF: a fixed size keeps loopback autotuning from
    // letting a client that stopped reading hold megabytes in flight.
    int bytes = lim_.rpc_socket_bytes;
    ::setsockopt(*fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  }
  auto c = kj::heap<connection>(kj::mv(s), reader_options(lim_), kj::heap<gate>(*this));
  ++open_;
  auto done = c->network.onDisconnect();
  return done.attach(kj::mv(c), kj::defer([this] { --open_; }));
}

}  // namespace tandem
